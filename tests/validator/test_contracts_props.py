"""Property tests: hypothesis-generated payloads against the default contract.

Every malformed payload is rejected with a reason and a rule, check() never raises, and the
quarantine record of any payload can be built and read back. The checker is compared with a
hand-written reference of the default contract (written from the schema's intent, not from
jsonschema's behaviour), so a schema bug and a checker bug both show up as a disagreement.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.validator.contracts import InputChecker
from services.validator.domains import DomainConfig
from services.validator.records import QuarantineRecord
from shared.errors import InvalidInput

CONTRACTS = Path(__file__).resolve().parents[2] / "config" / "contracts"
CHECKER = InputChecker.from_config(CONTRACTS, {"default": DomainConfig("default")})
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _text(v, lo, hi):
    return type(v) is str and lo <= len(v) <= hi and not v.isspace() and v != ""


def _int(v, lo, hi):
    return type(v) is int and lo <= v <= hi


def _num(v):
    return type(v) in (int, float) and math.isfinite(v)


_FIELDS = {
    "prompt": lambda v: _text(v, 1, 32000),
    "messages": lambda v: type(v) is list and 1 <= len(v) <= 64 and all(
        type(m) is dict and set(m) == {"role", "content"}
        and m["role"] in ("system", "user", "assistant") and _text(m["content"], 1, 32000)
        for m in v),
    "max_tokens": lambda v: _int(v, 1, 2048),
    "temperature": lambda v: _num(v) and 0 <= v <= 2,
    "top_p": lambda v: _num(v) and 0 < v <= 1,
    "top_k": lambda v: _int(v, 0, 1000),
    "seed": lambda v: _int(v, 0, 2**63 - 1),
    "stop": lambda v: type(v) is list and len(v) <= 8 and all(
        type(s) is str and 1 <= len(s) <= 64 for s in v),
    "stream": lambda v: type(v) is bool,
    "domain": lambda v: type(v) is str and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,62}", v) is not None,
    "source": lambda v: type(v) is str and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", v) is not None,
    "trace_id": lambda v: type(v) is str and re.fullmatch(r"[0-9a-f]{32}", v) is not None,
}


def reference_ok(p) -> bool:
    return (type(p) is dict and set(p) <= set(_FIELDS)
            and (("prompt" in p) != ("messages" in p))
            and all(_FIELDS[k](v) for k, v in p.items()))


scalars = (st.none() | st.booleans() | st.integers(-3, 3000) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
           | st.sampled_from(["", " ", "\n", "user", "default", "abc\n", "x" * 32, "0" * 32])
           | st.binary(max_size=4))
messages = st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]),
                                    st.sampled_from(["user", "system", "bot", "", " ", "hi"])
                                    | scalars, max_size=3), max_size=3)
field_values = scalars | messages | st.lists(scalars, max_size=3)
payloads = st.dictionaries(st.sampled_from(sorted(_FIELDS) + ["extra", "Prompt"]),
                           field_values, max_size=5)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=10)


@SETTINGS
@given(payloads | anything)
def test_checker_agrees_with_reference_and_never_raises(payload):
    verdict = CHECKER.check(payload, source="default", domain="default")
    assert verdict.accepted == reference_ok(payload), (payload, verdict)
    if not verdict.accepted:
        assert verdict.reason == "CONTRACT_VIOLATION" and verdict.rule.startswith("contract.")
        err = verdict.error()
        assert isinstance(err, InvalidInput) and err.metadata["rule"] == verdict.rule


valid = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20).filter(lambda s: not s.isspace())},
    optional={"max_tokens": st.integers(1, 2048), "temperature": st.floats(0, 2),
              "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**63 - 1),
              "stream": st.booleans()})

MUTATIONS = [
    lambda p: {k: v for k, v in p.items() if k != "prompt"},
    lambda p: {**p, "prompt": ""},
    lambda p: {**p, "prompt": " \t\n"},
    lambda p: {**p, "prompt": 7},
    lambda p: {**p, "messages": [{"role": "user", "content": "x"}]},
    lambda p: {**p, "max_tokens": 0},
    lambda p: {**p, "max_tokens": 4096},
    lambda p: {**p, "max_tokens": "12"},
    lambda p: {**p, "max_tokens": 12.0},
    lambda p: {**p, "temperature": -0.1},
    lambda p: {**p, "temperature": float("nan")},
    lambda p: {**p, "top_p": 0.0},
    lambda p: {**p, "seed": -5},
    lambda p: {**p, "stream": "yes"},
    lambda p: {**p, "domain": "finance\n"},
    lambda p: {**p, "unexpected": 1},
    lambda p: [p],
]


@SETTINGS
@given(valid, st.sampled_from(range(len(MUTATIONS))))
def test_every_malformed_payload_is_rejected_and_quarantinable(payload, which):
    assert CHECKER.check(payload, source="default", domain="default").accepted
    bad = MUTATIONS[which](payload)
    verdict = CHECKER.check(bad, source="default", domain="default")
    assert not verdict.accepted and verdict.reason == "CONTRACT_VIOLATION", (bad, verdict)
    assert verdict.rule.startswith("contract.default")
    record = QuarantineRecord.for_input(bad, verdict, trace_id="t", source="default")
    back = QuarantineRecord.from_json(record.to_json())
    assert back == record and back.rule == verdict.rule
    assert back.fingerprint == QuarantineRecord.for_input(bad, verdict, trace_id="u",
                                                          source="x").fingerprint


@SETTINGS
@given(anything)
def test_any_payload_makes_a_storable_record(payload):
    verdict = CHECKER.check(payload, source="default", domain="default")
    record = QuarantineRecord.for_input(payload, verdict, trace_id="t", source="s")
    assert QuarantineRecord.from_fields(record.to_fields()) == record
