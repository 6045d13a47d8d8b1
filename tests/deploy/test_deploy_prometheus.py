"""deploy/prometheus: promtool checks the configs and rules and runs the rule unit tests.

promtool comes from the Debian package `prometheus`; without it these tests FAIL (never skip),
saying how to install it.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from keelctl.supervisor import worker_metrics_port
from tests.deploy.deploy_promql import catalogue_series, metric_names
from tests.deploy.k8s_objects import STAGES

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROM / "tests").glob("*.yml"))
METRICS_PORTS = {s: STAGES[s][1] for s in ("gateway", "tokenizer", "inference", "validator")}


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install the Debian package `prometheus` (apt-get install -y prometheus)"
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def test_there_are_rule_files_and_rule_tests():
    assert RULE_FILES and RULE_TESTS


def test_promtool_check_rules():
    done = promtool("check", "rules", *map(str, RULE_FILES))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-local.yml"])
def test_promtool_check_config(config):
    done = promtool("check", "config", str(PROM / config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rules found" in done.stdout  # the rule files were found and checked too


def test_promtool_test_rules():
    done = promtool("test", "rules", *(p.name for p in RULE_TESTS), cwd=PROM / "tests")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_promtool_catches_a_broken_rule_and_a_failing_rule_test(tmp_path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / "bad.yml").write_text(
        "groups:\n- name: x\n  rules:\n  - alert: Broken\n    expr: sum(rate(keel_requests_total[5m])\n")
    assert promtool("check", "rules", str(tmp_path / "rules" / "bad.yml")).returncode != 0
    # The real rules with an expectation they do not meet: the stage is serving, so no alert.
    (tmp_path / "rules" / "keel.yml").write_text(RULE_FILES[0].read_text())
    (tmp_path / "tests" / "t.yml").write_text(yaml.safe_dump({
        "rule_files": ["../rules/keel.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m",
                   "input_series": [{"series": 'keel_stage_serving{service="tokenizer"}', "values": "1x10"}],
                   "alert_rule_test": [{"eval_time": "5m", "alertname": "KeelStageNotServing",
                                        "exp_alerts": [{"exp_labels": {"service": "tokenizer"}}]}]}]}))
    done = promtool("test", "rules", "t.yml", cwd=tmp_path / "tests")
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_every_alert_has_a_unit_test():
    tested = {case["alertname"] for f in RULE_TESTS for t in yaml.safe_load(f.read_text())["tests"]
              for case in t.get("alert_rule_test", [])}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - tested == set()


def test_the_required_alerts_exist():
    exprs = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    assert "keel_request_duration_seconds" in " ".join(r["expr"] for r in rules())
    assert "> 0.08" in exprs["KeelEmptyResponseCollapse"] and "< 0.8" in exprs["KeelEmptyResponseCollapse"]
    assert "keel_retry_alerts_total" in exprs["KeelRetryAnomaly"]
    assert ">= 3" in exprs["KeelBreakerOpen"] and ">= 1" in exprs["KeelBreakerDegraded"]
    assert "keel_validator_spill_backlog" in exprs["KeelQuarantineSpillGrowing"]
    assert "keel_stage_serving" in exprs["KeelStageNotServing"]
    assert "keel_supervisor_restarts_total" in exprs["KeelSupervisorRestartLoop"]
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_rules_read_only_catalogue_metrics():
    allowed = catalogue_series() | {r["record"] for r in rules() if "record" in r} | {"up"}
    for r in rules():
        unknown = metric_names(r["expr"]) - allowed
        assert not unknown, f"{r.get('alert') or r.get('record')} reads unknown metrics {unknown}"


def targets(config: str) -> dict[str, list[str]]:
    cfg = yaml.safe_load((PROM / config).read_text())
    return {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in cfg["scrape_configs"]}


def test_compose_scrape_config_targets_every_stage_by_service_name():
    jobs = targets("prometheus.yml")
    for stage, port in METRICS_PORTS.items():
        assert jobs[f"keel-{stage}"] == [f"{stage}:{port}"]


def test_local_scrape_config_matches_the_dev_mesh_layout():
    layout = yaml.safe_load((ROOT / "config" / "keel.yaml").read_text())
    jobs = targets("prometheus-local.yml")
    for stage, sl in layout["stages"].items():
        expected = [f"127.0.0.1:{worker_metrics_port(p, w)}" for p in sl.get("metrics_ports", [])
                    for w in range(sl.get("workers", 1))]
        assert sorted(jobs.get(f"keel-{stage}", [])) == sorted(expected), stage  # no metrics ports: no job
    assert jobs["keel-supervisor"] == [f"127.0.0.1:{layout['metrics_port']}"]


def test_the_metric_name_extractor_flags_unknown_names():
    assert metric_names('sum by (service) (rate(keel_requestz_total{code!="OK"}[5m])) / 1e3') == {
        "keel_requestz_total"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(x_bucket[$__rate_interval])))") == {"x_bucket"}
    assert metric_names("a > on (service) group_left b or vector(0) offset 5m") == {"a", "b"}
