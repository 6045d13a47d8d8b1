"""Request and event types of the inference engine, and request validation (re-exported by engine.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.inference.engine.controls import TokenLogprobs
from shared.controls import Controls, check_controls, check_max_tokens, check_sampling
from shared.errors import InvalidInput


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    deadline: float | None = None  # time.monotonic() based
    trace_id: str = ""
    fingerprint: str = ""  # digest of the input, logged when this request fails numerically
    adapter: str = ""  # LoRA adapter "id" or "id@version"; "" = the base model (lora/registry.py resolves it)
    controls: Controls = Controls()  # stop strings, penalties, logprobs, response format (controls.py)

    @property
    def total_tokens(self) -> int:
        """prompt + max_tokens: the most positions this request's row can hold (context check, memory
        charge, KV blocks, queue accounting)."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float   # log-probability of token_id under the model's distribution
    entropy: float   # predictive entropy (nats) of that distribution
    index: int       # 0-based position in the completion
    logprobs: TokenLogprobs | None = None  # with controls.logprobs (controls.py says of which distribution)


@dataclass(frozen=True)
class Finished:
    # "stop" (eos or a stop id, not streamed as a token; or a stop string or a complete grammar,
    # whose last token is streamed) | "length"
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int  # tokens streamed
    seed: int
    queue_ms: float     # submission -> start of the prefill
    ttft_ms: float      # submission -> first token sampled
    format: str         # weight format of the model that served the request (changes under breaker level 2)
    breaker_level: int  # breaker level in force when the request was prefilled
    variant: str = "primary"  # the model variant the request started on (variants.py)
    adapter: str = ""   # the adapter that served it, "id@version" ("" = the base model)
    # with controls.prompt_logprobs: every prompt token in order (RowControls.score_prompt), else ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def span_attributes(self) -> dict[str, str | int | float]:
        return {"inference.finish_reason": self.finish_reason, "inference.prompt_tokens": self.prompt_tokens,
                "inference.completion_tokens": self.completion_tokens, "inference.seed": str(self.seed),
                "inference.queue_ms": round(self.queue_ms, 3), "inference.ttft_ms": round(self.ttft_ms, 3),
                "inference.format": self.format, "inference.breaker_level": self.breaker_level,
                "inference.variant": self.variant, "inference.adapter": self.adapter}


def validate(req: GenerationRequest, vocab_size: int, max_context_tokens: int) -> None:
    """Raise InvalidInput unless the request is well-formed."""
    def bad(message: str, reason: str, **meta) -> InvalidInput:
        return InvalidInput(message, reason=reason, metadata={"request_id": req.request_id, **meta})

    if not isinstance(req.request_id, str) or not req.request_id:
        raise bad("request_id must be a non-empty string", "MISSING_REQUEST_ID")
    ids = req.prompt_ids
    if not isinstance(ids, (list, tuple)) or not ids:
        raise bad("prompt_ids must be a non-empty list of token ids", "EMPTY_PROMPT")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"prompt_ids[{i}]={t!r} is not a token id in [0, {vocab_size})", "TOKEN_OUT_OF_RANGE",
                      index=i)
    check_max_tokens(req.max_tokens, request_id=req.request_id)
    if req.total_tokens > max_context_tokens:
        raise bad(f"prompt ({len(ids)}) + max_tokens ({req.max_tokens}) exceeds the context window "
                  f"({max_context_tokens})", "CONTEXT_LENGTH_EXCEEDED",
                  prompt_tokens=len(ids), max_tokens=req.max_tokens, context_tokens=max_context_tokens)
    check_sampling(req.temperature, req.top_p, req.top_k, req.seed, request_id=req.request_id)
    for t in req.stop_token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"stop token {t!r} is not a token id", "TOKEN_OUT_OF_RANGE")
    if not isinstance(req.adapter, str):
        raise bad(f"adapter must be a string, got {type(req.adapter).__name__}", "INVALID_ADAPTER_NAME")
    if req.deadline is not None and not _finite_number(req.deadline):
        raise bad("deadline must be a finite time.monotonic() value", "INVALID_DEADLINE")
    check_controls(req.controls, req.max_tokens)


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
