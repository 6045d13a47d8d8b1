"""Semantic input rules of one domain, compiled once: minimum length, CJK share, patterns.

The rules see two views of a request: *all* the text the model will read (prompt or every
message content; pattern rules scan this, since a spoofed ``<|im_start|>`` is as dangerous in
a system message as in a user one) and the *user* text (prompt, or the ``user`` messages;
length and language rules judge what the user wrote).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.validator.cpu_budget import CpuBudget
from services.validator.domains import DomainConfig, InputRule
from services.validator.linear import compile_linear
from services.validator.text import cjk_share, normalise, visible_count


@dataclass(frozen=True)
class RequestText:
    """The text views of one request payload."""

    all_text: str
    user_text: str

    @classmethod
    def of(cls, payload: Mapping[str, Any]) -> RequestText:
        """Defensive extraction: the contract normally guarantees the shape, but a contract is
        data an operator may loosen, so non-string parts are skipped rather than trusted."""
        prompt = payload.get("prompt")
        if isinstance(prompt, str):
            return cls(prompt, prompt)
        messages = payload.get("messages")
        parts: list[tuple[str, str]] = []
        if isinstance(messages, list):
            for msg in messages:
                if isinstance(msg, Mapping) and isinstance(msg.get("content"), str):
                    parts.append((str(msg.get("role", "")), msg["content"]))
        user = [content for role, content in parts if role == "user"]
        return cls("\n".join(c for _, c in parts), "\n".join(user))


@dataclass(frozen=True)
class RuleFailure:
    rule: InputRule
    message: str


class CompiledRules:
    """The input rules of one domain, with their regexes compiled (RE2: linear time)."""

    def __init__(self, domain: DomainConfig):
        self.domain = domain.name
        self._rules = domain.input_rules
        self._regex = {r.name: compile_linear(r.pattern)
                       for r in domain.input_rules if r.kind == "pattern"}

    def failures(self, text: RequestText, budget: CpuBudget | None = None) -> list[RuleFailure]:
        """Every failing rule, rejecting ones first (in config order), then flagging ones.
        ``budget`` is charged after each rule (CpuBudgetExceeded once it is spent)."""
        budget = budget or CpuBudget(None)
        failed: list[RuleFailure] = []
        normalised: str | None = None
        for rule in self._rules:
            if rule.kind == "pattern":
                if normalised is None:
                    normalised = normalise(text.all_text)
                    budget.charge("normalising the text")
                match = self._regex[rule.name].search(normalised)
                if match:
                    failed.append(RuleFailure(rule, f"input matches injection rule "
                                                    f"{rule.name!r} near {match.group(0)[:40]!r}"))
            elif rule.kind == "visible_chars":
                visible = visible_count(text.all_text)
                if visible < rule.value:
                    failed.append(RuleFailure(rule, f"input has {visible} visible characters, "
                                                    f"fewer than {rule.value:g}; the rest is "
                                                    f"blank, zero-width or control characters"))
            elif rule.kind == "min_length":
                length = len("".join(text.user_text.split()))
                if length < rule.value:
                    failed.append(RuleFailure(rule, f"input has {length} non-space characters, "
                                                    f"fewer than {rule.value:g}"))
            else:
                share = cjk_share(text.user_text)
                if share < rule.value:
                    failed.append(RuleFailure(rule, f"CJK share {share:.2f} is below "
                                                    f"{rule.value:.2f}"))
            budget.charge(f"rule {rule.name!r}")
        failed.sort(key=lambda f: f.rule.action != "reject")
        return failed
