"""OpenAI JSON <-> the gateway's protobuf messages. Nothing here checks a range the gateway checks:
a value out of range is sent on as it is, and the gateway's refusal (reason, field) comes back."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from services.openai import httperrors, tools
from services.openai.schemas import ChatBody, CompletionBody, DetokenizeBody, Message, TokenizeBody, unsupported
from shared import errors
from shared.controls import SEED_MAX, Controls, Sampling, check_max_tokens, sampling_pb
from shared.modelfile import model_id

# The served model's name (shared/modelfile.py: the mesh's one model, read once at start).
MODEL_ID = model_id()
INT32_MAX, UINT32_MAX, UINT64_MAX = 2**31 - 1, 2**32 - 1, 2**64 - 1
# OpenAI defaults where a field is absent (Keel's own default temperature is 0, greedy).
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 1.0, 1.0
# "developer" is OpenAI's newer name for the system turn.
ROLE_ALIASES = {"developer": "system"}
# Keel has one service tier: these name it; any other (flex, priority, scale) is not served.
SERVICE_TIERS = (None, "auto", "default")


def adapter_of(model: str) -> str:
    """The gateway's adapter field for an OpenAI ``model``: the base model's name is ""."""
    return "" if model == MODEL_ID else model


def model_of(adapter: str) -> str:
    return adapter or MODEL_ID


def _max_tokens(value: int | None, param: str) -> int:
    if value is None:
        return 0  # the context's room after the prompt, at most the gateway's default_max_tokens
    check_max_tokens(value, param, field=param)
    return min(value, INT32_MAX)  # above the gateway's limit either way: it says MAX_TOKENS_TOO_LARGE


def check_service_tier(tier: str | None) -> None:
    if tier not in SERVICE_TIERS:
        raise unsupported("service_tier", f"service_tier {tier!r} is not served; Keel has one tier "
                                          "(\"auto\" or \"default\")")


def temperature_of(temperature: float | None) -> float:
    """The request's temperature, OpenAI's default when absent (Keel's own default is 0, greedy)."""
    return DEFAULT_TEMPERATURE if temperature is None else temperature


def top_p_of(top_p: float | None) -> float:
    """The request's top_p, OpenAI's default when absent."""
    if top_p == 0:  # the proto's 0 means "unset" (1.0): refused here rather than served as 1
        raise errors.InvalidInput("top_p must be in (0, 1], got 0", reason="TOP_P_OUT_OF_RANGE",
                                  metadata={"field": "top_p"})
    return DEFAULT_TOP_P if top_p is None else top_p


def sampling(body: ChatBody | CompletionBody, max_tokens: int, logprobs: bool, top_logprobs: int,
             prompt_logprobs: int | None = None, echo: bool = False) -> common_pb2.SamplingParams:
    if body.store:
        raise unsupported("store", "store: true is not served: Keel keeps no completions to retrieve")
    check_service_tier(body.service_tier)
    if body.seed is not None and body.seed < 0:
        raise errors.InvalidInput("seed must be 0..2^63-1", reason="SEED_OUT_OF_RANGE", metadata={"field": "seed"})
    controls = Controls(stop=tuple(body.stop or ()), frequency_penalty=body.frequency_penalty or 0.0,
                        presence_penalty=body.presence_penalty or 0.0, logprobs=logprobs,
                        top_logprobs=max(-INT32_MAX, min(top_logprobs, INT32_MAX)),
                        # beyond int32 either way: the gateway says MIN_TOKENS_OUT_OF_RANGE
                        min_tokens=max(-INT32_MAX, min(body.min_tokens or 0, INT32_MAX)),
                        ignore_eos=bool(body.ignore_eos), echo=echo,
                        # beyond int32 either way: the gateway says PROMPT_LOGPROBS_OUT_OF_RANGE
                        prompt_logprobs=None if prompt_logprobs is None
                        else max(-INT32_MAX, min(prompt_logprobs, INT32_MAX)))
    pb = sampling_pb(Sampling(
        max_tokens, temperature_of(body.temperature),
        top_p_of(body.top_p),
        # above 2^63-1: the gateway says SEED_OUT_OF_RANGE
        seed=min(body.seed, UINT64_MAX) if body.seed is not None else None, controls=controls))
    # beyond int32 either way: the gateway says TRUNCATE_PROMPT_TOKENS_OUT_OF_RANGE
    pb.truncate_prompt_tokens = max(-INT32_MAX, min(body.truncate_prompt_tokens or 0, INT32_MAX))
    return pb


def response_format(body: ChatBody) -> common_pb2.ResponseFormat | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    schema = {"type": "object"} if rf.type == "json_object" else rf.json_schema.schema_
    return common_pb2.ResponseFormat(json_schema=json.dumps(schema, ensure_ascii=False))


def chat_messages(messages: list[Message]) -> gateway_pb2.ChatMessages:
    """The conversation for the gateway, with the assistant's tool calls and the tool turns' call ids."""
    return gateway_pb2.ChatMessages(messages=[common_pb2.ChatMessage(
        role=ROLE_ALIASES.get(m.role, m.role), content=m.text, tool_calls=tools.calls_of(m),
        tool_call_id=m.tool_call_id or "") for m in messages])


def chat_request(body: ChatBody) -> gateway_pb2.GenerateRequest:
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise unsupported("max_tokens", "max_tokens and max_completion_tokens differ; send one")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    limit = _max_tokens(asked, param)
    req = gateway_pb2.GenerateRequest(
        chat=chat_messages(body.messages),
        sampling=sampling(body, limit, bool(body.logprobs), body.top_logprobs or 0, body.prompt_logprobs),
        adapter=adapter_of(body.model))
    rf = response_format(body)
    if rf is not None:
        req.response_format.CopyFrom(rf)
    tools.set_tools(body, req)
    return req


# A /v1/completions refusal names `prompt` where the gateway named its conversation or raw input.
COMPLETION_FIELDS = {"messages": "prompt", "text": "prompt"}


def in_completion_terms(err: errors.KeelError) -> errors.KeelError:
    return httperrors.in_terms(err, COMPLETION_FIELDS)


def completion_requests(body: CompletionBody) -> list[gateway_pb2.GenerateRequest]:
    """One gateway request per prompt, each continued as it is (``text``, or ``token_ids``). With
    echo, `max_tokens: 0` scores the prompt without an answer: the gateway generates one token,
    which ``answer`` leaves out (scoring_only)."""
    echo = bool(body.echo)
    limit = 1 if scoring_only(body) else _max_tokens(body.max_tokens, "max_tokens")
    logprobs = body.logprobs is not None
    # echo with logprobs shows the prompt's tokens scored, with as many alternatives as the answer's
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None \
        else body.logprobs if echo and logprobs else None
    params = sampling(body, limit, logprobs, body.logprobs or 0, prompt_logprobs, echo)
    reqs = []
    for i, prompt in enumerate(body.prompt):
        req = gateway_pb2.GenerateRequest(adapter=adapter_of(body.model), sampling=params)
        if isinstance(prompt, str):
            req.text = prompt
        else:
            for j, t in enumerate(prompt):
                if not 0 <= t <= UINT32_MAX:
                    raise errors.InvalidInput(f"prompt.{i}.{j}: {t} is not a token id", reason="TOKEN_ID_OUT_OF_RANGE",
                                              metadata={"field": f"prompt.{i}.{j}"})
            req.token_ids.extend(prompt)
        reqs.append(req)
    return reqs


def scoring_only(body: CompletionBody) -> bool:
    """`max_tokens: 0` with echo: the prompt alone, scored (0 without echo is refused as ever)."""
    return bool(body.echo) and body.max_tokens == 0


def tokenize_request(body: TokenizeBody) -> gateway_pb2.TokenizeRequest:
    if body.return_token_strs:
        raise unsupported("return_token_strs", "token strings are not served; /detokenize gives the text of ids")
    if body.continue_final_message:
        raise unsupported("continue_final_message", "the chat template always closes the last turn")
    if body.messages is None:
        if body.tools is not None or body.tool_choice is not None:
            raise unsupported("tools", "tools are rendered with messages, not with a prompt")
        return gateway_pb2.TokenizeRequest(text=body.prompt)
    req = gateway_pb2.TokenizeRequest(chat=chat_messages(body.messages),
                                      add_generation_prompt=body.add_generation_prompt is not False)
    tools.set_tools(body, req)
    return req


def detokenize_request(body: DetokenizeBody) -> gateway_pb2.DetokenizeRequest:
    for i, t in enumerate(body.tokens):
        if not 0 <= t <= UINT32_MAX:
            raise errors.InvalidInput(f"tokens.{i}: {t} is not a token id", reason="TOKEN_ID_OUT_OF_RANGE",
                                      metadata={"field": f"tokens.{i}"})
    return gateway_pb2.DetokenizeRequest(token_ids=body.tokens)


def tokenized(r: gateway_pb2.TokenizeResponse) -> dict:
    """vLLM's /tokenize answer (``token_strs`` only where asked for, which is not served)."""
    return {"count": len(r.token_ids), "max_model_len": r.context_tokens, "tokens": list(r.token_ids),
            "token_strs": None}


def detokenized(r: gateway_pb2.DetokenizeResponse) -> dict:
    return {"prompt": r.text}


@dataclass(frozen=True)
class Reply:
    """What the answer's JSON objects share: which endpoint, the id, the creation time."""

    chat: bool
    trace_id: str
    created: int

    @classmethod
    def start(cls, chat: bool, trace_id: str) -> "Reply":
        return cls(chat, trace_id, int(time.time()))

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.trace_id}"

    def head(self, obj: str, model: str, fingerprint: str | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": model}
        if fingerprint is not None:
            out["system_fingerprint"] = fingerprint
        return out


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(items) -> dict:
    return {"content": [{
        "token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token),
        "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": _token_bytes(a.token)}
                         for a in t.top_logprobs]} for t in items]}


