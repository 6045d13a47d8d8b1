"""Tool calls in the format of a model's own chat template (shared/toolformat.py tells which), as
llama.cpp's common/chat.cpp handles them: the template shows the tools, the conversation's calls
and its tool turns (the tokenizer stage renders them), and the answer is decoded under a grammar of
the format, so that a forced call always parses and its arguments validate against the function's
schema:

  hermes  (Qwen2.5, Hermes 2 Pro) ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
          parallel calls one per line (1 to ``max_calls`` of them);
  llama3  (Llama 3.1) ``{"name": "f", "parameters": {...}}``: one call, as the template renders one
          per turn;
  mistral (Mistral 7B Instruct v0.3, Nemo) ``[TOOL_CALLS] [{"name": "f", "arguments": {...}, "id":
          "a1B2c3D4e"}, ...]``, 1 to ``max_calls`` calls in one JSON array, the space before ``[``
          optional (v0.3 writes it, Nemo does not); each call ends with the 9-character id the
          template shows its calls with, as llama.cpp's grammar has it (the gateway gives the answer's
          calls ids of its own).

The grammar is in llguidance's Lark dialect (ResponseFormat kind "lark"): each function's call is a
``%json {...}`` schema written with the separators the templates' ``tojson`` uses (", " and ": "), so
the model's calls look like the ones it is shown. Unless a call is forced, the answer may instead be
text that does not begin like a call (``<tool_call>``; ``{`` for llama3; ``[TOOL_CALLS]``).

Pure format knowledge: services/gateway/tools.py checks the tools and builds the answer's calls.
"""
from __future__ import annotations

import json
import re

from shared import toolformat

# How a call's JSON is written (llguidance's x-guidance options): as tojson writes it.
SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A call's members: the function's name, then its arguments under this key.
ARGUMENTS_KEY = {toolformat.HERMES: "arguments", toolformat.LLAMA3: "parameters", toolformat.MISTRAL: "arguments"}
# What a text answer may not begin with (it would be a call), as a Lark regex.
CALL_START = {toolformat.HERMES: "<tool_call>", toolformat.LLAMA3: r"\{", toolformat.MISTRAL: r"\[TOOL_CALLS\]"}
HERMES_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
MISTRAL_CALLS = "[TOOL_CALLS]"
# The id member a Mistral call ends with (llama.cpp's pattern).
MISTRAL_ID = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}


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
    members = {"name": {"const": name}, key: relocate(schema, f"/properties/{key}")}
    if fmt == toolformat.MISTRAL:
        members["id"] = MISTRAL_ID
    call = {"type": "object", "properties": members, "required": list(members), "additionalProperties": False,
            "x-guidance": SEPARATORS}
    return json.dumps(call, ensure_ascii=False)


def grammar(fmt: str, functions: list[tuple[str, dict]], forced: bool, max_calls: int) -> str:
    """The Lark grammar of an answer in ``fmt`` that calls ``functions`` ((name, parameters schema),
    one alternative each), 1 to ``max_calls`` calls (hermes, mistral), or (not ``forced``) is text."""
    rules = [f"fn{n}: %json {_call(fmt, name, schema)}" for n, (name, schema) in enumerate(functions)]
    if fmt == toolformat.HERMES:
        more = f' ("\\n" call) ~ 0..{max_calls - 1}' if max_calls > 1 else ""
        head = [f"calls: call{more}", 'call: "<tool_call>\\n" fn "\\n</tool_call>"']
    elif fmt == toolformat.MISTRAL:
        more = f' (", " fn) ~ 0..{max_calls - 1}' if max_calls > 1 else ""
        head = [f'calls: "{MISTRAL_CALLS}" " "? "[" fn{more} "]"']
    else:
        head = ["calls: fn"]
    start = ["start: calls"] if forced else ["start: calls | TEXT", f"TEXT: /(.|\\n)*/ & ~/{CALL_START[fmt]}(.|\\n)*/"]
    return "\n".join([*start, *head, "fn: " + " | ".join(f"fn{n}" for n in range(len(functions))), *rules]) + "\n"


def _json(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


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
        objs = [_json(body) for body in bodies]
    elif fmt == toolformat.MISTRAL:
        if not text.startswith(MISTRAL_CALLS):
            return raw
        objs = _json(text[len(MISTRAL_CALLS):])
        if not isinstance(objs, list) or not objs:
            return None
    else:
        if not text.startswith("{"):
            return raw
        objs = [_json(text)]
    key = ARGUMENTS_KEY[fmt]
    if not all(isinstance(obj, dict) and isinstance(obj.get("name"), str) and key in obj for obj in objs):
        return None
    return [(obj["name"], obj[key]) for obj in objs]
