"""Typed results, and the request built from keyword arguments."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2


@dataclass(frozen=True)
class Verdict:
    plugin: str
    passed: bool
    message: str
    blocking: bool


@dataclass(frozen=True)
class Alternative:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability (of the distribution it was sampled from) and the most
    likely alternatives there."""
    token: str
    token_id: int
    logprob: float
    top: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class Answer:
    """A whole, validated answer (GenerateResponse)."""
    text: str
    trace_id: str
    finish_reason: str          # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    seed: int                   # send it back to repeat the answer
    prompt_truncated: bool
    input_flags: tuple[str, ...]
    validation_passed: bool
    low_confidence: bool
    verdicts: tuple[Verdict, ...] = ()
    probes: dict[str, float] = field(default_factory=dict)
    system_fingerprint: str = ""  # the engine that answered; same seed + prompt + fingerprint = same tokens
    adapter: str = ""  # the LoRA adapter that answered as "id@version"; "" = the base model
    logprobs: tuple[TokenLogprob, ...] = ()  # with logprobs=True: one per generated token


@dataclass(frozen=True)
class Delta:
    """A streamed piece of text (never a partial UTF-8 character), with the logprobs of the tokens
    it comes from (logprobs=True)."""
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


def request(prompt: str | None = None, *, messages: Sequence[tuple[str, str]] | None = None,
            max_tokens: int = 0, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
            seed: int | None = None, domain: str = "", source: str = "",
            adapter: str = "", stop: Sequence[str] = (), repetition_penalty: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logprobs: bool = False,
            top_logprobs: int = 0, json_schema: str | Mapping[str, Any] | None = None, regex: str | None = None,
            choice: Sequence[str] | None = None) -> gateway_pb2.GenerateRequest:
    """A GenerateRequest: a ``prompt``, or ``messages`` as (role, content) pairs. ``adapter``: a LoRA
    adapter as "id" (its newest accepted version) or "id@version"; "" = the base model. At most one
    of ``json_schema`` (a document, or a dict), ``regex`` and ``choice`` constrains the answer; the
    server's docs/generation.md gives every control's range."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if sum(x is not None for x in (json_schema, regex, choice)) > 1:
        raise ValueError("give at most one of json_schema, regex or choice")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=list(stop),
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, logprobs=logprobs, top_logprobs=top_logprobs)
    if seed is not None:
        sampling.seed = seed
    req = gateway_pb2.GenerateRequest(sampling=sampling, domain=domain, source=source, adapter=adapter)
    if json_schema is not None:
        req.response_format.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif regex is not None:
        req.response_format.regex = regex
    elif choice is not None:
        req.response_format.choice.values.extend(choice)
    if prompt is not None:
        req.prompt = prompt
    else:
        req.chat.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    return req


def answer(resp: gateway_pb2.GenerateResponse) -> Answer:
    v = resp.validation
    return Answer(
        text=resp.text, trace_id=resp.trace_id, finish_reason=resp.finish_reason,
        prompt_tokens=resp.usage.prompt_tokens, completion_tokens=resp.usage.completion_tokens, seed=resp.seed,
        prompt_truncated=resp.prompt_truncated, input_flags=tuple(resp.input_flags), validation_passed=v.passed,
        low_confidence=v.low_confidence, probes=dict(v.probes),
        verdicts=tuple(Verdict(x.plugin, x.passed, x.message, x.blocking) for x in v.verdicts),
        system_fingerprint=resp.system_fingerprint, adapter=resp.adapter, logprobs=_logprobs(resp.logprobs))


def event(msg: gateway_pb2.GenerateStreamResponse) -> Delta | Answer:
    if msg.WhichOneof("event") == "delta":
        return Delta(msg.delta, _logprobs(msg.logprobs))
    return answer(msg.done)


def _logprobs(items) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token, lp.token_id, lp.logprob, tuple(
        Alternative(a.token, a.token_id, a.logprob) for a in lp.top_logprobs)) for lp in items)