def completion_logprobs(items, start: int = 0, prompt=()) -> dict:
    """OpenAI's completions logprobs of ``prompt`` (echo's scored prompt tokens: the first has no
    score, shown null) and then the answer's ``items``; text offsets count from ``start``."""
    offsets, at = [], start
    for t in (*prompt, *items):
        offsets.append(at)
        at += len(t.token)
    first = [0] if prompt else []
    return {"tokens": [t.token for t in (*prompt, *items)],
            "token_logprobs": [None if i in first else t.logprob for i, t in enumerate((*prompt, *items))],
            "top_logprobs": [None if i in first else {a.token: a.logprob for a in t.top_logprobs}
                             for i, t in enumerate((*prompt, *items))],
            "text_offset": offsets}


def vllm_prompt_logprobs(items) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map of token id to
    {logprob, rank, decoded_token} holding the token itself and its alternatives (rank: 1-based among
    the alternatives; null for the token itself when it is not one of them)."""
    out: list[dict | None] = []
    for i, t in enumerate(items):
        if i == 0:
            out.append(None)
            continue
        entry = {str(a.token_id): {"logprob": a.logprob, "rank": r, "decoded_token": a.token}
                 for r, a in enumerate(t.top_logprobs, 1)}
        entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": None, "decoded_token": t.token})
        out.append(entry)
    return out


def choices_of(req: gateway_pb2.GenerateRequest, n: int) -> list[gateway_pb2.GenerateRequest]:
    """The `n` generations of one request: the same request, each choice i with seed + i where the client
    set a seed (else the gateway picks one per choice), so sampled choices differ and each replays."""
    out = []
    for i in range(n):
        one = gateway_pb2.GenerateRequest()
        one.CopyFrom(req)
        if i and req.sampling.HasField("seed"):
            one.sampling.seed = (req.sampling.seed + i) % (SEED_MAX + 1)
        out.append(one)
    return out


def answer(reply: Reply, rs: list[gateway_pb2.GenerateResponse], logprobs: bool, n: int = 1,
           scored: list[str] | None = None) -> dict:
    """The whole (unary) answer of one generation per choice (prompt-major: prompt k's choices are
    rs[k*n:(k+1)*n]): a chat.completion or a text_completion. Usage counts each prompt once and every
    choice's completion (OpenAI's n). ``scored``: the prompts' texts of a scoring-only request
    (completions' echo with max_tokens 0), whose one generated token is left out."""
    choices = []
    for i, r in enumerate(rs):
        if reply.chat:
            choice = {"index": i, "message": tools.assistant_message(r),
                      "logprobs": chat_logprobs(r.logprobs) if logprobs else None, "finish_reason": r.finish_reason}
        else:
            items = () if scored is not None else r.logprobs
            choice = {"index": i, "text": r.text if scored is None else scored[i // n],
                      "logprobs": completion_logprobs(items, 0, r.prompt_logprobs) if logprobs else None,
                      "finish_reason": r.finish_reason}
        if r.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(r.prompt_logprobs)
        choices.append(choice)
    first = rs[0]
    obj = "chat.completion" if reply.chat else "text_completion"
    usage = total_usage([r.usage for r in rs], n)
    if scored is not None:
        usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    return {**reply.head(obj, model_of(first.adapter), first.system_fingerprint), "choices": choices,
            "usage": usage, **truncated(first)}


def total_usage(us: list[common_pb2.Usage], n: int = 1) -> dict:
    """Each prompt counted once (the generations of prompt k are us[k*n:(k+1)*n]), every completion."""
    prompt, completion = sum(u.prompt_tokens for u in us[::n]), sum(u.completion_tokens for u in us)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def truncated(r: gateway_pb2.GenerateResponse) -> dict:
    """Keel's flag, on the answer (a stream: its closing chunk), that truncate_prompt_tokens cut the
    prompt; absent when it did not (OpenAI's answers have no such field)."""
    return {"prompt_truncated": True} if r.prompt_truncated else {}


class StreamShaper:
    """Gateway stream messages of the `n` choices -> OpenAI chunk objects, in the order they come: a
    chat choice opens with the assistant's role, each delta is one chunk, its summary closes it with
    finish_reason (and the system fingerprint, known only then); once every choice closed, a usage
    chunk when the client asked for it (the prompt counted once, every choice's completion)."""

    def __init__(self, reply: Reply, model: str, logprobs: bool, include_usage: bool, n: int = 1,
                 per_prompt: int = 1):
        self.reply, self.model, self.logprobs, self.include_usage = reply, model, logprobs, include_usage
        self._per_prompt = per_prompt  # choices per prompt: usage counts each prompt once
        self._offsets = [0] * n
        self._opened = [False] * n
        self._streamed = [False] * n  # a text delta came (a request with tools gets its answer whole)
        self._usage: dict[int, common_pb2.Usage] = {}
        self._n = n

    def _chunk(self, choice: dict, fingerprint: str | None = None, model: str | None = None) -> dict:
        obj = "chat.completion.chunk" if self.reply.chat else "text_completion"
        return {**self.reply.head(obj, model or self.model, fingerprint), "choices": [choice]}

    def _choice(self, i: int, text: str | None, items, finish: str | None, role: bool = False) -> dict:
        if self.reply.chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", **delta}
            lp = chat_logprobs(items) if self.logprobs and items else None
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        lp = completion_logprobs(items, self._offsets[i]) if self.logprobs and items else None
        return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def opening(self, i: int = 0) -> list[dict]:
        if not self.reply.chat or self._opened[i]:
            return []
        self._opened[i] = True
        return [self._chunk(self._choice(i, "", (), None, role=True))]

    def event(self, ev: gateway_pb2.GenerateStreamResponse, i: int = 0) -> list[dict]:
        out = self.opening(i)
        if ev.WhichOneof("event") == "delta":
            out.append(self._chunk(self._choice(i, ev.delta, ev.logprobs, None)))
            self._offsets[i] += len(ev.delta)
            self._streamed[i] = True
            return out
        done = ev.done
        whole = tools.whole_delta(done, self._streamed[i]) if self.reply.chat else None
        if whole is not None:
            lp = chat_logprobs(done.logprobs) if self.logprobs and done.logprobs else None
            out.append(self._chunk({"index": i, "delta": whole, "logprobs": lp, "finish_reason": None}))
        model = model_of(done.adapter)
        out.append({**self._chunk(self._choice(i, None, (), done.finish_reason), done.system_fingerprint, model),
                    **truncated(done)})
        self._usage[i] = done.usage
        if self.include_usage and len(self._usage) == self._n:
            out.append({**self.reply.head(out[-1]["object"], model, done.system_fingerprint), "choices": [],
                        "usage": total_usage([self._usage[k] for k in range(self._n)], self._per_prompt)})
        return out
