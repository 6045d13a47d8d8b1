"""Which tool-call format a model's chat template speaks, read from the template's text the way
llama.cpp's common/chat.cpp reads it (substrings only; the template is never run to find out):

  hermes   the template writes ``<tool_call>``: Qwen2.5 and Hermes 2 Pro; a call is
           ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several one per line;
  llama3   the template renders tool results as ``<|start_header_id|>ipython<|end_header_id|>``:
           Llama 3.1 and later; a call is ``{"name": ..., "parameters": {...}}``, one per turn;
  generic  anything else, and a model without a template: the gateway describes the tools itself
           (services/gateway/tools.py, llama.cpp's generic handler).

The tokenizer stage reports the format of the template it renders (EncodeResponse.tool_format); the
gateway reads the same model's template at start (shared/modelcard.py) and renders and decodes tool
calls in that format (services/gateway/toolformats.py).
"""
from __future__ import annotations

GENERIC, HERMES, LLAMA3 = "generic", "hermes", "llama3"
FORMATS = (GENERIC, HERMES, LLAMA3)


def detect(template: str | None) -> str:
    """The tool-call format of a chat template (None or "": the model has none)."""
    if not template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        return LLAMA3
    return GENERIC
