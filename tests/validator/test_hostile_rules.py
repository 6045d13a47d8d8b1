"""Input rules under hostile text: every configured rule runs in linear time (RE2), a check
that still costs too much is cut by the CPU budget, and invisible-only prompts are refused."""
from __future__ import annotations

import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.validator.builtins import ForbiddenPatterns
from services.validator.contracts import InputChecker
from services.validator.domains import DomainConfig
from services.validator.plugins import OutputContext
from services.validator.rules import CompiledRules, RequestText
from shared.errors import INPUT_CHECK_BUDGET_EXCEEDED, INVISIBLE_INPUT
from testing.hostile import DELIMITERS, OPENED, PATTERN_RULES, PIPELINE, ROOT, cost_s, fill

# Linear rules take a few ms on 32 KB; the backtracking engine took seconds (quadratic). The
# bound is far above the first and far below the second, whatever else runs on the machine.
BOUND_S = 0.5


def test_every_configured_pattern_rule_is_covered():
    assert {"script_tag", "template_syntax", "role_marker", "override_instructions"} <= set(PATTERN_RULES)


@pytest.mark.parametrize("name", sorted(PATTERN_RULES))
@pytest.mark.parametrize("piece", DELIMITERS)
def test_unclosed_delimiters_cost_linear_time(name, piece):
    assert cost_s(PATTERN_RULES[name], fill(piece)) < BOUND_S


@pytest.mark.parametrize("name", sorted(PATTERN_RULES))
@pytest.mark.parametrize("text", OPENED, ids=lambda t: repr(t[:4]))
def test_an_opener_and_a_long_run_cost_linear_time(name, text):
    assert cost_s(PATTERN_RULES[name], text) < BOUND_S


@st.composite
def prefix_floods(draw, pattern: str) -> str:
    """32 KB of one prefix of a text the rule matches, each copy followed by a filler."""
    match = draw(st.from_regex(re.compile(pattern, re.DOTALL), fullmatch=True).filter(lambda m: len(m) > 1))
    prefix = match[:draw(st.integers(1, len(match) - 1))]
    return fill(prefix + draw(st.sampled_from(["", " ", "\n", "x", "{", "<", "|", "%", "}"])))


@pytest.mark.parametrize("name", sorted(PATTERN_RULES))
def test_floods_of_rule_prefixes_cost_linear_time(name):
    rule = PATTERN_RULES[name]

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(prefix_floods(rule.pattern))
    def run(text):
        assert cost_s(rule, text) < BOUND_S, f"{name} on {text[:40]!r}..."
    run()


def test_a_pattern_needing_backtracking_is_refused_at_load():
    with pytest.raises(ValueError, match=r"input_rules\[0\].*linear-time"):
        DomainConfig.from_dict("x", {"input_rules": [{"kind": "pattern", "pattern": r"(?<!a)b"}]})
    with pytest.raises(ValueError, match="linear-time"):
        DomainConfig.from_dict("x", {"input_rules": [{"kind": "pattern", "pattern": r"(a+)\1"}]})


@pytest.mark.parametrize("text", OPENED + [fill(p) for p in DELIMITERS], ids=lambda t: repr(t[:4]))
def test_configured_forbidden_output_patterns_cost_linear_time(text):
    forbidden = ForbiddenPatterns(**PIPELINE.plugins["forbidden"].args)
    start = time.perf_counter()
    forbidden.validate(text, OutputContext(domain="default"))
    assert time.perf_counter() - start < BOUND_S


def test_output_patterns_needing_backtracking_are_refused_at_load():
    with pytest.raises(ValueError, match="linear-time"):
        ForbiddenPatterns({"x": r"(?<!no )guarantee"})
    with pytest.raises(ValueError, match="disclaimer.*linear-time"):
        DomainConfig.from_dict("x", {"probes": {"disclaimers": [r"(a)\1"]}})


def test_rules_still_catch_what_they_caught():
    rules = CompiledRules(PIPELINE.domains["default"])
    for text, name in [("x {{ a\nb }} y", "template_syntax"), ("< / SCRIPT>", "script_tag"),
                       ("ok <|im_start|>", "role_marker")]:
        norm = text.lower()
        assert name in [f.rule.name for f in rules.failures(RequestText(norm, norm))]


def test_an_input_over_the_cpu_budget_is_refused_with_a_reason():
    payload = {"prompt": "résumé " * 4000, "max_tokens": 8}
    tight = InputChecker.from_config(ROOT / "config" / "contracts", PIPELINE.domains, cpu_budget_s=1e-6)
    verdict = tight.check(payload, source="default", domain="default")
    assert not verdict.accepted
    assert (verdict.reason, verdict.rule) == (INPUT_CHECK_BUDGET_EXCEEDED, "cpu_budget")
    assert "budget" in verdict.message
    roomy = InputChecker.from_config(ROOT / "config" / "contracts", PIPELINE.domains, cpu_budget_s=5.0)
    assert roomy.check(payload, source="default", domain="default").accepted


@pytest.mark.parametrize("text", ["\u200b\u200c\u200d\u2060\ufeff", "\u200b \u00a0\u3164\u2800",
                                  "\u0001" * 50, "\u202e\u2066\u2069", "\u034f\u0301"])
@pytest.mark.parametrize("domain", ["default", "finance-cn"])
def test_a_prompt_of_invisible_characters_is_refused(text, domain):
    checker = InputChecker.from_config(ROOT / "config" / "contracts", PIPELINE.domains)
    payload = {"prompt": text, "max_tokens": 8, "domain": domain}
    verdict = checker.check(payload, source=domain, domain=domain)
    assert not verdict.accepted
    assert (verdict.reason, verdict.rule) == (INVISIBLE_INPUT, f"{domain}.visible_text")


def test_visible_text_with_zero_width_characters_passes():
    checker = InputChecker.from_config(ROOT / "config" / "contracts", PIPELINE.domains)
    verdict = checker.check({"prompt": "hel\u200blo there"}, source="default", domain="default")
    assert verdict.accepted
