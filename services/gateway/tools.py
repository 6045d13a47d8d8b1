"""Tool calls (OpenAI's function calling). A model whose chat template has a tools section gets them in
the template's own format (services/gateway/toolformats.py: the tokenizer renders the tools and the
tool turns, the answer is decoded under a Lark grammar of the format). For the others, as llama.cpp's
*generic* handler does it (docs/generation.md, Tool calls, has the exact rendering):

- the request's tools are described in the system turn (appended to the first one, else a new first
  turn), with the JSON the model is to answer in: ``{"tool_call": {"name": ..., "arguments": ...}}``,
  ``{"tool_calls": [...]}`` (parallel calls allowed) or ``{"response": "..."}`` (``auto`` only);
- that JSON is enforced while decoding, by the grammar engine the request's response_format already
  drives (a JSON Schema built here from the tools and tool_choice), so a forced call always parses
  and its arguments validate against the function's schema;
- a conversation's earlier calls and their results are rendered as the JSON the model would have
  produced and as a user turn holding ``{"tool_response": ...}``: the tokenizer stage renders only
  system, user and assistant turns.

``check`` refuses what cannot be served, ``render`` turns an Ask into the chat the tokenizer sees (and
the grammar the engine decodes under), ``parse`` reads the generated text back into the answer's text
or calls; each takes the model's tool format (shared/toolformat.py), "generic" unless told.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import jsonschema

from keel.common.v1 import common_pb2
from services.gateway import toolformats
from services.gateway.toolformats import relocate
from shared import errors, toolformat
from shared.controls import MAX_FORMAT_BYTES, ResponseFormat

if TYPE_CHECKING:
    from services.gateway.contract import Ask, Limits

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MODES = ("", "auto", "none", "required")
# llama.cpp's instruction (common/chat.cpp, the generic handler), the key spelled as the grammar has it.
INSTRUCTION_AUTO = ("Respond in JSON format, either with `{key}` (a request to call tools) or with `response` "
                    "reply to the user's request")
INSTRUCTION_FORCED = "Respond in JSON format with `{key}` (a request to call tools)"
# minja's polyfill of a template without a tools section (the text llama.cpp shows such a model).
TOOLS_INTRO = "You can call any of the following tools to satisfy the user's requests: "
# Calls in one turn, at most: a small model that repeats itself ("call, call, call, ...") then ends
# its turn with calls that parse, instead of running into max_tokens mid-call.
MAX_PARALLEL_CALLS = 4
FINISH_REASON = "tool_calls"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: str = ""  # JSON Schema text; "" = an object with any members
    strict: bool = False  # accepted: a call is always decoded under the schema


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def pb(self) -> common_pb2.ToolCall:
        return common_pb2.ToolCall(id=self.id, name=self.name, arguments=self.arguments)


@dataclass(frozen=True)
class Toolbox:
    """The request's tools and how the model may use them (tool_choice, parallel_tool_calls)."""
    tools: tuple[Tool, ...] = ()
    mode: str = ""        # "" (= "auto"), "auto", "none", "required"
    function: str = ""    # the one function to call ("" = any)
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode == "required" or bool(self.function)


@dataclass(frozen=True)
class TurnTools:
    """What a chat turn carries beside its role and text: an assistant's calls, a tool turn's call id."""
    calls: tuple[ToolCall, ...] = ()
    call_id: str = ""


@dataclass(frozen=True)
class Reply:
    """The generated JSON, read back: the answer's text, or its calls."""
    text: str
    calls: tuple[ToolCall, ...] = ()


def active(ask: Ask) -> bool:
    """True when the answer is to be the generic JSON (tools sent and tool_choice not "none")."""
    return ask.tools is not None and bool(ask.tools.tools) and ask.tools.mode != "none"


def _bad(message: str, reason: str, field: str) -> errors.InvalidInput:
    return errors.InvalidInput(message, reason=reason, metadata={"field": field})


