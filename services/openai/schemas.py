"""The OpenAI request bodies Keel accepts, as strict pydantic models: a field of the wrong JSON type
(no coercion: "16" is not 16, 1 is not true), an unknown field or a NaN/Infinity is refused as
INVALID_BODY, and the error names the field (``body_error``). An OpenAI field Keel knows but cannot
honour (``UNSERVED``) is refused as UNSUPPORTED_PARAMETER instead, so a client can tell "not served"
from a typo; sent as null or empty it asks for nothing and is accepted. Ranges are the gateway's to
check (its reasons travel back as the error's ``code``); only what has no gRPC form is checked here."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared import errors


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)
    # Fields of this body that Keel knows but does not serve: UNSUPPORTED_PARAMETER (``parse``).
    UNSERVED: ClassVar[frozenset[str]] = frozenset()


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Strict):
    role: str
    # A string, or a list of text parts (joined); other part types are refused. null only in an
    # assistant turn (OpenAI's shape beside tool_calls): an empty turn.
    content: list[TextPart] | None
    # The participant's name: accepted and ignored (the model's chat template has no place for it).
    name: str | None = None
    # Calls the assistant made (shown to the model as services/gateway/tools.py renders them, on a chat
    # completion and on /tokenize alike); a "tool" turn names the call it answers.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An answer's own refusal field, as the SDK sends an answer's message back in the history: accepted,
    # not shown to the model (Keel's answers never refuse; their refusal is null).
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_part(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")
        return v

    @model_validator(mode="after")
    def _null_content_for_the_assistant_only(self) -> "Message":
        if self.content is None and self.role != "assistant":
            raise ValueError("content may be null only in an assistant message")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are allowed only in an assistant message")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message may have it")
        return self

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or ())


class JsonSchemaFormat(Strict):
    name: str
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None  # Keel always enforces the schema while decoding


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and allowed only with it")
        return self


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # absent: an object with any members
    strict: bool | None = None  # Keel always decodes a call under its schema


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; Keel's chunks carry no obfuscation padding


def _as_list(v: Any) -> Any:
    """A string or a list of strings, as a list."""
    if isinstance(v, str):
        return [v]
    if v is not None and not isinstance(v, list):
        raise ValueError("must be a string or a list of strings")
    return v


class Sampling(Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # null is accepted wherever OpenAI's own API accepts it, and means the default
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    # vLLM's extensions: keep only the prompt's last N tokens when it is longer (absent: never cut);
    # at least min_tokens tokens before the model may end; ignore_eos: run to max_tokens.
    truncate_prompt_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    # vLLM's extension: score the prompt's tokens with this many alternatives each (answered in
    # vLLM's `prompt_logprobs` shape; /v1/completions' echo with logprobs scores them too).
    prompt_logprobs: int | None = None
    # Accepted and not used (docs/openai.md): Keel identifies callers by API key, stores no
    # completions (store: true is refused in convert.py), has one service tier ("auto" and "default";
    # others refused there) and caches prompt prefixes by itself.
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    UNSERVED = frozenset({"logit_bias"})

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        return _as_list(v)


class ChatBody(Sampling):
    UNSERVED = Sampling.UNSERVED | {"functions", "function_call", "audio", "modalities", "prediction",
                                    "reasoning_effort", "verbosity", "web_search_options"}
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    # "none", "auto", "required" (the gateway checks the mode), or one function by name
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class CompletionBody(Sampling):
    UNSERVED = Sampling.UNSERVED | {"suffix", "best_of"}
    # A text, a list of texts, a list of token ids, or a list of token-id lists (OpenAI's four
    # forms); each is continued as it is, and each gets `n` choices.
    prompt: list[str] | list[list[int]]
    # OpenAI's legacy form: the number of alternatives per position (0 = the tokens' own only).
    logprobs: int | None = None
    echo: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_as_lists(cls, v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [v]  # one prompt of token ids
        return _as_list(v)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v: list) -> list:
        if not v:
            raise ValueError("must hold at least one prompt")
        return v


class TokenizeBody(Strict):
    """vLLM's /tokenize: a ``prompt`` encoded as is, or ``messages`` with the chat template."""

    UNSERVED = frozenset({"chat_template", "chat_template_kwargs", "mm_processor_kwargs"})
    model: str | None = None  # every adapter shares the base model's tokenizer: not used
    prompt: str | None = None
    messages: list[Message] | None = None
    # With messages: rendered as a chat completion renders them (vLLM takes tools; Keel also the two
    # fields the rendering depends on), so the count is the chat completion's prompt.
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None  # with messages; absent: true, as vLLM
    add_special_tokens: bool | None = None  # accepted, no effect: the model adds no BOS or EOS of its own
    # true is not served (convert.py): vLLM's token strings, or the last turn left open
    return_token_strs: bool | None = None
    continue_final_message: bool | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeBody(Strict):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _param(loc: tuple) -> str:
    """The field's path; pydantic's names of a union's members (``list[str]``) are left out."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and "[" in p)) or "(body)"


def body_error(exc: ValidationError) -> errors.InvalidInput:
    """The first validation error as a 400 naming its field."""
    e = exc.errors(include_url=False)[0]
    param = _param(e["loc"])
    message = f"unknown field '{param}'" if e["type"] == "extra_forbidden" else f"{param}: {e['msg']}"
    return invalid_body(param, message)


def invalid_body(param: str, message: str) -> errors.InvalidInput:
    return errors.InvalidInput(message, reason="INVALID_BODY", metadata={"field": param})


def unsupported(param: str, message: str) -> errors.InvalidInput:
    return errors.InvalidInput(message, reason="UNSUPPORTED_PARAMETER", metadata={"field": param})


def parse(cls: type[Strict], data: Any) -> Strict:
    if not isinstance(data, dict):
        raise invalid_body("(body)", "the body must be a JSON object")
    for name in sorted(cls.UNSERVED & data.keys()):
        if data[name] not in (None, [], {}):
            raise unsupported(name, f"{name} is not served by Keel (docs/openai.md lists what is)")
    data = {k: v for k, v in data.items() if k not in cls.UNSERVED}
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise body_error(exc) from None
