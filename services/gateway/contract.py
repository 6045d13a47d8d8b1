"""The gateway's client contract, in one place: the request's domain shape (Ask), every limit a
client is held to (Limits, from config/gateway.yaml), and the one check of shapes, sizes and ranges
with its reasons (docs/errors.md). The other stages check only what they alone know: the engine its
vocabulary, context window and memory; the validator its contracts and rules."""
from __future__ import annotations

from dataclasses import dataclass, replace

from services.gateway.tools import Toolbox, TurnTools
from shared import adapters, errors
from shared.controls import Controls, Sampling, check_controls, check_max_tokens, check_sampling

ROLES = ("system", "user", "assistant")
# Generate's conversations may also answer tool calls (services/gateway/tools.py renders those turns).
CHAT_ROLES = (*ROLES, "tool")

@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 32768
    max_messages: int = 64
    max_tokens_limit: int = 1024
    # A request without max_tokens asks for the context's room after its prompt, at most this many.
    default_max_tokens: int = 128
    # The context a request is held to; None in config: the served model's, set by the stage at start
    # (server.build, shared/modelcard.py). A value lowers it.
    max_context_tokens: int | None = None
    # A call without a deadline gets at least this, and more for a long answer at the pace measured
    # (services/gateway/deadlines.py): deadline_pace_margin x max_tokens x seconds per token.
    default_deadline_ms: int = 60000
    deadline_pace_margin: float = 3.0
    # A client's deadline is held to at most this (a call with a 30-year deadline would otherwise
    # be held that long, e.g. waiting for a replica): one hour.
    max_deadline_ms: int = 3_600_000
    # A rejected request whose JSON is larger goes to the quarantine clipped (shared/clip.py).
    max_quarantine_payload_bytes: int = 65536
    # The gateway gives up this long before the client's deadline, so that its status (with a
    # reason, e.g. NO_HEALTHY_UPSTREAM after holding for a replica) reaches the client before the
    # client's own library ends the call with a bare DEADLINE_EXCEEDED.
    answer_margin_ms: int = 250
    max_tools: int = 64  # functions one request may offer the model (TOO_MANY_TOOLS past it)


@dataclass(frozen=True)
class Ask:
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    domain: str = ""
    source: str = ""
    raw_prompt: str | None = None  # set when the client sent a bare prompt (one templated user turn)
    text: str | None = None        # raw text, continued as it is (no chat template)
    token_ids: tuple[int, ...] = ()  # an input the client tokenized, continued as it is
    adapter: str = ""  # "" = the base model
    controls: Controls = Controls()  # stop strings, penalties, logprobs, response format (shared/controls.py)
    # False: the client sent no max_tokens, and max_tokens is the gateway's default_max_tokens,
    # lowered to the context's room once the prompt is encoded (fit).
    max_tokens_set: bool = True
    truncate_prompt_tokens: int = 0  # keep the prompt's last N tokens; 0 = never cut it
    tools: Toolbox | None = None  # the functions the model may call, and how (None: the client sent none)
    # Per message of a conversation that holds tool calls: an assistant turn's calls, a tool turn's
    # call id (() when none does). services/gateway/tools.py renders them into plain turns.
    turn_tools: tuple[TurnTools, ...] = ()

    @property
    def continues_text(self) -> bool:
        """A raw text or token-ids input: continued as it is, not a conversation's next turn."""
        return self.text is not None or bool(self.token_ids)

    def sampling(self, seed: int) -> Sampling:
        """What the engine samples with, under the seed the gateway settled on."""
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, seed, self.controls)


def check_ask(ask: Ask, limits: Limits) -> None:
    """Request-size and shape rules the gateway enforces before spending anything downstream."""
    check_input(ask, limits)
    check_max_tokens(ask.max_tokens)
    if ask.max_tokens > limits.max_tokens_limit:
        raise errors.InvalidInput(f"max_tokens is {ask.max_tokens}, the limit is {limits.max_tokens_limit}",
                                  reason="MAX_TOKENS_TOO_LARGE",
                                  metadata={"limit": limits.max_tokens_limit, "actual": ask.max_tokens})
    if ask.max_tokens >= limits.max_context_tokens:
        raise errors.InvalidInput(f"max_tokens {ask.max_tokens} leaves no room for the prompt in a context of "
                                  f"{limits.max_context_tokens} tokens", reason="MAX_TOKENS_OUT_OF_RANGE",
                                  metadata={"limit": limits.max_context_tokens - 1, "actual": ask.max_tokens})
    if not 0 <= ask.truncate_prompt_tokens < limits.max_context_tokens:
        raise errors.InvalidInput(f"truncate_prompt_tokens must be in 0..{limits.max_context_tokens - 1}",
                                  reason="TRUNCATE_PROMPT_TOKENS_OUT_OF_RANGE",
                                  metadata={"field": "sampling.truncate_prompt_tokens"})
    check_sampling(ask.temperature, ask.top_p, ask.top_k, ask.seed)
    check_adapter(ask.adapter)
    check_controls(ask.controls, ask.max_tokens)


