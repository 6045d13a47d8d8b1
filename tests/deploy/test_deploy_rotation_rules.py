"""deploy/prometheus/rotation.yaml is the one source of the rotation rules: rules/rotation.yml is
exactly what the builder makes of it, and the builder refuses malformed data."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"

_spec = importlib.util.spec_from_file_location("keel_build_rotation_rules", PROM / "build_rotation_rules.py")
builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(builder)


def test_committed_rules_are_what_the_builder_makes():
    assert (PROM / "rules" / "rotation.yml").read_text() == builder.render(builder.load()), \
        "stale: run .venv/bin/python deploy/prometheus/build_rotation_rules.py"


def test_the_three_seed_rules_carry_their_actions_and_thresholds():
    alerts = {r["alert"]: r for r in yaml.safe_load(builder.render(builder.load()))["groups"][0]["rules"]
              if "alert" in r}
    switch = alerts["KeelRotationSwitchToFallback"]
    assert switch["labels"] == {"severity": "warning", "keel_action": "switch_variant", "variant": "fallback"}
    assert "> 1.5" in switch["expr"] and "< 0.7" in switch["expr"]
    assert switch["for"] == switch["keep_firing_for"] == "2h"
    retrain = alerts["KeelRotationRetrainAdapters"]
    assert retrain["labels"]["keel_action"] == "retrain_adapters" and retrain["for"] == "1h"
    assert "> 0.08" in retrain["expr"] and "< 0.8" in retrain["expr"]
    resample = alerts["KeelRotationResampleData"]
    assert resample["labels"]["keel_action"] == "resample_data"
    assert ">= 20" in resample["expr"] and "> 0.5" in resample["expr"]


def test_a_new_rule_is_data_only():
    data = builder.load()
    data["rules"].append({"alert": "KeelRotationTest", "action": "switch_variant", "labels": {"variant": "fallback"},
                          "summary": "s", "for": "2s", "conditions": [
                              {"name": "queue", "expr": "max(keel_inference_queue_depth)", "op": ">", "threshold": 3}]})
    rules = yaml.safe_load(builder.render(data))["groups"][0]["rules"]
    assert {"record": "keel:rotation_queue", "expr": "(max(keel_inference_queue_depth)) > -Inf"} in rules
    new = next(r for r in rules if r.get("alert") == "KeelRotationTest")
    assert new["expr"] == "last_over_time(keel:rotation_queue[15m]) > 3" and "keep_firing_for" not in new


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["rules"][0]["conditions"][0].update(op="=="), "op must be one of"),
    (lambda d: d["rules"][0].update(action="Switch Variant"), "action must match"),
    (lambda d: d["rules"].append(copy.deepcopy(d["rules"][0])), "duplicate alert names"),
    (lambda d: d["rules"][1]["conditions"][0].update(name="prefix_cache_hit_rate"), "two different expressions"),
])
def test_malformed_data_is_refused(mutate, message):
    data = builder.load()
    mutate(data)
    with pytest.raises(ValueError, match=message):
        builder.render(data)
