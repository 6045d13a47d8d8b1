"""Tool calls in the format of a model's own chat template (shared/toolformat.py tells which), as
llama.cpp's common/chat.cpp handles them: the template shows the tools, the conversation's calls
and its tool turns (the tokenizer stage renders them), and the answer is decoded under a grammar of
the format, so that a forced call always parses and its arguments validate against the function's
schema:

  hermes  (Qwen2.5, Hermes 2 Pro) ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
          parallel calls one per line (1 to ``max_calls`` of them);
  llama3  (Llama 3.1) ``{"name": "f", "parameters": {...}}``: one call, as the template renders one
          per turn.

The grammar is in llguidance's Lark dialect (ResponseFormat kind "lark"): each function's call is a
``%json {...}`` schema written with the separators the templates' ``tojson`` uses (", " and ": "), so
the model's calls look like the ones it is shown. Unless a call is forced, the answer may instead be
text that does not begin like a call (``<tool_call>``; ``{`` for llama3).

Pure format knowledge: services/gateway/tools.py checks the tools and builds the answer's calls.
"""
from __future__ import annotations

import json
import re

from shared import toolformat

# How a call's JSON is written (llguidance's x-guidance options): as tojson writes it.
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A call's members: the function's name, then its arguments under this key.
ARGUMENTS_KEY = {toolformat.HERMES: "arguments", toolformat.LLAMA3: "parameters"}
# What a text answer may not begin with (it would be a call), as a Lark regex.
CALL_START = {toolformat.HERMES: "<tool_call>", toolformat.LLAMA3: r"\{"}
HERMES_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def relocate(node, pointer: str):
    """``node`` with every local $ref ("#...") made relative to the document root it now sits at
    ``pointer`` under (a tool's "#/$defs/X" becomes "#<pointer>/$defs/X")."""
    if isinstance(node, dict):
        return {k: (("#" + pointer + v[1:]) if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else relocate(v, pointer)) for k, v in node.items()}
    if isinstance(node, list):
        return [relocate(v, pointer) for v in node]
    return node


def _call(fmt: str, name: str, parameters: dict) -> str:
    key = ARGUMENTS_KEY[fmt]
    schema = {k: v for k, v in parameters.items() if k not in ("$id", "$schema")}
    call = {"type": "object", "properties": {"name": {"const": name}, key: relocate(schema, f"/properties/{key}")},
            "required": ["name", key], "additionalProperties": False, "x-guidance": SEPARATORS}
    return json.dumps(call, ensure_ascii=False)


def grammar(fmt: str, functions: list[tuple[str, dict]], forced: bool, max_calls: int) -> str:
    """The Lark grammar of an answer in ``fmt`` that calls ``functions`` ((name, parameters schema),
    one alternative each), 1 to ``max_calls`` calls (hermes), or (not ``forced``) is text."""
    rules = [f"fn{n}: %json {_call(fmt, name, schema)}" for n, (name, schema) in enumerate(functions)]
    if fmt == toolformat.HERMES:
        more = f' ("\\n" call) ~ 0..{max_calls - 1}' if max_calls > 1 else ""
        head = [f"calls: call{more}", 'call: "<tool_call>\\n" fn "\\n</tool_call>"']
    else:
        head = ["calls: fn"]
    start = ["start: calls"] if forced else ["start: calls | TEXT", f"TEXT: /(.|\\n)*/ & ~/{CALL_START[fmt]}(.|\\n)*/"]
    return "\n".join([*start, *head, "fn: " + " | ".join(f"fn{n}" for n in range(len(functions))), *rules]) + "\n"


def parse(fmt: str, raw: str) -> str | list[tuple[str, object]] | None:
    """The generated text read back: the text itself when it does not begin like a call, else the
    calls as (name, arguments); None when it begins as a call but is not one (cut short)."""
    text = raw.strip()
    if fmt == toolformat.HERMES:
        if not text.startswith("<tool_call>"):
            return raw
        bodies = HERMES_CALL.findall(text)
        if not bodies or HERMES_CALL.sub("", text).strip():
            return None
    else:
        if not text.startswith("{"):
            return raw
        bodies = [text]
    key, calls = ARGUMENTS_KEY[fmt], []
    for body in bodies:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or key not in obj:
            return None
        calls.append((obj["name"], obj[key]))
    return calls