def check_input(ask: Ask, limits: Limits) -> None:
    """One input, of its kind's shape and size: a conversation (or a bare prompt, one turn of it),
    raw text, or token ids (their range is the tokenizer's to check: it knows the vocabulary). Echo
    repeats a prompt as it was sent, which a templated conversation is not."""
    if ask.token_ids and (ask.messages or ask.text is not None):
        raise errors.InvalidInput("send token_ids or another input (prompt, text, chat), not both",
                                  reason="INPUT_AMBIGUOUS", metadata={"field": "token_ids"})
    if ask.controls.echo and not ask.continues_text:
        raise errors.InvalidInput("echo needs a text or token_ids input: a chat is rendered by the template",
                                  reason="ECHO_UNSUPPORTED", metadata={"field": "sampling.echo"})
    if ask.token_ids:
        if len(ask.token_ids) >= limits.max_context_tokens and not ask.truncate_prompt_tokens:
            fit(ask, len(ask.token_ids), limits)  # CONTEXT_LENGTH_EXCEEDED, before they are decoded
    elif ask.text is not None:
        if not ask.text.strip():
            raise errors.InvalidInput("the text is empty", reason="EMPTY_PROMPT")
        check_prompt_bytes(len(ask.text.encode("utf-8", "surrogatepass")), limits)
    else:
        check_messages(ask.messages, limits, CHAT_ROLES)


def check_messages(messages: tuple[tuple[str, str], ...], limits: Limits, roles: tuple[str, ...] = ROLES) -> None:
    """A conversation's shape and size (Generate's and Tokenize's), its turns in ``roles``."""
    if not messages:
        raise errors.InvalidInput("prompt or messages is required", reason="EMPTY_PROMPT")
    if len(messages) > limits.max_messages:
        raise errors.InvalidInput(f"at most {limits.max_messages} messages", reason="TOO_MANY_MESSAGES")
    for role, _ in messages:
        if role not in roles:
            raise errors.InvalidInput(f"unknown chat role {role!r}; use one of {', '.join(roles)}",
                                      reason="UNKNOWN_ROLE", metadata={"role": role[:64]})
    if not any(content.strip() for _, content in messages):
        raise errors.InvalidInput("the prompt is empty", reason="EMPTY_PROMPT")
    check_prompt_bytes(sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages), limits)


def check_prompt_bytes(size: int, limits: Limits) -> None:
    if size > limits.max_prompt_bytes:
        raise errors.InvalidInput(f"prompt is {size} bytes, the limit is {limits.max_prompt_bytes}",
                                  reason="PROMPT_TOO_LARGE",
                                  metadata={"limit": limits.max_prompt_bytes, "actual": size})


def check_adapter(adapter: str) -> None:
    """INVALID_ARGUMENT (INVALID_ADAPTER, field "adapter") unless empty, "id" or "id@version"."""
    if adapter and not adapters.REQUEST.fullmatch(adapter):
        raise errors.InvalidInput(f"adapter {adapter[:140]!r} is not \"id\" or \"id@version\" (each 1-64 letters, "
                                  "digits, '.', '_' or '-', starting with a letter or digit)",
                                  reason=errors.INVALID_ADAPTER, metadata={"field": "adapter"})


def fit(ask: Ask, prompt_tokens: int, limits: Limits) -> Ask:
    """``ask`` with the max_tokens it is served with, once its prompt has ``prompt_tokens`` tokens:
    an absent max_tokens is lowered to the context's room. InvalidInput CONTEXT_LENGTH_EXCEEDED when
    the prompt and max_tokens (absent: at least one token) do not fit the context."""
    context = limits.max_context_tokens
    room = context - prompt_tokens
    max_tokens = ask.max_tokens if ask.max_tokens_set else max(1, min(ask.max_tokens, room))
    if prompt_tokens + max_tokens > context:
        raise errors.InvalidInput(
            f"this model's maximum context length is {context} tokens, but the request needs "
            f"{prompt_tokens + max_tokens}: {prompt_tokens} in the prompt and {max_tokens} to generate; "
            "shorten the prompt, lower max_tokens, or set truncate_prompt_tokens to cut the prompt",
            reason="CONTEXT_LENGTH_EXCEEDED",
            metadata={"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "context_tokens": context})
    return replace(ask, max_tokens=max_tokens)
