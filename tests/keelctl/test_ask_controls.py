"""`keel ask`'s generation-control flags become the request's fields; logprobs are printed."""
from __future__ import annotations

import pytest

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.main import main


@pytest.fixture
def sent(monkeypatch):
    requests = []

    def fake_ask(target, request, **kw):
        requests.append(request)
        return gateway_pb2.GenerateResponse(text="yes", finish_reason="stop", logprobs=[common_pb2.TokenLogprob(
            token="yes", token_id=7, logprob=-0.25, top_logprobs=[common_pb2.TopLogprob(token="no", logprob=-1.5)])])
    monkeypatch.setattr("keelctl.ask.ask", fake_ask)
    monkeypatch.setattr("keelctl.main._gateway", lambda _layout: "unused:0")
    monkeypatch.setattr("keelctl.main.load_layout", lambda: None)
    return requests


def test_stop_choice_logprobs_and_penalties_are_sent(sent, capsys):
    assert main(["ask", "hi", "--stop", "\n", "--stop", "END", "--choice", "yes", "--choice", "no", "--logprobs", "2",
                 "--presence-penalty", "0.5", "--repetition-penalty", "1.5"]) == 0
    (req,) = sent
    s = req.sampling
    assert list(s.stop) == ["\n", "END"] and s.logprobs and s.top_logprobs == 2
    assert s.presence_penalty == 0.5 and s.repetition_penalty == 1.5 and s.frequency_penalty == 0
    assert list(req.response_format.choice.values) == ["yes", "no"]
    out = capsys.readouterr().out
    assert "'yes'   -0.2500  'no' -1.5000" in out


def test_json_schema_comes_from_a_file_and_regex_is_exclusive_with_it(sent, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "integer"}')
    assert main(["ask", "hi", "--json-schema", str(schema)]) == 0
    assert sent[0].response_format.json_schema == '{"type": "integer"}' and not sent[0].sampling.logprobs
    assert sent[0].sampling.repetition_penalty == 0  # unset: off
    with pytest.raises(SystemExit):
        main(["ask", "hi", "--json-schema", str(schema), "--regex", "a+"])