def _schema(tool: Tool, i: int) -> dict:
    """The tool's parameters as a schema object; TOOL_INVALID when it is not JSON, not a JSON Schema
    (its meta-schema says so), or describes something else than an object."""
    field = f"tools.{i}.parameters"
    if not tool.parameters:
        return {"type": "object"}
    try:
        schema = json.loads(tool.parameters)
    except (ValueError, RecursionError) as exc:
        raise _bad(f"tool {tool.name!r}: parameters is not JSON: {str(exc)[:200]}", "TOOL_INVALID", field) from None
    if not isinstance(schema, dict):
        raise _bad(f"tool {tool.name!r}: parameters must be a JSON Schema object", "TOOL_INVALID", field)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _bad(f"tool {tool.name!r}: parameters is not a valid JSON Schema: {exc.message[:200]}",
                   "TOOL_INVALID", field) from None
    except RecursionError:
        raise _bad(f"tool {tool.name!r}: parameters is nested too deeply", "TOOL_INVALID", field) from None
    if schema.get("type", "object") != "object":
        raise _bad(f"tool {tool.name!r}: parameters must describe a JSON object (\"type\": \"object\")",
                   "TOOL_INVALID", field)
    return schema


def check(ask: Ask, limits: Limits, fmt: str = toolformat.GENERIC) -> None:
    """The request's tools, tool_choice and tool turns, or InvalidInput with the rule's reason (metadata
    `field`): TOO_MANY_TOOLS, TOOL_INVALID, TOOL_CHOICE_INVALID, TOOLS_CONFLICT, TOOLS_TOO_LARGE."""
    box = ask.tools
    if box is None:
        return
    if len(box.tools) > limits.max_tools:
        raise _bad(f"at most {limits.max_tools} tools, got {len(box.tools)}", "TOO_MANY_TOOLS", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(box.tools):
        if not NAME.fullmatch(tool.name):
            raise _bad(f"tool name {tool.name[:80]!r} is not 1..64 of a-z, A-Z, 0-9, _ and -", "TOOL_INVALID",
                       f"tools.{i}.name")
        if tool.name in seen:
            raise _bad(f"two tools are named {tool.name!r}", "TOOL_INVALID", f"tools.{i}.name")
        seen.add(tool.name)
        _schema(tool, i)
    if box.mode not in MODES or (box.function and box.mode):
        raise _bad(f"tool_choice mode {box.mode[:40]!r} is not one of auto, none, required (or a function alone)",
                   "TOOL_CHOICE_INVALID", "tool_choice.mode")
    if box.function and box.function not in seen:
        raise _bad(f"tool_choice names {box.function[:80]!r}, which is not one of the request's tools",
                   "TOOL_CHOICE_INVALID", "tool_choice.function")
    if box.mode == "required" and not box.tools:
        raise _bad("tool_choice required needs tools", "TOOL_CHOICE_INVALID", "tool_choice.mode")
    if not active(ask):
        return
    if not ask.messages:  # a raw text or token-ids input (an empty one never gets here: EMPTY_PROMPT)
        raise _bad("tools need a chat (or prompt) input, not raw text or token ids", "TOOLS_CONFLICT", "tools")
    if ask.controls.response_format is not None:
        raise _bad("tools and response_format cannot be combined: the answer's format is the tool-call JSON "
                   "(send tool_choice none to use response_format)", "TOOLS_CONFLICT", "response_format")
    size = len(answer_format(box, fmt).document.encode("utf-8"))
    if size > MAX_FORMAT_BYTES:
        raise _bad(f"the tools' schemas make a grammar of {size} bytes, the limit is {MAX_FORMAT_BYTES}",
                   "TOOLS_TOO_LARGE", "tools")


def _call(tool: Tool, i: int, at: str) -> dict:
    """One call of ``tool`` as JSON, its arguments under the tool's schema (the call sits at ``at``; the
    schema's own "$id" and "$schema" are left out, so that its local refs resolve in the new document)."""
    schema = {k: v for k, v in _schema(tool, i).items() if k not in ("$id", "$schema")}
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": relocate(schema, f"{at}/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def _calls_key(box: Toolbox) -> str:
    return "tool_calls" if box.parallel and not box.function else "tool_call"


def grammar(box: Toolbox) -> str:
    """The JSON Schema (text) the answer is decoded under: llama.cpp's generic shapes, the calls limited
    to tool_choice's function when it names one, no ``response`` when a call is forced."""
    callable_ = [(i, t) for i, t in enumerate(box.tools) if not box.function or t.name == box.function]
    key = _calls_key(box)
    root = "" if box.forced else "/anyOf/0"
    at = f"{root}/properties/{key}" + ("/items" if key == "tool_calls" else "")
    if len(callable_) == 1:
        call = _call(callable_[0][1], callable_[0][0], at)
    else:
        call = {"anyOf": [_call(t, i, f"{at}/anyOf/{n}") for n, (i, t) in enumerate(callable_)]}
    body = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS} if key == "tool_calls" \
        else call
    calls = {"type": "object", "properties": {key: body}, "required": [key], "additionalProperties": False}
    if not box.forced:
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        calls = {"anyOf": [calls, response]}
    return json.dumps(calls, ensure_ascii=False)


