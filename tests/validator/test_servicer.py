"""The validator servicer's domain -> protobuf conversion of an output result."""
from __future__ import annotations

from services.validator.pipeline import OutputResult
from services.validator.plugins import Verdict
from services.validator.servicer import to_result


def result(**kw) -> OutputResult:
    base = dict(text="t", blocked=False, verdicts=[], probes={}, low_confidence=False)
    return OutputResult(**{**base, **kw})


def test_one_verdict_per_check_failed_first_then_passed():
    r = to_result(result(blocked=True, verdicts=[Verdict("has an email", plugin="pii", blocking=True)],
                         passed_checks=(("length", True), ("tone", False))))
    assert not r.passed
    assert [(v.plugin, v.passed, v.message, v.blocking) for v in r.verdicts] == [
        ("pii", False, "has an email", True), ("length", True, "", True), ("tone", True, "", False)]


def test_all_passed():
    r = to_result(result(passed_checks=(("pii", True),)))
    assert r.passed and [(v.plugin, v.passed) for v in r.verdicts] == [("pii", True)]


def test_probes_travel_as_floats_booleans_as_0_or_1_and_low_confidence_is_kept():
    r = to_result(result(probes={"entropy_mean": 1.5, "disclaimer": True, "contradiction": False},
                         low_confidence=True))
    assert dict(r.probes) == {"entropy_mean": 1.5, "disclaimer": 1.0, "contradiction": 0.0}
    assert r.low_confidence
