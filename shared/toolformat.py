"""Which tool-call format a model's chat template speaks, read from the template's text the way
llama.cpp's common/chat.cpp reads it (substrings only; the template is never run to find out):

  hermes   the template writes ``<tool_call>``: Qwen2.5 and Hermes 2 Pro; a call is
           ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several one per line;
  llama3   the template renders tool results as ``<|start_header_id|>ipython<|end_header_id|>``:
           Llama 3.1 and later; a call is ``{"name": ..., "parameters": {...}}``, one per turn;
  mistral  the template writes ``[TOOL_CALLS]``: Mistral 7B Instruct v0.3, Mistral Nemo; the calls are
           ``[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1B2c3D4e"}, ...]`` (Nemo: no space
           before ``[``), a tool result ``[TOOL_RESULTS]{"content": ..., "call_id": ...}[/TOOL_RESULTS]``;
           its template refuses a call id that is not 9 characters long (``mistral_id``);
  generic  anything else, and a model without a template: the gateway describes the tools itself
           (services/gateway/tools.py, llama.cpp's generic handler).

The tokenizer stage reports the format of the template it renders (EncodeResponse.tool_format); the
gateway reads the same model's template at start (shared/modelcard.py) and renders and decodes tool
calls in that format (services/gateway/toolformats.py).
"""
from __future__ import annotations

import hashlib
import re
import string

GENERIC, HERMES, LLAMA3, MISTRAL = "generic", "hermes", "llama3", "mistral"
FORMATS = (GENERIC, HERMES, LLAMA3, MISTRAL)
# A call id as Mistral's templates take it (llama.cpp's grammar has the model write one like it).
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
ID_CHARS = string.ascii_letters + string.digits


def detect(template: str | None) -> str:
    """The tool-call format of a chat template (None or "": the model has none)."""
    if not template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        return LLAMA3
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    return GENERIC


def mistral_id(call_id: str) -> str:
    """``call_id`` as Mistral's template takes it: kept when it is 9 letters and digits, else 9 of
    them made from its SHA-256 (the same for the same id, so a call and its tool turn still match)."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest(), "big")
    chars = []
    for _ in range(9):
        n, digit = divmod(n, len(ID_CHARS))
        chars.append(ID_CHARS[digit])
    return "".join(chars)
