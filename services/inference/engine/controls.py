"""The generation controls inside the step: penalties, the grammar's mask, stop strings and logprobs
(docs/generation.md). `RowControls` is one request's state, owned by the loop thread like the row
it belongs to; `shape` and `logprobs` work on a whole step's rows at once ([R, V] tensors, one
call per kind of work rather than one per row).

Each row's result reads only that row's logits and that row's own history (its prompt and the
tokens it sampled), in a fixed order (ids sorted), through element-wise operations or per-row
kernels (log_softmax and topk along the vocabulary), so a row's scores and logprobs are
bit-identical alone and beside any batch-mates: the batch only ever contributes its own rows'
logits, which the runner already makes batch invariant.

The scores a token is drawn from: the model's logits (after the breaker's clamp), penalised, then
the grammar's disallowed tokens set to -inf; temperature then scales them. A logprob is
log_softmax(scores / temperature) at the token (temperature 0, greedy: log_softmax(scores)).
A prompt token's logprob (controls.prompt_logprobs) is of the model's raw distribution, log_softmax
of its logits, which the runner computes in the prefill (model/scoring.py); `score_prompt` only
gives the values their tokens and text.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.inference.engine.grammar import MaskExecutor, Vocabulary, allowed
from services.inference.model.scoring import PromptScores
from shared.controls import MAX_TOP_LOGPROBS, Controls
from shared.errors import InvalidInput, KeelError

log = logging.getLogger("keel.inference.controls")


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
    def __init__(self, controls: Controls, prompt_ids: list[int], vocab: Vocabulary | None, matcher=None,
                 end_ids: tuple[int, ...] = ()):
        self.c = controls
        self.vocab = vocab
        self.matcher = matcher  # llguidance.LLMatcher at this row's position, or None
        # The ids min_tokens masks while the answer is shorter (the model's end ids, the request's stop ids).
        self.end_ids = tuple(sorted(set(end_ids)))
        self.generated = 0  # tokens sampled so far
        self.counts: dict[int, int] = {}  # sampled token -> times (frequency and presence penalties)
        # Hugging Face's repetition penalty covers the prompt's tokens as well as the answer's.
        self._repeated: set[int] = set(prompt_ids) if controls.repetition_penalty != 1.0 else set()
        self._stops = tuple(s.encode("utf-8") for s in controls.stop)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self._tail = b""  # the answer's last bytes, as long as a stop string could still need
        self.prompt_ids = prompt_ids
        self.scored_prompt: list[TokenLogprobs] = []  # with prompt_logprobs: the prompt's tokens so far

    def score_prompt(self, start: int, scores: PromptScores | None) -> None:
        """Record a prefill chunk's prompt logprobs: the chunk starts at position `start`; `scores`
        are those of the prompt tokens after its positions (None: none, a last chunk of one token).
        Position 0, which nothing precedes, gets logprob 0 and no alternatives."""
        if start == 0:
            first = self.prompt_ids[0]
            self.scored_prompt.append(TokenLogprobs(first, self._text(first), 0.0))
        if scores is None:
            return
        k = self.c.prompt_logprobs
        values, order = (scores.top_logprobs.tolist(), scores.top_ids.tolist()) if k else ((), ())
        for j, logprob in enumerate(scores.logprobs.tolist()):
            token = self.prompt_ids[start + 1 + j]
            top = self.alternatives(values[j], order[j], k) if k else ()
            self.scored_prompt.append(TokenLogprobs(token, self._text(token), logprob, top))

    def alternatives(self, values: list[float], ids: list[int], k: int) -> tuple[Alternative, ...]:
        """The `k` most likely of a topk's (values, ids), most likely first (ties: the lower id),
        with their text; a token the scores rule out (-inf) is no alternative."""
        best = sorted(zip(values, ids), key=lambda a: (-a[0], a[1]))[:k]
        return tuple(Alternative(i, self._text(i), v) for v, i in best if v > float("-inf"))

    def accept(self, token: int) -> bool:
        """Record the sampled token; True when the answer must end with it: a stop string is
        complete in the text, or the grammar can take nothing more."""
        self.generated += 1
        if self.c.frequency_penalty or self.c.presence_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.c.repetition_penalty != 1.0:
            self._repeated.add(token)
        done = False
        if self.matcher is not None:
            self.matcher.consume_token(token)
            if self.matcher.is_error():
                raise self._grammar_failed()
            done = self.matcher.is_stopped()
        if self._stops and self.vocab is not None:
            text = self._tail + self.vocab.token_bytes[token] if token < self.vocab.size else self._tail
            done = done or any(s in text for s in self._stops)
            self._tail = text[-self._keep:] if self._keep else b""
        return done

    def _grammar_failed(self, why: str | None = None) -> InvalidInput:
        kind = self.c.response_format.kind
        if why is None:  # the grammar engine's own words describe its state: the log keeps them
            log.info("response format failed while decoding", extra={"error": self.matcher.get_error()[:500]})
            why = "the response format ran out of the grammar engine's per-token budget while decoding"
        return InvalidInput(why, reason="RESPONSE_FORMAT_TOO_COMPLEX", metadata={"field": f"response_format.{kind}"})

    def _text(self, token: int) -> str:
        return self.vocab.text(token) if self.vocab is not None else ""


@dataclass
class Shaped:
    scores: torch.Tensor  # [R, V] what each row's token is drawn from (the logits themselves if no row shapes)
    errors: dict[int, KeelError] = field(default_factory=dict)  # row -> why its grammar gave out


@dataclass
class _Edits:
    """Per-element edits gathered over a step's rows: (row, token) -> amount, flat."""

    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # Python floats, rounded once to the logits' dtype

    def add(self, row: int, tokens: list[int], values: list[float]) -> None:
        self.rows += [row] * len(tokens)
        self.tokens += tokens
        self.values += values

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.rows), torch.tensor(self.tokens)

    def amounts(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(self.values, dtype=torch.float64).to(dtype)


def shape(rows: Sequence[RowControls | None], logits: torch.Tensor, masks: MaskExecutor) -> Shaped:
    """The rows' logits [R, V] penalised and masked, as a new tensor (the batch's is left alone).

    Per row, in this order: the repetition penalty (HF: positive logits divided by it, negative
    multiplied) over the prompt's and answer's tokens; then frequency * count + presence subtracted
    for each sampled token; then, while the answer is shorter than min_tokens, the end ids set to
    -inf; then the grammar's disallowed tokens set to -inf. A row whose grammar fails is left
    unmasked and named in `errors` (that row fails, its batch-mates go on).
    """
    rep, cut, early = _Edits(), _Edits(), _Edits()  # repetition penalties; frequency/presence amounts; end ids
    grammar: list[int] = []
    for r, row in enumerate(rows):
        if row is None:
            continue
        c = row.c
        if c.repetition_penalty != 1.0 and row._repeated:
            ids = sorted(row._repeated)
            rep.add(r, ids, [c.repetition_penalty] * len(ids))
        if (c.frequency_penalty or c.presence_penalty) and row.counts:
            ids = sorted(row.counts)
            amount = [row.counts[i] * c.frequency_penalty + c.presence_penalty for i in ids]
            cut.add(r, ids, amount)
        if row.generated < c.min_tokens and row.end_ids:
            early.add(r, list(row.end_ids), [0.0] * len(row.end_ids))
        if row.matcher is not None:
            grammar.append(r)
    out = Shaped(logits)
    if not (rep.rows or cut.rows or early.rows or grammar):
        return out
    scores = out.scores = logits.clone()
    if rep.rows:
        at, p = rep.index(), rep.amounts(scores.dtype)
        v = scores[at]
        scores[at] = torch.where(v > 0, v / p, v * p)
    if cut.rows:
        at = cut.index()
        scores[at] = scores[at] - cut.amounts(scores.dtype)
    if early.rows:
        scores[early.index()] = float("-inf")
    if grammar:
        ok = allowed(masks, [rows[r].matcher for r in grammar], scores.shape[-1])  # [G, V]
        usable = ok.any(dim=-1).tolist()
        for g, r in enumerate(grammar):
            if rows[r].matcher.is_error():
                out.errors[r] = rows[r]._grammar_failed()
            elif not usable[g]:
                out.errors[r] = rows[r]._grammar_failed("the response format allows no token here")
        keep = [g for g, r in enumerate(grammar) if r not in out.errors]
        if keep:
            at = torch.tensor([grammar[g] for g in keep])
            scores[at] = scores[at].masked_fill(~ok[keep], float("-inf"))
    return out


def logprobs(rows: Sequence[RowControls | None], scores: torch.Tensor, tokens: Sequence[int],
             temperatures: Sequence[float]) -> list[TokenLogprobs | None]:
    """Per row that asks for them: log_softmax(scores / temperature) at the sampled token (scores
    alone at temperature 0) and its top_logprobs alternatives. Every row runs topk with the same k
    (the most a request may ask for), so a row's list never depends on its batch-mates'."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    want = [r for r, row in enumerate(rows) if row is not None and row.c.logprobs]
    if not want:
        return out
    s = scores if len(want) == len(rows) else scores[want]
    t = [temperatures[r] if temperatures[r] > 0 else 1.0 for r in want]
    if any(x != 1.0 for x in t):  # (dividing by 1.0 changes no bit: skipped)
        s = s / torch.tensor(t, dtype=torch.float64).to(s.dtype)[:, None]
    dist = torch.log_softmax(s, dim=-1)  # [W, V]
    chosen = dist[torch.arange(len(want)), torch.tensor([tokens[r] for r in want])].tolist()
    values, order = (v.tolist() for v in torch.topk(dist, min(MAX_TOP_LOGPROBS, dist.shape[-1]), dim=-1))
    for w, r in enumerate(want):
        row = rows[r]
        top = row.alternatives(values[w], order[w], row.c.top_logprobs)
        out[r] = TokenLogprobs(tokens[r], row._text(tokens[r]), chosen[w], top)
    return out
