"""The values a request becomes on its way through the gateway (services/gateway/pipeline.py): the
encoded prompt, the inference stream's steps and its end, the streamed deltas, the prepared and
generated request, the answer, and what a replay record keeps of it."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Mapping

from keel.common.v1 import common_pb2
from services.gateway import tools
from services.gateway.contract import Ask
from services.gateway.routing import Decision


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool
    original_length: int
    fingerprint: str
    vocab_sha256: str = ""          # the tokenizer's identity, as its Encode reported it (replay records)
    chat_template_sha256: str = ""


@dataclass(frozen=True)
class Step:
    """One streamed token (id + its entropy; its logprobs when the request asked for them)."""
    token_id: int
    entropy: float
    logprobs: common_pb2.TokenLogprob | None = None


@dataclass(frozen=True)
class Delta:
    """A piece of streamed text, with the logprobs of the tokens it comes from."""
    text: str
    logprobs: tuple[common_pb2.TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seed: int
    engine: dict[str, str] = field(default_factory=dict)  # facts of the serving engine (e.g. format)
    replica: str = ""  # the inference replica that generated it (failures seen later are reported there)
    adapter: str = ""  # the LoRA adapter that served it as "id@version" ("" = the base model)
    prompt_logprobs: tuple[common_pb2.TokenLogprob, ...] = ()  # with controls.prompt_logprobs
    route: Decision | None = None  # how the router picked `replica` (None: one replica, no choice)

    @property
    def system_fingerprint(self) -> str:
        """The engine facts as one short id for clients (GenerateResponse.system_fingerprint)."""
        if not self.engine:
            return ""
        return hashlib.sha256(json.dumps(self.engine, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Served:
    """Everything a replay record holds about one answered request (see services/gateway/recording.py):
    the Ask as served and as sent (None: the same), and the calls the answer made."""
    ask: Ask
    encoded: Encoded
    done: Done
    output_ids: list[int]
    validation: common_pb2.ValidationResult
    trace_id: str
    sent: Ask | None = None
    tool_calls: tuple[tools.ToolCall, ...] = ()


@dataclass
class Answer:
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seed: int = 0
    prompt_truncated: bool = False
    input_flags: list[str] = field(default_factory=list)
    # The validator's result as the shared type of keel.common.v1, passed through unchanged.
    validation: common_pb2.ValidationResult = field(default_factory=common_pb2.ValidationResult)
    trace_id: str = ""
    system_fingerprint: str = ""
    adapter: str = ""  # as the engine answered: "id@version", "" = the base model
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # with controls.logprobs
    prompt_logprobs: tuple[common_pb2.TokenLogprob, ...] = ()  # with controls.prompt_logprobs
    tool_calls: tuple[tools.ToolCall, ...] = ()  # the model's calls (finish_reason "tool_calls")


@dataclass(frozen=True)
class Call:
    """What the gateway knows about the client's call, made once by the servicer and carried by
    every step: the absolute monotonic deadline, the trace id, and the inbound metadata (the
    retry policy reads whether the call is itself a retry)."""
    deadline: float
    trace_id: str
    inbound: Mapping[str, str] = field(default_factory=dict)
    # The client set no deadline: ``deadline`` is the gateway's default (services/gateway/deadlines.py).
    default_deadline: bool = False


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` made of an accepted Ask: the Ask as it is served (its max_tokens fitted to
    the context), the encoded prompt, the input flags, the seed, and with echo the prompt's text
    as the answer repeats it (the text as sent, or the kept part's decoded text when it was cut), and
    the Ask as the client sent it (before a request's tools were rendered into its conversation)."""
    ask: Ask
    enc: Encoded
    flags: list[str]
    seed: int
    echo: str = ""
    sent: Ask | None = None


@dataclass(frozen=True)
class Generated:
    """The model's answer before output validation: its text (cut before any stop string), token
    ids, their entropies and their logprobs (when asked for)."""
    raw: str
    ids: list[int]
    entropies: list[float]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    stopped: bool = False  # a stop string ended it
