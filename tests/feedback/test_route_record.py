"""A replay record's routing decision survives the feedback stage: proto -> record -> stored body ->
record; a record stored before the field existed reads back with none."""
from __future__ import annotations

from keel.common.v1 import common_pb2
from keel.feedback.v1 import feedback_pb2
from services.feedback.records import ReplayRecord, stored_body
from services.feedback.servicer import record_from_proto


def proto(**kw) -> feedback_pb2.ReplayRecord:
    return feedback_pb2.ReplayRecord(trace_id="a" * 32, prompt_ids=[1, 2], output_ids=[3],
                                     sampling=common_pb2.SamplingParams(max_tokens=4, seed=7), **kw)


def test_the_route_is_stored_and_read_back():
    route = feedback_pb2.RouteDecision(replica="10.0.0.7:50052", policy="prefix_affinity", reason="prefix",
                                       matched_blocks=3)
    rec = record_from_proto(proto(route=route))
    assert rec.route == {"replica": "10.0.0.7:50052", "policy": "prefix_affinity", "reason": "prefix",
                         "matched_blocks": 3}
    assert ReplayRecord.from_body(stored_body(rec, store_prompts=False)).route == rec.route


def test_no_route_reads_back_as_none():
    rec = record_from_proto(proto())
    assert rec.route == {}
    body = stored_body(rec, store_prompts=True)
    del body["route"]                                   # stored before routing was recorded
    assert ReplayRecord.from_body(body).route == {}
