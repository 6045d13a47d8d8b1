"""A short chaos run (bench/chaos.py is the long one): one replica per stage, requests from
concurrent keel-client clients while the gateway, tokenizer and validator processes are killed -9
(stages that restart in seconds; the inference stage's restart, a model load, is what the benchmark
measures and tests/gateway/test_replica_loss.py checks with a real process). Every request ends OK
or with a clear status (a code other than INTERNAL/UNKNOWN, an ErrorInfo reason; a retry hint
unless its own deadline ran out), none hangs, and most succeed: a request caught by a kill of a
stage behind the gateway is re-dispatched or held for the restarted replica, one lost with the
gateway is sent again by keel-client."""
from __future__ import annotations

import pytest

from bench.chaos import ChaosConfig, run_phase, summary
from testing.mesh import start_mesh, stop_mesh

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(600)  # a held request may wait out a slow restart on a loaded machine
def test_requests_survive_stage_kills(tmp_path):
    # seed 3 picks the gateway, the tokenizer, then the validator
    cfg = ChaosConfig(requests=48, clients=8, kill_every_s=1.0, max_tokens=4, deadline_s=120.0, replicas=1,
                      max_kills=3, stages=("gateway", "tokenizer", "validator"), seed=3)
    mesh = start_mesh(tmp_path, tokenizer_workers=1)
    try:
        outcomes, killer, _ = run_phase(mesh, cfg, chaos=True)
    finally:
        stop_mesh(mesh)
    result = summary(outcomes)
    # kills land while requests are in flight (how many fit depends on how fast the requests go)
    assert 1 <= len(killer.kills) <= 3, (killer.kills, killer.skips)
    assert killer.kills[0]["process"] == "gateway-0.0", killer.kills  # its first turn: the gateway is SERVING
    assert result["hung"] == 0 and result["unclear"] == 0 and result["unhinted"] == 0, result["by_status"]
    assert result["ok"] > cfg.requests // 2, result["by_status"]
