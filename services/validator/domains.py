"""Per-domain validator configuration: input rules, output plugin chains, probe thresholds.

One :class:`DomainConfig` per domain tag (``default``, ``finance-cn``, ...). Everything here is
data read from YAML (``config/validator/pipeline.yaml`` ships the defaults); changing a rule,
a threshold or a plugin chain needs no code change. ``from_dict`` validates eagerly so a bad
config fails at startup with a message naming the field, never on a request.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.validator.linear import compile_linear
from shared.errors import INVISIBLE_INPUT

ACTIONS = ("reject", "flag")
RULE_KINDS = ("min_length", "cjk_share", "pattern", "visible_chars")
# Default reason per rule kind; a rule may override it in config.
_DEFAULT_REASON = {"min_length": "LOW_QUALITY_INPUT", "cjk_share": "LOW_QUALITY_INPUT",
                   "pattern": "PROMPT_INJECTION", "visible_chars": INVISIBLE_INPUT}
_DEFAULT_FLAG = {"min_length": "low_quality", "cjk_share": "low_quality",
                 "pattern": "suspected_injection", "visible_chars": "invisible_input"}
_UPPER_SNAKE = re.compile(r"[A-Z][A-Z0-9_]*")


def _require(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ValueError(f"validator config {where}: {what}")


@dataclass(frozen=True)
class InputRule:
    """One semantic check on the user text of a request.

    kind ``min_length``: fewer than ``value`` visible characters fails.
    kind ``visible_chars``: fewer than ``value`` visible characters in *all* the text fails
    (a prompt made only of zero-width, format or blank characters).
    kind ``cjk_share``: a share of CJK ideographs below ``value`` (0..1) fails.
    kind ``pattern``: a match of the regex ``pattern`` (RE2 syntax: linear time, no
    lookaround or backreferences) on the normalised text fails.
    ``action`` ``reject`` refuses the request; ``flag`` lets it through with ``flag`` set.
    """

    name: str
    kind: str
    action: str = "reject"
    value: float = 0.0
    pattern: str = ""
    reason: str = ""   # default by kind: LOW_QUALITY_INPUT, or PROMPT_INJECTION for patterns
    flag: str = ""     # default by kind: low_quality, or suspected_injection for patterns

    def __post_init__(self) -> None:
        if self.kind in RULE_KINDS:
            if not self.reason:
                object.__setattr__(self, "reason", _DEFAULT_REASON[self.kind])
            if not self.flag:
                object.__setattr__(self, "flag", _DEFAULT_FLAG[self.kind])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> InputRule:
        _require(isinstance(d, Mapping), where, "a rule must be a mapping")
        kind = d.get("kind")
        _require(kind in RULE_KINDS, where, f"kind must be one of {RULE_KINDS}, got {kind!r}")
        name = str(d.get("name") or kind)
        action = d.get("action", "reject")
        _require(action in ACTIONS, where, f"action must be one of {ACTIONS}, got {action!r}")
        reason = str(d.get("reason") or _DEFAULT_REASON[kind])
        _require(bool(_UPPER_SNAKE.fullmatch(reason)), where, f"reason {reason!r} is not UPPER_SNAKE")
        value = float(d.get("value", 0.0))
        pattern = str(d.get("pattern", ""))
        if kind == "pattern":
            _require(bool(pattern), where, "a pattern rule needs 'pattern'")
            try:
                compile_linear(pattern)
            except ValueError as exc:
                raise ValueError(f"validator config {where}: bad regex {pattern!r}: {exc}") from exc
        elif kind == "cjk_share":
            _require(0.0 <= value <= 1.0, where, "cjk_share value must be within 0..1")
        else:
            _require(value >= 0, where, f"{kind} value must be >= 0")
        return cls(name=name, kind=kind, action=action, value=value, pattern=pattern,
                   reason=reason, flag=str(d.get("flag") or ""))


@dataclass(frozen=True)
class ProbeConfig:
    """Quality-probe settings of one domain.

    An output is ``low_confidence`` when all three signals fall below their thresholds:
    mean token entropy (nats, over at least one token) < ``min_entropy`` (low entropy means
    the model collapsed onto templates), Jaccard overlap with ``terms`` < ``min_term_overlap``,
    and no disclaimer found. A threshold of 0 can never be undercut, which switches the rule
    off: ``min_term_overlap`` defaults to 0, so a domain opts in by giving a term library and a
    threshold; ``min_entropy: 0`` disables it too.
    """

    min_entropy: float = 0.8   # nats; the alert on output_entropy_mean uses the same 0.8
    min_term_overlap: float = 0.0
    terms: tuple[str, ...] = ()
    antonyms: tuple[tuple[str, str], ...] = ()
    disclaimers: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str, base_dir: Path) -> ProbeConfig:
        _require(isinstance(d, Mapping), where, "probes must be a mapping")
        terms = [str(t) for t in d.get("terms", ())]
        if d.get("terms_file"):
            path = base_dir / str(d["terms_file"])
            _require(path.is_file(), where, f"terms_file {path} does not exist")
            terms += [ln.strip() for ln in path.read_text("utf-8").splitlines()
                      if ln.strip() and not ln.lstrip().startswith("#")]
        pairs = []
        for pair in d.get("antonyms", ()):
            _require(isinstance(pair, (list, tuple)) and len(pair) == 2, where,
                     f"an antonym entry must be a pair, got {pair!r}")
            pairs.append((str(pair[0]), str(pair[1])))
        disclaimers = tuple(str(p) for p in d.get("disclaimers", ()))
        for pat in disclaimers:
            try:
                compile_linear(pat, dot_all=False, ignore_case=True)
            except ValueError as exc:
                raise ValueError(f"validator config {where}: bad disclaimer regex {pat!r}: {exc}") from exc
        cfg = cls(min_entropy=float(d.get("min_entropy", 0.8)),
                  min_term_overlap=float(d.get("min_term_overlap", 0.0)),
                  terms=tuple(dict.fromkeys(terms)), antonyms=tuple(pairs),
                  disclaimers=disclaimers)
        _require(math.isfinite(cfg.min_entropy) and cfg.min_entropy >= 0.0, where,
                 "min_entropy must be a finite number >= 0 (nats)")
        _require(0.0 <= cfg.min_term_overlap <= 1.0, where, "min_term_overlap must be within 0..1")
        return cfg


@dataclass(frozen=True)
class DomainConfig:
    """Everything the validator does differently per domain tag."""

    name: str
    input_rules: tuple[InputRule, ...] = ()
    processors: tuple[str, ...] = ()   # plugin instance names, run in order
    validators: tuple[str, ...] = ()   # plugin instance names, all run
    probes: ProbeConfig = field(default_factory=ProbeConfig)

    @classmethod
    def from_dict(cls, name: str, d: Mapping[str, Any] | None,
                  base_dir: Path = Path(".")) -> DomainConfig:
        d = d or {}
        where = f"domains.{name}"
        _require(isinstance(d, Mapping), where, "a domain must be a mapping")
        unknown = set(d) - {"input_rules", "processors", "validators", "probes"}
        _require(not unknown, where, f"unknown keys {sorted(unknown)}")
        # An item may itself be a list of rules (a shared rule set included by YAML alias).
        flat = [r for item in d.get("input_rules", ())
                for r in (item if isinstance(item, list) else [item])]
        rules = tuple(InputRule.from_dict(r, f"{where}.input_rules[{i}]")
                      for i, r in enumerate(flat))
        names = [r.name for r in rules]
        _require(len(names) == len(set(names)), where, f"duplicate rule names in {names}")
        return cls(name=name, input_rules=rules,
                   processors=tuple(str(p) for p in d.get("processors", ())),
                   validators=tuple(str(v) for v in d.get("validators", ())),
                   probes=ProbeConfig.from_dict(d.get("probes", {}), f"{where}.probes", base_dir))


def domains_from_dict(d: Mapping[str, Any], base_dir: Path = Path(".")) -> dict[str, DomainConfig]:
    """``{tag: DomainConfig}`` from the ``domains`` mapping; a ``default`` domain is required
    because requests without a domain tag use it."""
    _require(isinstance(d, Mapping), "domains", "must be a mapping of tag -> domain")
    _require("default" in d, "domains", "a 'default' domain is required")
    return {str(name): DomainConfig.from_dict(str(name), body, base_dir) for name, body in d.items()}
