"""Input contracts (JSON Schema per source) and the InputVerdict -> InvalidInput mapping."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.validator.contracts import InputChecker, load_contracts
from services.validator.domains import DomainConfig
from shared.errors import InvalidInput

CONTRACTS = Path(__file__).resolve().parents[2] / "config" / "contracts"
# No semantic rules: these tests look at the contracts alone.
BARE = {"default": DomainConfig("default"), "finance-cn": DomainConfig("finance-cn")}


@pytest.fixture(scope="module")
def checker() -> InputChecker:
    return InputChecker.from_config(CONTRACTS, BARE)


@pytest.mark.parametrize("payload", [
    {"prompt": "hello"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    {"prompt": "x", "max_tokens": 2048, "temperature": 0, "top_p": 1, "seed": 2**63 - 1,
     "stop": ["\n"], "stream": True, "domain": "default", "source": "web",
     "trace_id": "0" * 32, "top_k": 0},
])
def test_default_contract_accepts_well_formed_requests(checker, payload):
    verdict = checker.check(payload, source="default", domain="default")
    assert verdict.accepted and not verdict.flags, verdict.message
    assert not verdict.needs_quarantine


@pytest.mark.parametrize("payload, path, keyword", [
    ({}, "", "oneOf"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "", "oneOf"),
    ({"prompt": ""}, "prompt", "minLength"),
    ({"prompt": "   \n\t"}, "prompt", "pattern"),
    ({"prompt": 42}, "prompt", "type"),
    ({"prompt": "a", "max_tokens": "10"}, "max_tokens", "type"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens", "type"),
    ({"prompt": "a", "max_tokens": 3.0}, "max_tokens", "type"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "minimum"),
    ({"prompt": "a", "max_tokens": 2049}, "max_tokens", "maximum"),
    ({"prompt": "a", "temperature": 2.5}, "temperature", "maximum"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature", "type"),
    ({"prompt": "a", "top_p": float("inf")}, "top_p", "type"),
    ({"prompt": "a", "top_p": 0}, "top_p", "exclusiveMinimum"),
    ({"prompt": "a", "seed": -1}, "seed", "minimum"),
    ({"prompt": "a", "seed": 2**63}, "seed", "maximum"),  # inference seeds an int64 generator
    ({"prompt": "a", "seed": 2**64}, "seed", "maximum"),
    ({"prompt": "a", "domain": "Finance CN"}, "domain", "pattern"),
    ({"prompt": "a", "trace_id": "xyz"}, "trace_id", "pattern"),
    ({"prompt": "a", "stop": [""]}, "stop/0", "minLength"),
    ({"prompt": "a", "colour": "red"}, "", "additionalProperties"),
    ({"messages": []}, "messages", "minItems"),
    ({"messages": [{"role": "root", "content": "hi"}]}, "messages/0/role", "enum"),
    ({"messages": [{"role": "user"}]}, "messages/0", "required"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages/0",
     "additionalProperties"),
])
def test_default_contract_rejects_with_field_and_keyword(checker, payload, path, keyword):
    verdict = checker.check(payload, source="default", domain="default")
    assert not verdict.accepted
    assert verdict.reason == "CONTRACT_VIOLATION"
    assert verdict.rule == f"contract.default.{keyword}"
    assert verdict.path == path
    err = verdict.error()
    assert isinstance(err, InvalidInput)
    assert err.reason == "CONTRACT_VIOLATION"
    assert err.metadata["rule"] == verdict.rule and err.metadata["field"] == path


@pytest.mark.parametrize("payload", [None, [], "prompt", 3, {"prompt"}])
def test_non_object_payload_is_a_contract_violation(checker, payload):
    verdict = checker.check(payload, source="default", domain="default")
    assert (verdict.accepted, verdict.reason, verdict.rule) == (
        False, "CONTRACT_VIOLATION", "contract.default")


def test_finance_contract_refines_default_through_ref(checker):
    ok = {"prompt": "LPR?", "domain": "finance-cn", "max_tokens": 100}
    assert checker.check(ok, source="finance-cn", domain="finance-cn").accepted
    # Its own constraints ...
    for bad, keyword in [({**ok, "max_tokens": 2000}, "maximum"),
                         ({"prompt": "LPR?", "domain": "finance-cn"}, "required"),
                         ({**ok, "domain": "default"}, "const")]:
        v = checker.check(bad, source="finance-cn", domain="finance-cn")
        assert not v.accepted and v.rule == f"contract.finance-cn.{keyword}", v
    # ... and the default's, inherited through $ref (an unknown field is still refused).
    v = checker.check({**ok, "colour": "red"}, source="finance-cn", domain="finance-cn")
    assert not v.accepted and v.rule == "contract.finance-cn.additionalProperties"
    # The same payload passes the looser default contract: the source picks the contract.
    assert checker.check({**ok, "max_tokens": 2000}, source="default", domain="default").accepted


def test_unknown_source_uses_default_contract_and_unknown_domain_is_rejected(checker):
    v = checker.check({"prompt": "a", "colour": "red"}, source="nobody", domain="default")
    assert v.contract == "default" and v.rule == "contract.default.additionalProperties"
    v = checker.check({"prompt": "a"}, source="default", domain="astrology")
    assert (v.accepted, v.reason, v.rule) == (False, "UNKNOWN_DOMAIN", "domain")
    assert checker.check({"prompt": "a"}, source="default", domain="").domain == "default"


def test_error_of_accepted_verdict_is_a_bug(checker):
    with pytest.raises(ValueError):
        checker.check({"prompt": "a"}, source="default", domain="default").error()


def test_long_instance_is_clipped_in_message(checker):
    v = checker.check({"prompt": "a" * 40000}, source="default", domain="default")
    assert not v.accepted and v.rule == "contract.default.maxLength"
    assert len(v.message) <= 240


def test_schema_change_is_data_not_code(tmp_path):
    shutil.copytree(CONTRACTS, tmp_path / "c")
    path = tmp_path / "c" / "default.schema.json"
    schema = json.loads(path.read_text())
    schema["properties"]["max_tokens"]["maximum"] = 16
    schema["required"] = ["max_tokens"]
    path.write_text(json.dumps(schema))
    checker = InputChecker.from_config(tmp_path / "c", BARE)
    assert not checker.check({"prompt": "a"}, source="default", domain="default").accepted
    v = checker.check({"prompt": "a", "max_tokens": 17}, source="default", domain="default")
    assert v.rule == "contract.default.maximum"
    assert checker.check({"prompt": "a", "max_tokens": 16}, source="x", domain="default").accepted


@pytest.mark.parametrize("content, message", [
    ("{not json", "contract"),
    ('{"type": "strng"}', "invalid schema"),
])
def test_broken_contract_fails_at_startup(tmp_path, content, message):
    shutil.copy(CONTRACTS / "default.schema.json", tmp_path)
    (tmp_path / "broken.schema.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_contracts(tmp_path)


def test_missing_default_contract_fails_at_startup(tmp_path):
    shutil.copy(CONTRACTS / "finance-cn.schema.json", tmp_path)
    with pytest.raises(ValueError, match="default.schema.json"):
        load_contracts(tmp_path)
    with pytest.raises(ValueError, match="default"):
        InputChecker.from_config(CONTRACTS, {"finance-cn": DomainConfig("finance-cn")})


@pytest.mark.parametrize("text, accepted, rule", [
    ('{"prompt": "hi", "max_tokens": 8}', True, None),
    ('{"prompt": "hi", "temperature": NaN}', False, "contract.default.type"),
    ('{"prompt": "hi",', False, "contract.default.json"),
    ("[" * 100000, False, "contract.default.json"),
    ('"just a string"', False, "contract.default"),
])
def test_check_json_parses_then_checks(checker, text, accepted, rule):
    payload, verdict = checker.check_json(text, source="default", domain="default")
    assert verdict.accepted is accepted and verdict.rule == rule
    if rule == "contract.default.json":
        assert payload == {"$raw": text[:65536]} and verdict.reason == "CONTRACT_VIOLATION"