def answer_format(box: Toolbox, fmt: str) -> ResponseFormat:
    """What the answer is decoded under: the generic JSON Schema, or the template format's grammar."""
    if fmt == toolformat.GENERIC:
        return ResponseFormat("json_schema", grammar(box))
    functions = [(t.name, _schema(t, i)) for i, t in enumerate(box.tools) if not box.function or t.name == box.function]
    calls = MAX_PARALLEL_CALLS if box.parallel and not box.function else 1
    return ResponseFormat("lark", toolformats.grammar(fmt, functions, box.forced, calls))


def shown(ask: Ask, fmt: str) -> tuple[Tool, ...]:
    """The tools the model's template is to show (none for the generic format: the system turn does)."""
    return ask.tools.tools if fmt != toolformat.GENERIC and active(ask) else ()


def _compact(obj) -> str:
    """JSON as the grammar engine has the model write it (no free whitespace)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _arguments(text: str):
    """A call's arguments as a JSON value (text that is not JSON stays a string)."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def system_text(box: Toolbox) -> str:
    """What the system turn says about the tools (appended to the client's system turn after a newline)."""
    key = _calls_key(box)
    instruction = (INSTRUCTION_FORCED if box.forced else INSTRUCTION_AUTO).format(key=key)
    described = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": _schema(t, i)}} for i, t in enumerate(box.tools)]
    call = {"name": "tool_name", "arguments": {"arg1": "some_value"}}
    example = {key: [call] if key == "tool_calls" else call}
    return (f"{instruction}\n\n{TOOLS_INTRO}{json.dumps(described, ensure_ascii=False, indent=2)}\n\n"
            f"Example tool call syntax:\n\n{_compact(example)}")


def _turn(role: str, content: str, extra: TurnTools, names: dict[str, str], parallel: bool) -> tuple[str, str]:
    """One client turn as the tokenizer's roles can hold it."""
    if role == "tool":
        answer = {"tool_call_id": extra.call_id} if extra.call_id else {}
        if extra.call_id in names:
            answer["name"] = names[extra.call_id]
        return "user", _compact({"tool_response": {**answer, "content": content}})
    if not extra.calls:
        return role, content
    calls = [{"name": c.name, "arguments": _arguments(c.arguments)} for c in extra.calls]
    shown: dict = {"tool_calls": calls} if parallel or len(calls) > 1 else {"tool_call": calls[0]}
    if content:
        shown["content"] = content
    return role, _compact(shown)


