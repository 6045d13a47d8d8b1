"""Domain objects of the feedback stage: a replay record's stored form, and a feedback item."""
from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass

from services.feedback.config import ERROR_TYPES, SEVERITIES
from shared import errors

MAX_FEEDBACK_ID = 128
MAX_COMMENT_BYTES = 8192
MAX_KEYWORDS = 64
TRACE_ID = re.compile(r"[0-9a-f]{32}")  # W3C trace id, as the gateway assigns it


def ids_sha256(ids: list[int]) -> str:
    """SHA-256 (hex) of token ids as little-endian int32: the same on every machine."""
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def text_sha256(messages: list[dict]) -> str:
    """SHA-256 (hex) of the conversation as canonical JSON (role/content pairs in order)."""
    canon = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def check_record(record: dict) -> None:
    """INVALID_ARGUMENT for a replay record that could not be stored or replayed."""
    if not TRACE_ID.fullmatch(record["trace_id"]):
        raise errors.InvalidInput(f"trace_id {record['trace_id'][:64]!r} is not 32 lowercase hex characters",
                                  reason="INVALID_REPLAY_RECORD", metadata={"field": "trace_id"})


def stored_body(record: dict, store_prompts: bool) -> dict:
    """The record as the database keeps it: hashes always; ids and text only if prompts may be stored."""
    body = dict(record)
    body["prompt_sha256"] = ids_sha256(record["prompt_ids"])
    body["output_sha256"] = ids_sha256(record["output_ids"])
    body["raw_text_sha256"] = text_sha256(record["messages"])
    body["prompt_stored"] = store_prompts
    if not store_prompts:
        body["prompt_ids"] = body["output_ids"] = body["messages"] = None
    return body


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


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
        for field, values in (("feedback_id", (self.feedback_id,)), ("trace_id", (self.trace_id,)),
                              ("expected_keywords", self.expected_keywords), ("comment", (self.comment,))):
            if any("\x00" in v for v in values):  # PostgreSQL's text cannot hold it
                raise bad(field, "must not contain NUL characters (U+0000)")
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
