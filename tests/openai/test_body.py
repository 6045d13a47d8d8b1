"""Malformed bodies are 400s naming the field: wrong JSON types (no coercion), unknown fields, NaN."""
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
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages.0.name"),
    ({"messages": "hi"}, "messages"),
    ({"tools": []}, "tools"),
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
