"""The body of OpenAI's Responses API (``POST /v1/responses``), strict as services/openai/schemas.py's
bodies are: a wrong JSON type, an unknown field or a NaN is INVALID_BODY naming the field; an OpenAI
field Keel knows but does not serve is UNSUPPORTED_PARAMETER. ``input`` items and ``tools`` are
OpenAI unions of many kinds: each is read here by its ``type`` (``items``, ``function_tools``), so a
kind Keel does not serve is refused naming ``input.N.type`` or ``tools.N.type`` rather than being a
typo, and a malformed one of a served kind names its own field."""
from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from services.openai.schemas import StreamOptions, Strict, invalid_body, unsupported

TextKind = Literal["input_text", "output_text"]
TEXT_PARTS = get_args(TextKind)


class InputText(Strict):
    """A text part of an input message: the caller's (input_text) or an earlier answer's (output_text,
    as the SDKs send a previous response's output back; its annotations and logprobs are ignored)."""

    type: TextKind
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputText]
    # An earlier answer's item, sent back as it came: its id and status are not used.
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "input_text", "text": v}]
        return v

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionCallItem(Strict):
    """A call the model made in an earlier turn (``function_call`` output item, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    """The caller's answer to a call, by its ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_KINDS: dict[str, type[Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                     "function_call_output": FunctionCallOutputItem}


class FunctionTool(Strict):
    """Responses' flat function tool (chat's nests the same fields under ``function``)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # Keel always decodes a call under its schema


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """``text.format``: Responses' flat form of chat's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "TextFormat":
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError("name and schema are required with type json_schema, and allowed only with it")
        return self


class TextConfig(Strict):
    format: TextFormat | None = None
    # GPT-5's answer length: "medium" (its default) asks for nothing; other values are not served.
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesBody(Strict):
    # Refused when sent non-empty: Keel stores no responses or conversations, serves no stored prompts,
    # reasoning controls, output logprobs (include/top_logprobs), or OpenAI's other platform features.
    UNSERVED = frozenset({"conversation", "include", "reasoning", "prompt", "top_logprobs", "access_programs",
                          "background_options", "context_management", "image", "moderation",
                          "prompt_cache_options"})
    model: str
    input: str | list[Any]  # each item an object: read by ``items``
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # Refused unless absent, false or "disabled" (services/openai/responses.py says why).
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted and not used, as on chat: callers are known by their key, there is one service tier
    # (others refused), prompt prefixes are cached by the inference stage itself, and Keel has no
    # built-in tools whose calls max_tool_calls would count.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, v: Any) -> Any:
        if not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of items")
        return v


def _read(cls: type[BaseModel], data: Any, where: str):
    """``data`` as ``cls``; INVALID_BODY naming the field under ``where`` (the item's path)."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        param = ".".join((where, *(str(p) for p in e["loc"])))
        message = f"unknown field '{param}'" if e["type"] == "extra_forbidden" else f"{param}: {e['msg']}"
        raise invalid_body(param, message) from None


def _kind(data: dict[str, Any], where: str) -> str:
    kind = data.get("type")
    if not isinstance(kind, str):
        raise invalid_body(f"{where}.type", f"{where}.type: must be a string")
    return kind


def items(raw: list[Any]) -> list[Item]:
    """The input items, each by its kind (a message may leave out ``type``)."""
    out = []
    for i, data in enumerate(raw):
        where = f"input.{i}"
        if not isinstance(data, dict):
            raise invalid_body(where, f"{where}: an input item must be an object")
        kind = _kind(data, where) if "type" in data else "message"
        if kind not in ITEM_KINDS:
            raise unsupported(f"{where}.type", f"input items of type {kind!r} are not served: only message, "
                                               "function_call and function_call_output")
        if kind == "message" and isinstance(data.get("content"), list):
            for j, part in enumerate(data["content"]):
                if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                    raise unsupported(f"{where}.content.{j}.type", f"input parts of type {part.get('type')!r} are "
                                                                   "not served: only text (input_text, output_text)")
        out.append(_read(ITEM_KINDS[kind], data, where))
    return out


def function_tools(raw: list[dict[str, Any]]) -> list[FunctionTool]:
    out = []
    for i, data in enumerate(raw):
        where = f"tools.{i}"
        kind = _kind(data, where)
        if kind != "function":
            raise unsupported(f"{where}.type", f"tools of type {kind!r} are not served: only function tools")
        out.append(_read(FunctionTool, data, where))
    return out


def function_choice(raw: dict[str, Any]) -> FunctionChoice:
    if raw.get("type") != "function":
        raise unsupported("tool_choice", f"tool_choice of type {raw.get('type')!r} is not served: only \"auto\", "
                                         "\"none\", \"required\" or {\"type\": \"function\", \"name\": ...}")
    return _read(FunctionChoice, raw, "tool_choice")
