"""keel-client's generation-control arguments build the request's fields; results carry logprobs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients/python/src"))
from keel_client import types  # noqa: E402


def test_controls_are_sent_as_the_proto_fields():
    req = types.request("hi", stop=["\n"], repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5,
                        logprobs=True, top_logprobs=2, json_schema={"type": "integer"})
    s = req.sampling
    assert list(s.stop) == ["\n"] and s.logprobs and s.top_logprobs == 2 and s.presence_penalty == -0.5
    assert req.response_format.json_schema == '{"type": "integer"}'
    assert list(types.request("hi", choice=["a", "b"]).response_format.choice.values) == ["a", "b"]
    assert types.request("hi", regex="x+").response_format.regex == "x+"
    assert not types.request("hi").HasField("response_format")
    with pytest.raises(ValueError):
        types.request("hi", regex="x", choice=["a"])


def test_logprobs_come_back_on_answers_and_deltas():
    lp = common_pb2.TokenLogprob(token="a", token_id=3, logprob=-0.5,
                                 top_logprobs=[common_pb2.TopLogprob(token="b", token_id=4, logprob=-1.0)])
    answer = types.answer(gateway_pb2.GenerateResponse(text="a", logprobs=[lp]))
    assert answer.logprobs == (types.TokenLogprob("a", 3, -0.5, (types.Alternative("b", 4, -1.0),)),)
    delta = types.event(gateway_pb2.GenerateStreamResponse(delta="a", logprobs=[lp]))
    assert delta.text == "a" and delta.logprobs == answer.logprobs
