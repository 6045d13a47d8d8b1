"""The client contract's one check (services/gateway/contract.py): sizes and ranges, each with its reason."""
from __future__ import annotations

import pytest

from services.gateway.contract import Ask, Limits, check_ask
from shared.controls import SEED_MAX, Controls
from shared.errors import InvalidInput

LIMITS = Limits(max_prompt_bytes=10, max_tokens_limit=100, max_context_tokens=200)


def ask(*texts: str, **kw) -> Ask:
    return Ask(messages=tuple(("user", t) for t in texts), **{"max_tokens": 1, **kw})


@pytest.mark.parametrize("a", [
    ask("0123456789", max_tokens=100), ask("hello", "world", max_tokens=50), ask("ééééé"),
    ask("hi", temperature=2.0, top_p=1.0, top_k=0, seed=SEED_MAX), ask("hi", seed=0),
])
def test_within_the_contract_passes(a):
    assert check_ask(a, LIMITS) is None


@pytest.mark.parametrize("a,reason", [
    (ask("01234567890"), "PROMPT_TOO_LARGE"),
    (ask("éééééé"), "PROMPT_TOO_LARGE"),  # 6 characters, 12 bytes
    (ask("hello", "world!"), "PROMPT_TOO_LARGE"),  # the turns' sizes add up
    (ask("hi", max_tokens=101), "MAX_TOKENS_TOO_LARGE"),
    (ask("hi", max_tokens=0), "MAX_TOKENS_INVALID"),
    (ask("hi", max_tokens=-5), "MAX_TOKENS_INVALID"),
    (ask("hi", temperature=2.01), "TEMPERATURE_OUT_OF_RANGE"),
    (ask("hi", temperature=-0.1), "TEMPERATURE_OUT_OF_RANGE"),
    (ask("hi", top_p=1.5), "TOP_P_OUT_OF_RANGE"),
    (ask("hi", top_k=-1), "TOP_K_OUT_OF_RANGE"),
    (ask("hi", seed=SEED_MAX + 1), "SEED_OUT_OF_RANGE"),
    (ask("hi", max_tokens=5, controls=Controls(min_tokens=6)), "MIN_TOKENS_OUT_OF_RANGE"),
    (ask("hi", controls=Controls(min_tokens=-1)), "MIN_TOKENS_OUT_OF_RANGE"),
    (ask("  "), "EMPTY_PROMPT"),
    (Ask(messages=(), max_tokens=1), "EMPTY_PROMPT"),
    (Ask(messages=(("robot", "hi"),), max_tokens=1), "UNKNOWN_ROLE"),
])
def test_each_violation_has_its_reason(a, reason):
    with pytest.raises(InvalidInput) as info:
        check_ask(a, LIMITS)
    assert info.value.reason == reason and info.value.code == "INVALID_ARGUMENT"


def test_max_tokens_must_leave_room_for_the_prompt_in_the_context():
    limits = Limits(max_tokens_limit=1024, max_context_tokens=64)
    check_ask(ask("hi", max_tokens=63), limits)
    with pytest.raises(InvalidInput) as info:
        check_ask(ask("hi", max_tokens=64), limits)
    assert info.value.reason == "MAX_TOKENS_OUT_OF_RANGE" and info.value.metadata == {"limit": "63", "actual": "64"}


def test_size_error_metadata_names_limit_and_actual():
    with pytest.raises(InvalidInput) as info:
        check_ask(ask("x" * 11), LIMITS)
    assert info.value.metadata == {"limit": "10", "actual": "11"}