def render(ask: Ask, fmt: str = toolformat.GENERIC) -> Ask:
    """``ask`` as the tokenizer and the engine take it, the answer's grammar set when tools are
    active. Generic: the tools described in the system turn, earlier calls and tool turns rendered
    as JSON turns (the Ask drops its turn_tools). A template's format: the turns as sent, with their
    turn_tools (the template renders them, and ``shown`` the tools)."""
    if fmt != toolformat.GENERIC:
        if not active(ask):
            return ask
        return replace(ask, controls=replace(ask.controls, response_format=answer_format(ask.tools, fmt)))
    box = ask.tools or Toolbox()
    turns = ask.turn_tools or (TurnTools(),) * len(ask.messages)
    names = {c.id: c.name for t in turns for c in t.calls if c.id}
    messages = [_turn(r, c, t, names, box.parallel) for (r, c), t in zip(ask.messages, turns)]
    controls = ask.controls
    if active(ask):
        text = system_text(box)
        if messages and messages[0][0] == "system":
            messages[0] = ("system", f"{messages[0][1]}\n{text}")
        else:
            messages.insert(0, ("system", text))
        controls = replace(controls, response_format=answer_format(box, fmt))
    return replace(ask, messages=tuple(messages), turn_tools=(), controls=controls)


def new_call_id(fmt: str = toolformat.GENERIC) -> str:
    """A call's id: "call_" and 24 letters and digits; 9 letters and digits for the mistral format,
    whose template refuses other ids (an id sent back in a later turn is then shown unchanged)."""
    if fmt == toolformat.MISTRAL:
        return "".join(secrets.choice(toolformat.ID_CHARS) for _ in range(9))
    return "call_" + "".join(secrets.choice(toolformat.ID_CHARS) for _ in range(24))


def parse(raw: str, fmt: str = toolformat.GENERIC) -> Reply | None:
    """The generated text as the answer's text or calls (each with a new id, its arguments compact
    JSON); None when it is not of the format (an answer cut short by max_tokens)."""
    if fmt != toolformat.GENERIC:
        read = toolformats.parse(fmt, raw)
        if read is None or isinstance(read, str):
            return None if read is None else Reply(read)
        return Reply("", tuple(ToolCall(new_call_id(fmt), name, _compact(arguments)) for name, arguments in read))
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("response"), str):
        return Reply(obj["response"])
    made = obj.get("tool_calls", [obj.get("tool_call")])
    if not isinstance(made, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                             and "arguments" in c for c in made):
        return None
    return Reply("", tuple(ToolCall(new_call_id(), c["name"], _compact(c["arguments"])) for c in made))


def for_validation(ask: Ask, raw: str, reply: Reply | None) -> tuple[str, Ask]:
    """The text output validation sees and the Ask it sees it under: a ``response``'s text with no
    schema to check; else the generated JSON under the grammar it was decoded with."""
    if reply is not None and not reply.calls:
        return reply.text, replace(ask, controls=replace(ask.controls, response_format=None))
    return raw, ask


def engine_refusal(ask: Ask, err: errors.InvalidInput) -> errors.InvalidInput:
    """The inference stage's refusal of the grammar built from the tools, as TOOL_INVALID naming the
    tool (the one whose schema it was, when only one was in it); any other refusal unchanged."""
    if not active(ask) or err.reason not in ("RESPONSE_FORMAT_INVALID", "RESPONSE_FORMAT_TOO_COMPLEX"):
        return err
    box = ask.tools
    used = [i for i, t in enumerate(box.tools) if not box.function or t.name == box.function]
    field = f"tools.{used[0]}.parameters" if len(used) == 1 else "tools"
    which = f"tool {box.tools[used[0]].name!r}" if len(used) == 1 else "a tool's parameters"
    detail = err.message.split(": ", 1)[-1]
    return _bad(f"{which} cannot be decoded under the grammar engine: {detail[:300]}", "TOOL_INVALID", field)
