"""Domain objects of the feedback stage: a replay record (and its stored form), and a feedback item."""
from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf import json_format

from keel.common.v1 import common_pb2
from services.feedback.config import ERROR_TYPES, SEVERITIES
from shared import errors
from shared.controls import Controls, Sampling, format_of, format_pb, repetition_penalty_of, sampling_pb

MAX_FEEDBACK_ID = 128
MAX_COMMENT_BYTES = 8192
MAX_KEYWORDS = 64
TRACE_ID = re.compile(r"[0-9a-f]{32}")  # W3C trace id, as the gateway assigns it


def ids_sha256(ids: list[int]) -> str:
    """SHA-256 (hex) of token ids as little-endian int32: the same on every machine."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def text_sha256(messages: tuple[tuple[str, str], ...]) -> str:
    """SHA-256 (hex) of the conversation as canonical JSON ([role, content] pairs in order; a raw-text
    input is the one pair ["text", its text])."""
    canon = json.dumps([[role, content] for role, content in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def stored_body(record: ReplayRecord, store_prompts: bool) -> dict:
    """What the database keeps of a record (`ReplayRecord.stored`, as JSON)."""
    return record.stored(store_prompts).to_body()


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ReplayRecord:
    """One served answer as the feedback stage keeps it: what a replay needs to send the request
    again (the conversation, the sampling parameters and seed, the adapter, the response format)
    and what it compares (the prompt and output ids, the engine facts, the tokenizer's hashes).

    Its stored form is a JSON object (`to_body`; `from_body` reads it back). A record stored before
    a field existed lacks its key, and reads back as an answer that had none of it (no controls, no
    adapter, no response format, no tokenizer hashes, no routing decision). With prompts not stored, `messages`,
    `prompt_ids` and `output_ids` are None and only their hashes are kept."""

    trace_id: str
    created_ms: int
    messages: tuple[tuple[str, str], ...] | None  # (role, content), as the client sent them
    prompt_ids: tuple[int, ...] | None            # as the model saw the prompt
    output_ids: tuple[int, ...] | None
    sampling: Sampling                            # as applied: the seed is always set
    domain: str = ""
    source: str = ""
    finish_reason: str = ""
    engine: Mapping[str, str] = field(default_factory=dict)  # the serving replica's engine facts
    input_fingerprint: str = ""
    vocab_sha256: str = ""
    chat_template_sha256: str = ""
    adapter: str = ""                             # "id@version"; "" = the base model
    text: str | None = None                       # a raw-text input (messages then empty)
    # A request with tools: its tools, tool_choice, parallel_tool_calls, the answer's tool_calls and
    # its turns' calls, as JSON (services/feedback/servicer.py tool_use_of); None without tools.
    tool_use: Mapping[str, Any] | None = None
    validation: Mapping[str, Any] = field(default_factory=dict)  # common.v1.ValidationResult as JSON
    # the gateway's routing decision: replica, policy, reason, matched_blocks ({}: none was made)
    route: Mapping[str, Any] = field(default_factory=dict)
    # set when stored (`stored`):
    prompt_stored: bool = False
    prompt_sha256: str = ""
    output_sha256: str = ""
    raw_text_sha256: str = ""

    def check(self) -> None:
        """INVALID_ARGUMENT for a replay record that could not be stored or replayed."""
        if not TRACE_ID.fullmatch(self.trace_id):
            raise errors.InvalidInput(f"trace_id {self.trace_id[:64]!r} is not 32 lowercase hex characters",
                                      reason="INVALID_REPLAY_RECORD", metadata={"field": "trace_id"})

    def stored(self, store_prompts: bool) -> ReplayRecord:
        """The record as the database keeps it: hashes always; ids and text only if prompts may be stored."""
        hashes = dict(prompt_sha256=ids_sha256(self.prompt_ids), output_sha256=ids_sha256(self.output_ids),
                      raw_text_sha256=text_sha256(self.messages if self.text is None else (("text", self.text),)),
                      prompt_stored=store_prompts)
        if not store_prompts:
            hashes.update(prompt_ids=None, output_ids=None, messages=None, text=None, tool_use=None)
        return replace(self, **hashes)

    def to_body(self) -> dict:
        s, c = self.sampling, self.sampling.controls
        pb = sampling_pb(s)
        fmt = format_pb(c.response_format)
        return {"trace_id": self.trace_id, "created_ms": self.created_ms,
                "messages": None if self.messages is None else [{"role": r, "content": t} for r, t in self.messages],
                "text": self.text, "tool_use": None if self.tool_use is None else dict(self.tool_use),
                "prompt_ids": _list(self.prompt_ids), "output_ids": _list(self.output_ids),
                "sampling": {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                             "top_k": s.top_k, "seed": s.seed, "stop": list(c.stop),
                             "repetition_penalty": pb.repetition_penalty, "frequency_penalty": c.frequency_penalty,
                             "presence_penalty": c.presence_penalty, "logprobs": c.logprobs,
                             "top_logprobs": c.top_logprobs},
                "response_format": None if fmt is None else json_format.MessageToDict(
                    fmt, preserving_proto_field_name=True),
                "domain": self.domain, "source": self.source, "finish_reason": self.finish_reason,
                "engine": dict(self.engine), "input_fingerprint": self.input_fingerprint,
                "vocab_sha256": self.vocab_sha256, "chat_template_sha256": self.chat_template_sha256,
                "adapter": self.adapter, "validation": dict(self.validation), "route": dict(self.route),
                "prompt_stored": self.prompt_stored,
                "prompt_sha256": self.prompt_sha256, "output_sha256": self.output_sha256,
                "raw_text_sha256": self.raw_text_sha256}

    @staticmethod
    def from_body(d: Mapping[str, Any]) -> ReplayRecord:
        s = d["sampling"]
        fmt = None
        if d.get("response_format"):
            fmt = json_format.ParseDict(d["response_format"], common_pb2.ResponseFormat())
        controls = Controls(stop=tuple(s.get("stop", ())),
                            repetition_penalty=repetition_penalty_of(s.get("repetition_penalty", 0.0)),
                            frequency_penalty=s.get("frequency_penalty", 0.0),
                            presence_penalty=s.get("presence_penalty", 0.0), logprobs=s.get("logprobs", False),
                            top_logprobs=s.get("top_logprobs", 0), response_format=format_of(fmt))
        messages = d.get("messages")
        return ReplayRecord(
            trace_id=d["trace_id"], created_ms=d.get("created_ms", 0),
            messages=None if messages is None else tuple((m["role"], m["content"]) for m in messages),
            prompt_ids=_tuple(d.get("prompt_ids")), output_ids=_tuple(d.get("output_ids")),
            sampling=Sampling(s["max_tokens"], s["temperature"], s["top_p"], s["top_k"], s["seed"], controls),
            domain=d.get("domain", ""), source=d.get("source", ""), finish_reason=d.get("finish_reason", ""),
            engine=dict(d.get("engine") or {}), input_fingerprint=d.get("input_fingerprint", ""),
            vocab_sha256=d.get("vocab_sha256", ""), chat_template_sha256=d.get("chat_template_sha256", ""),
            adapter=d.get("adapter", ""), text=d.get("text"), tool_use=d.get("tool_use"),
            validation=dict(d.get("validation") or {}), route=dict(d.get("route") or {}),
            prompt_stored=d.get("prompt_stored", False), prompt_sha256=d.get("prompt_sha256", ""),
            output_sha256=d.get("output_sha256", ""), raw_text_sha256=d.get("raw_text_sha256", ""))


def _list(ids: tuple[int, ...] | None) -> list[int] | None:
    return None if ids is None else list(ids)


def _tuple(ids: list[int] | None) -> tuple[int, ...] | None:
    return None if ids is None else tuple(ids)


@dataclass(frozen=True)
class Feedback:
    trace_id: str
    feedback_id: str
    error_type: str
    severity: str
    expected_keywords: tuple[str, ...] = ()
    comment: str = ""

    def check(self) -> None:
        """INVALID_ARGUMENT naming the first bad field (ErrorInfo metadata ``field``)."""
        def bad(field: str, message: str) -> errors.InvalidInput:
            return errors.InvalidInput(f"{field}: {message}", reason="INVALID_FEEDBACK_FIELD",
                                       metadata={"field": field})
        for name, values in (("feedback_id", (self.feedback_id,)), ("trace_id", (self.trace_id,)),
                             ("expected_keywords", self.expected_keywords), ("comment", (self.comment,))):
            if any("\x00" in v for v in values):  # PostgreSQL's text cannot hold it
                raise bad(name, "must not contain NUL characters (U+0000)")
        if not self.feedback_id.strip():
            raise bad("feedback_id", "must not be empty (choose one per feedback item; resending it updates)")
        if len(self.feedback_id) > MAX_FEEDBACK_ID:
            raise bad("feedback_id", f"at most {MAX_FEEDBACK_ID} characters")
        if not self.trace_id:
            raise bad("trace_id", "must not be empty (the answer's trace_id)")
        if self.error_type not in ERROR_TYPES:
            raise bad("error_type", f"{self.error_type[:64]!r} is not one of {', '.join(ERROR_TYPES)}")
        if self.severity not in SEVERITIES:
            raise bad("severity", f"{self.severity[:64]!r} is not one of {', '.join(SEVERITIES)}")
        if len(self.expected_keywords) > MAX_KEYWORDS:
            raise bad("expected_keywords", f"at most {MAX_KEYWORDS} keywords")
        if len(self.comment.encode("utf-8")) > MAX_COMMENT_BYTES:
            raise bad("comment", f"at most {MAX_COMMENT_BYTES} bytes")
