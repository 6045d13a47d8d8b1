"""deploy/grafana: the dashboard reads only catalogue metrics, parses as PromQL, and is provisioned."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import yaml

from shared.metrics import CATALOGUE
from tests.deploy.deploy_promql import catalogue_series, metric_names

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "keel.json"

_spec = importlib.util.spec_from_file_location("keel_build_dashboard", GRAFANA / "build_dashboard.py")
builder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(builder)


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_committed_json_is_what_the_builder_makes():
    assert DASHBOARD.read_text() == builder.render(), "stale: run .venv/bin/python deploy/grafana/build_dashboard.py"


def test_every_panel_expr_reads_only_metrics_from_shared_metrics():
    known = catalogue_series()
    for p in panels():
        for t in p["targets"]:
            names = metric_names(t["expr"])
            assert names, f"{p['title']}: no metric in {t['expr']}"
            assert names <= known, f"{p['title']}: unknown metrics {names - known}"


def test_every_catalogue_metric_is_on_the_dashboard():
    used = set().union(*(metric_names(e) for e in exprs()))
    missing = {spec.name for spec in CATALOGUE if not set(spec.sample_names()) & used}
    assert missing == set()


def test_every_expr_is_valid_promql(tmp_path):
    exe = shutil.which("promtool")
    assert exe, "promtool not found: install the Debian package `prometheus` (apt-get install -y prometheus)"
    # promtool parses recording rules: one rule per panel query, with Grafana's interval made concrete.
    rules = [{"record": f"panel:query:{i}", "expr": e.replace("$__rate_interval", "1m")} for i, e in enumerate(exprs())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_row_per_stage_plus_the_overview():
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert rows[0] == "Pipeline overview"
    assert {"Gateway", "Tokenizer", "Inference", "Validator"} <= set(rows)


def test_panels_have_unique_ids_and_do_not_overlap():
    all_panels = dashboard()["panels"]
    assert len({p["id"] for p in all_panels}) == len(all_panels)
    cells = set()
    for p in all_panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))


def test_panels_use_the_provisioned_datasource():
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [d["uid"] for d in ds] == [builder.DATASOURCE["uid"]]
    assert ds[0]["url"] == "http://prometheus:9090"  # the compose service name and port
    for p in panels():
        assert p["datasource"] == builder.DATASOURCE
        assert all(t["datasource"] == builder.DATASOURCE for t in p["targets"])


def test_dashboard_provider_reads_the_path_compose_mounts():
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "keel.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    grafana = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in grafana["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


def test_a_panel_with_an_unknown_metric_would_be_caught():
    bad = 'sum(rate(keel_inference_tokens_total[$__rate_interval]))'  # the real name is ..._generated_tokens_total
    assert metric_names(bad) - catalogue_series() == {"keel_inference_tokens_total"}
