"""Malformed bodies are 400s naming the field: wrong JSON types (no coercion), unknown fields, NaN;
an OpenAI field Keel does not serve is UNSUPPORTED_PARAMETER naming it, unless sent empty."""
from __future__ import annotations

import pytest

from services.openai import httperrors
from services.openai.schemas import ChatBody, CompletionBody, parse
from shared import errors

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("change,field", [
    ({"temperature": "1"}, "temperature"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"seed": "7"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stop": [1]}, "stop.0"),
    ({"stop": 3}, "stop"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages.0.name"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages.0.tool_calls"),
    ({"messages": "hi"}, "messages"),
    ({"bogus": 1}, "bogus"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"store": "no"}, "store"),
    ({"service_tier": 1}, "service_tier"),
    ({"stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"model": None}, "model"),
])
def test_a_bad_field_is_named(change, field):
    with pytest.raises(errors.InvalidInput) as exc:
        parse(ChatBody, {**OK, **change})
    err = exc.value
    assert err.reason == "INVALID_BODY" and err.metadata["field"] == field
    body = httperrors.error_body(err)["error"]
    assert httperrors.http_status(err) == 400 and body["param"] == field and body["code"] == "INVALID_BODY"
    assert body["type"] == "invalid_request_error" and field in body["message"]


@pytest.mark.parametrize("data", [[], "x", 3, None])
def test_a_body_that_is_not_an_object(data):
    with pytest.raises(errors.InvalidInput) as exc:
        parse(CompletionBody, data)
    assert exc.value.metadata["field"] == "(body)"


def test_a_missing_required_field_is_named():
    with pytest.raises(errors.InvalidInput) as exc:
        parse(CompletionBody, {"model": "m"})
    assert exc.value.metadata["field"] == "prompt"


@pytest.mark.parametrize("cls,change,field", [
    (ChatBody, {"functions": [{"name": "f"}]}, "functions"),
    (ChatBody, {"function_call": "auto"}, "function_call"),
    (ChatBody, {"logit_bias": {"50256": -100}}, "logit_bias"),
    (ChatBody, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CompletionBody, {"suffix": "end"}, "suffix"),
    (CompletionBody, {"best_of": 2}, "best_of"),
])
def test_a_field_keel_does_not_serve_is_unsupported_not_a_typo(cls, change, field):
    base = OK if cls is ChatBody else {"model": "m", "prompt": "hi"}
    with pytest.raises(errors.InvalidInput) as exc:
        parse(cls, {**base, **change})
    assert (exc.value.reason, exc.value.metadata["field"]) == ("UNSUPPORTED_PARAMETER", field)
    assert httperrors.error_body(exc.value)["error"]["param"] == field


def test_what_harms_nothing_is_accepted():
    body = parse(ChatBody, {**OK, "tools": [], "tool_choice": None, "logit_bias": {}, "metadata": {"team": "a"},
                            "store": False, "user": "u-1", "safety_identifier": "s", "service_tier": "auto",
                            "prompt_cache_key": "k", "stream_options": {"include_usage": True,
                                                                        "include_obfuscation": False},
                            "messages": [{"role": "user", "content": "hi", "name": "ann"},
                                         {"role": "assistant", "content": None, "tool_calls": []},
                                         {"role": "user", "content": "again"}]})
    assert [m.text for m in body.messages] == ["hi", "", "again"] and body.metadata == {"team": "a"}
