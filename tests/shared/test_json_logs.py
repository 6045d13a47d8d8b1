"""The JSON log formatter: one JSON object per record, context from the interceptor's variables."""
from __future__ import annotations

import json
import logging
import sys

from shared.logging import JsonFormatter, rpc_var, trace_id_var


def record(msg="hello %s", args=("world",), level=logging.INFO, exc_info=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("keel.test", level, __file__, 1, msg, args, exc_info)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def fmt(rec: logging.LogRecord) -> dict:
    line = JsonFormatter("tokenizer").format(rec)
    assert "\n" not in line  # one line per record
    return json.loads(line)


def test_standard_fields():
    out = fmt(record(level=logging.WARNING))
    assert out["msg"] == "hello world" and out["level"] == "WARNING" and out["service"] == "tokenizer"
    assert out["logger"] == "keel.test" and out["trace_id"] == "" and out["rpc"] == ""
    assert isinstance(out["ts"], float) and len(out["time"]) == 19 and out["time"][10] == "T"
    assert "args" not in out and "levelno" not in out  # LogRecord internals stay out


def test_extras_are_top_level_keys_and_unserializable_values_become_text():
    out = fmt(record(event="retry_decision", attempt=2, where=object(), name_="x"))
    assert out["event"] == "retry_decision" and out["attempt"] == 2 and out["name_"] == "x"
    assert out["where"].startswith("<object object")


def test_trace_id_and_rpc_come_from_the_call_context():
    tokens = trace_id_var.set("a" * 32), rpc_var.set("/keel.tokenizer.v1.Tokenizer/Encode")
    try:
        out = fmt(record())
        explicit = fmt(record(trace_id="b" * 32))
    finally:
        trace_id_var.reset(tokens[0])
        rpc_var.reset(tokens[1])
    assert out["trace_id"] == "a" * 32 and out["rpc"] == "/keel.tokenizer.v1.Tokenizer/Encode"
    assert explicit["trace_id"] == "b" * 32  # a record's own value wins


def test_an_extra_cannot_overwrite_a_standard_field():
    out = fmt(record(service="spoofed", level_="x"))
    assert out["service"] == "tokenizer"


def test_exception_text_and_non_ascii_are_kept():
    try:
        raise ValueError("bad näme")
    except ValueError:
        out = fmt(record(msg="failed: 巴黎", args=(), exc_info=sys.exc_info()))
    assert out["msg"] == "failed: 巴黎"
    assert "ValueError: bad näme" in out["exc"] and "Traceback" in out["exc"]
