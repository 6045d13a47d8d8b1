"""Every catalogued metric is exported by the stage that owns it, scraped from the running mesh."""
from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import specs_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def scrape(port: int) -> dict[str, list]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(body)}


def base_name(spec_name: str, kind: str) -> str:
    # the parser reports counters without their _total suffix
    return spec_name[: -len("_total")] if kind == "counter" and spec_name.endswith("_total") else spec_name


@pytest.mark.parametrize("stage", ["gateway", "tokenizer", "inference", "validator", "feedback", "supervisor"])
def test_every_catalogued_metric_is_scraped(mesh, api_md, gateway_request, stage):
    with grpc.insecure_channel(mesh.gateway) as ch:  # traffic, so labelled series exist
        mesh.stub(ch).Generate(gateway_request("Say yes.", max_tokens=4), metadata=api_md, timeout=120)
    port = (mesh.layout["metrics_port"] if stage == "supervisor"
            else mesh.layout["stages"][stage]["metrics_ports"][0])
    families = scrape(port)
    missing = [s.name for s in specs_for(stage) if base_name(s.name, s.kind) not in families]
    assert not missing, f"{stage} does not export {missing}"


def test_request_counters_count_real_traffic(mesh, api_md, gateway_request):
    port = mesh.layout["stages"]["gateway"]["metrics_ports"][0]

    def ok_generates() -> float:
        samples = scrape(port).get("keel_requests", [])
        return sum(s.value for s in samples if s.name == "keel_requests_total"
                   and s.labels.get("method") == "Generate" and s.labels.get("code") == "OK")
    before = ok_generates()
    with grpc.insecure_channel(mesh.gateway) as ch:
        for _ in range(2):
            mesh.stub(ch).Generate(gateway_request("Say no.", max_tokens=2), metadata=api_md, timeout=120)
    assert ok_generates() == before + 2
