"""Quality probes run on every output: entropy, contradiction, disclaimer, term overlap.

Values (all plain floats/bools, ready for a response, a span or a metric):
  entropy_mean        mean predictive entropy (nats) of the generated tokens; 0.0 if none.
                      Low is the warning sign: a model collapsing onto templates is certain
                      of every token
  entropy_tokens      how many finite, non-negative entropies were averaged
  term_overlap        Jaccard(answer tokens, domain term-library tokens), tokens = ASCII words
                      + CJK bigrams
  disclaimer          a configured disclaimer pattern occurs
  contradiction       both words of a configured antonym pair occur in the answer
The output is ``low_confidence`` when entropy_mean (over at least one token) and term_overlap
are below their thresholds and no disclaimer was found (a threshold of 0 can never be undercut,
so it switches the rule off).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from services.validator.domains import ProbeConfig
from services.validator.linear import compile_linear
from services.validator.text import content_tokens, inflected_regex, normalise


@dataclass(frozen=True)
class ProbeReport:
    values: dict[str, float | bool]
    contradictions: tuple[tuple[str, str], ...]   # the antonym pairs found
    normalised: str                               # the normalised answer, for validators to reuse


def mean_entropy(entropies: Sequence[float]) -> tuple[float, int]:
    """Mean over the finite, non-negative entropies (NaN/inf/negatives from a broken row are
    ignored rather than poisoning the mean), and how many there were."""
    good = [float(e) for e in entropies if isinstance(e, (int, float)) and math.isfinite(e) and e >= 0]
    return (math.fsum(good) / len(good), len(good)) if good else (0.0, 0)


def jaccard(a: set[str], b: set[str]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 0.0


class Probes:
    """The probes of one domain, compiled once."""

    def __init__(self, cfg: ProbeConfig):
        self.cfg = cfg
        self._library = set().union(*(content_tokens(t) for t in cfg.terms)) if cfg.terms else set()
        self._pairs = [(a, b, re.compile(inflected_regex(a)), re.compile(inflected_regex(b)))
                       for a, b in cfg.antonyms]
        self._disclaimers = [compile_linear(p, dot_all=False, ignore_case=True) for p in cfg.disclaimers]

    def measure(self, text: str, entropies: Sequence[float]) -> ProbeReport:
        norm = normalise(text)
        h_mean, n = mean_entropy(entropies)
        found = tuple((a, b) for a, b, ra, rb in self._pairs if ra.search(norm) and rb.search(norm))
        values: dict[str, float | bool] = {
            "entropy_mean": h_mean,
            "entropy_tokens": float(n),
            "term_overlap": jaccard(content_tokens(text), self._library),
            "disclaimer": any(r.search(norm) for r in self._disclaimers),
            "contradiction": bool(found),
        }
        return ProbeReport(values, found, norm)

    def low_confidence(self, report: ProbeReport) -> bool:
        v = report.values
        # No entropies is no evidence of collapse, so it cannot trip the entropy signal.
        return (v["entropy_tokens"] > 0 and v["entropy_mean"] < self.cfg.min_entropy
                and v["term_overlap"] < self.cfg.min_term_overlap
                and not v["disclaimer"])
