"""One request's generation controls inside the step: penalties, the grammar's mask, stop strings and
logprobs (docs/generation.md). Owned by the loop thread, like the row it belongs to.

Everything here reads only this row's logits and this row's own history (its prompt and the
tokens it sampled), in a fixed order (ids sorted), so a row's scores are bit-identical alone and
beside any batch-mates: the batch only ever contributes its own rows' logits, which the runner
already makes batch invariant.

The scores a token is drawn from: the model's logits (after the breaker's clamp), penalised, then
the grammar's disallowed tokens set to -inf; temperature then scales them. A logprob is
log_softmax(scores / temperature) at the token (temperature 0, greedy: log_softmax(scores)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.controls import Controls
from shared.errors import InvalidInput

from services.inference.grammar import Vocabulary, allowed


@dataclass(frozen=True)
class Alternative:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's text and log-probability under the distribution it was drawn from, with
    the most likely alternatives there (most likely first, ties by lower id)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[Alternative, ...] = ()


class RowControls:
    def __init__(self, controls: Controls, prompt_ids: list[int], vocab: Vocabulary | None, matcher=None):
        self.c = controls
        self.vocab = vocab
        self.matcher = matcher  # llguidance.LLMatcher at this row's position, or None
        self.counts: dict[int, int] = {}  # sampled token -> times (frequency and presence penalties)
        # Hugging Face's repetition penalty covers the prompt's tokens as well as the answer's.
        self._repeated: set[int] = set(prompt_ids) if controls.repetition_penalty != 1.0 else set()
        self._stops = tuple(s.encode("utf-8") for s in controls.stop)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._tail = b""  # the answer's last bytes, as long as a stop string could still need

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """This row's logits [V] penalised and masked (a new tensor; the batch's is left alone)."""
        c = self.c
        out = logits
        if c.repetition_penalty != 1.0 and self._repeated:
            ids = torch.tensor(sorted(self._repeated), dtype=torch.long)
            v = logits[ids]
            out = logits.index_put((ids,), torch.where(v > 0, v / c.repetition_penalty, v * c.repetition_penalty))
        if (c.frequency_penalty or c.presence_penalty) and self.counts:
            ids = sorted(self.counts)
            cut = torch.tensor([self.counts[i] * c.frequency_penalty + c.presence_penalty for i in ids],
                               dtype=torch.float64).to(out.dtype)
            index = torch.tensor(ids, dtype=torch.long)
            out = out.index_put((index,), out[index] - cut)
        if self.matcher is not None:
            ok = allowed(self.matcher, out.numel())
            self._check_matcher()
            if not ok.any():
                raise InvalidInput("the response format allows no token here", reason="RESPONSE_FORMAT_TOO_COMPLEX",
                                   metadata={"field": f"response_format.{c.response_format.kind}"})
            out = out.masked_fill(torch.from_numpy(~ok), float("-inf"))
        return out

    def logprobs(self, scores: torch.Tensor, token: int, temperature: float) -> TokenLogprobs | None:
        if not self.c.logprobs:
            return None
        dist = torch.log_softmax(scores / temperature if temperature > 0 else scores, dim=-1)
        top: tuple[Alternative, ...] = ()
        if self.c.top_logprobs:
            values, order = torch.topk(dist, self.c.top_logprobs)
            top = tuple(Alternative(i, self._text(i), v)
                        for v, i in zip(values.tolist(), order.tolist()) if v > float("-inf"))
        return TokenLogprobs(token, self._text(token), dist[token].item(), top)

    def accept(self, token: int) -> bool:
        """Record the sampled token; True when the answer must end with it: a stop string is
        complete in the text, or the grammar can take nothing more."""
        if self.c.frequency_penalty or self.c.presence_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.c.repetition_penalty != 1.0:
            self._repeated.add(token)
        done = False
        if self.matcher is not None:
            self.matcher.consume_token(token)
            self._check_matcher()
            done = self.matcher.is_stopped()
        if self._stops and self.vocab is not None:
            text = self._tail + self.vocab.token_bytes[token] if token < self.vocab.size else self._tail
            done = done or any(s in text for s in self._stops)
            self._tail = text[-self._keep:] if self._keep else b""
        return done

    def _check_matcher(self) -> None:
        if self.matcher.is_error():
            kind = self.c.response_format.kind
            raise InvalidInput(f"the response format failed while decoding: {self.matcher.get_error()[:200]}",
                               reason="RESPONSE_FORMAT_TOO_COMPLEX", metadata={"field": f"response_format.{kind}"})

    def _text(self, token: int) -> str:
        return self.vocab.text(token) if self.vocab is not None else ""
