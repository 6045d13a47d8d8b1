"""The generation controls survive the replay record: gateway record -> its stored JSON -> the replay's request."""
from __future__ import annotations

import dataclasses

import pytest

from keelctl.replay import request_of
from services.feedback.records import ReplayRecord, stored_body
from services.feedback.servicer import record_from_proto
from services.gateway.recording import to_record
from shared.controls import Controls, ResponseFormat, controls_of, format_of
from tests.gateway.test_recording import served

CONTROLS = [
    Controls(stop=("\n\n", "END"), repetition_penalty=1.25, frequency_penalty=0.5, presence_penalty=-0.75,
             logprobs=True, top_logprobs=2, response_format=ResponseFormat("json_schema", '{"type": "integer"}')),
    Controls(response_format=ResponseFormat("regex", "[a-z]+")),
    Controls(response_format=ResponseFormat("choice", choices=("yes", "no"))),
    Controls(),
]


@pytest.mark.parametrize("controls", CONTROLS)
def test_a_replay_asks_for_the_same_controls(controls):
    s = served("t" * 32)
    s = dataclasses.replace(s, ask=dataclasses.replace(s.ask, controls=controls))
    req = request_of(ReplayRecord.from_body(stored_body(record_from_proto(to_record(s, 1)), True)))
    again = controls_of(req.sampling, req.response_format if req.HasField("response_format") else None)
    assert again == controls
    assert req.sampling.seed == 1234 and format_of(None) is None


def test_a_record_from_before_the_controls_replays_with_none():
    body = stored_body(record_from_proto(to_record(served("t" * 32), 1)), True)
    for key in ("stop", "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs"):
        del body["sampling"][key]
    del body["response_format"]
    req = request_of(ReplayRecord.from_body(body))
    assert controls_of(req.sampling, None) == Controls() and not req.HasField("response_format")


@pytest.mark.parametrize("form", ["chat", "text", "token_ids"])
def test_a_replay_sends_the_input_in_the_form_it_came(form):
    """A conversation goes back as chat, a raw text as text (no template), token ids as those ids."""
    s = served("t" * 32)
    if form == "text":
        s = dataclasses.replace(s, ask=dataclasses.replace(s.ask, messages=(), text="def fib(n):"))
    elif form == "token_ids":
        s = dataclasses.replace(s, ask=dataclasses.replace(s.ask, messages=(), token_ids=(1, 2, 3)))
    kept = ReplayRecord.from_body(stored_body(record_from_proto(to_record(s, 1)), True))
    req = request_of(kept)
    assert req.WhichOneof("input") == {"chat": "chat", "text": "text", "token_ids": None}[form]
    if form == "chat":
        assert [(m.role, m.content) for m in req.chat.messages] == [("user", "hi")]
    elif form == "text":
        assert req.text == "def fib(n):" and not req.token_ids
    else:
        assert list(req.token_ids) == [1, 2, 3]
    hidden = ReplayRecord.from_body(stored_body(record_from_proto(to_record(s, 1)), False))
    assert hidden.text is None and hidden.messages is None  # prompts not stored: no input text either
