"""A request body as JSON, read within the stage's limits: its declared size is checked before any
byte is read, its nesting depth before it is parsed (Python's parser recurses, and a body nested
10,000 deep would otherwise end in RecursionError), so a hostile body is a 400 or 413 naming the
limit, never a 500. A JSON Schema too deep to parse is judged as the gateway judges any schema, by
its size (RESPONSE_FORMAT_TOO_LARGE), so HTTP and gRPC callers get the same answer."""
from __future__ import annotations

import json
import re

from services.openai.schemas import invalid_body
from shared import errors
from shared.controls import MAX_FORMAT_BYTES, format_too_large

# A JSON string (and a following colon: then it is an object's key), or a bracket. Strings are
# matched whole so that brackets inside them are not counted.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"(\s*:)?|[\[\]{}]')
# Where a request's JSON Schema for its answer sits in a body (chat's; the Responses API's), and the
# field the refusal names (chat: its gRPC field, response_format.json_schema).
SCHEMA_FIELDS = {("response_format", "json_schema", "schema"): "response_format.json_schema",
                 ("text", "format", "schema"): "text.format.schema"}


def too_large(limit: int) -> errors.Overloaded:
    """413 (services/openai/httperrors.py), without a retry hint: the same body is refused again."""
    return errors.Overloaded(f"the body is larger than {limit} bytes", reason="MESSAGE_TOO_LARGE")


def declared_size(raw: str | None, limit: int) -> int | None:
    """The body's Content-Length (None: not given, a chunked body); MESSAGE_TOO_LARGE above ``limit``."""
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit() or len(raw) > 20:
        raise errors.InvalidInput("content-length must be a non-negative integer", reason="INVALID_HEADER",
                                  metadata={"field": "content-length"})
    size = int(raw)
    if size > limit:
        raise too_large(limit)
    return size


def check_depth(body: bytes, max_depth: int) -> None:
    """InvalidInput unless no object or array in ``body`` is nested deeper than ``max_depth``."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return  # cannot be deeper than it has brackets (the usual body: no scan at all)
    stack: list[tuple[str | None, int]] = []  # (the key a container sits under, where it starts)
    key: str | None = None
    for m in _TOKEN.finditer(body):
        token = m.group()
        if token[0] == 0x22:  # '"'
            key = token[1:token.rindex(b'"')].decode("utf-8", "replace") if m.group(1) else None
        elif token in (b"{", b"["):
            stack.append((key, m.start()))
            key = None
            if len(stack) > max_depth:
                raise _too_deep(body, stack, m.end(), max_depth)
        else:
            if stack:
                stack.pop()
            key = None


def _too_deep(body: bytes, stack: list[tuple[str | None, int]], at: int, max_depth: int) -> errors.InvalidInput:
    path = tuple(k for k, _ in stack if k is not None)
    schema = SCHEMA_FIELDS.get(path[:3])
    if schema is not None:
        index = next(i for i, (k, _) in enumerate(stack) if k == "schema")
        size = _span(body, stack[index][1], at, len(stack), index)
        if size > MAX_FORMAT_BYTES:
            return format_too_large(schema, size)
    field = ".".join(path[:8]) or "(body)"
    return invalid_body(field, f"{field}: JSON nested deeper than {max_depth} levels (the limit)")


def _span(body: bytes, start: int, at: int, depth: int, index: int) -> int:
    """Bytes from ``start`` to the end of the container opened there, the ``index``-th (from 0) of
    the ``depth`` containers open at ``at`` (to the body's end if it is never closed)."""
    for m in _TOKEN.finditer(body, at):
        token = m.group()
        if token in (b"{", b"["):
            depth += 1
        elif token in (b"}", b"]"):
            depth -= 1
            if depth == index:
                return m.end() - start
    return len(body) - start


def parse_json(body: bytes, max_depth: int):
    check_depth(body, max_depth)
    try:
        return json.loads(body)
    except ValueError as exc:  # also bytes that are not UTF-8, and integers of over 4300 digits
        raise invalid_body("(body)", f"the body is not JSON: {exc}") from None


def converted(build, body):
    """``build(body)``: the gateway's protobuf request. A string with a lone surrogate (JSON's
    ``"\\ud800"`` parses to one) has no UTF-8 form, so protobuf refuses it: 400, not 500."""
    try:
        return build(body)
    except UnicodeEncodeError:
        raise invalid_body("(body)", "a string in the body is not valid Unicode (a lone surrogate escape)") from None
