"""Every stage's identity, once: its gRPC service name, taken from the generated descriptors (so a
renamed service or package can never drift from what health checks, clients and the supervisor
use), and the order the supervisor starts them in (dependencies first)."""
from __future__ import annotations

from keel.feedback.v1 import feedback_pb2
from keel.gateway.v1 import gateway_pb2
from keel.inference.v1 import inference_pb2
from keel.tokenizer.v1 import tokenizer_pb2
from keel.validator.v1 import validator_pb2

SERVICE_NAMES: dict[str, str] = {
    "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name,
    "inference": inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
    "validator": validator_pb2.DESCRIPTOR.services_by_name["Validator"].full_name,
    "feedback": feedback_pb2.DESCRIPTOR.services_by_name["Feedback"].full_name,
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name,
}
# The order `keel up` starts the stages in: each after the ones it calls.
STAGE_ORDER = ("validator", "tokenizer", "inference", "feedback", "gateway", "openai")
# Stages that serve HTTP rather than gRPC (no service name; health is their `GET /health`).
HTTP_STAGES = ("openai",)
# The stages the gateway calls on the request path (the feedback stage is off it).
GATEWAY_UPSTREAMS = ("tokenizer", "inference", "validator")
