"""Scale-out under kill -9: two tokenizer and two inference replicas behind the gateway; one of each
is killed while clients keep sending. No request may be lost, every failed attempt must have a
logged retry decision, and the gateway must not send to a dead replica until it is back.

One mesh for the module. The traffic runs once, in the fixture, in three phases:

- burst: 40 requests from 4 clients; tokenizer-1.0 and inference-1.0 are killed -9 mid-run, and
  right after the tokenizer kill a request starts every 0.25 s for 3 s (the tokenizer replica is
  back within about a second, and its outage must see traffic for the test to mean anything);
- recovery: one request at a time until the gateway's health watch sees both SERVING again
  (the inference replica reloads the model: tens of seconds, so the balancer's re-admission
  probes would come due several times);
- after: a few requests, which must reach the restarted replicas again.

Each test checks one property of the answers and of the gateway's log and trace files. No
throttle override: the kills fail at most a few attempts at once, within the default bucket.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from keel.common.v1 import common_pb2
from keel.gateway.v1 import gateway_pb2
from keelctl.ask import DEV_API_KEY
from testing.mesh import start_mesh, stop_mesh, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]  # two model loads + a reload

REQUESTS, CLIENTS, MAX_TOKENS = 40, 4, 6
KILLS = {"tokenizer-1.0": 6, "inference-1.0": 10}  # process -> kill once this many requests are done
AFTER_RECOVERY = 6
TRICKLE_S, TRICKLE_EVERY_S = 3.0, 0.25  # extra requests right after the tokenizer kill (trickle())
RECOVERY_TIMEOUT_S = 240
PROMPTS = ("Name a colour.", "What is two plus two?", "Say hello.", "Name a fruit.", "Name an animal.")


def ask(stub, i: int):
    req = gateway_pb2.GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)],
                                      sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    try:
        return stub.Generate(req, metadata=(("x-api-key", DEV_API_KEY),), timeout=120)
    except grpc.RpcError as err:
        return err


def gateway_log(mesh) -> list[dict]:
    return mesh.log("gateway-0.0")


def attempts(mesh) -> list[dict]:
    """The gateway's client spans, one per attempt to an upstream ("call tokenizer/Encode", ...)."""
    out = []
    for f in (mesh.tmp / "traces").glob("gateway-*.jsonl"):
        out += [s for s in map(json.loads, f.read_text().splitlines()) if s["name"].startswith("call ")]
    return out


def key(attempt: dict) -> tuple[str, str, int]:
    """(trace, "call upstream/Method", attempt number) of a client span."""
    return attempt["trace_id"], attempt["name"], attempt["attributes"]["rpc.attempt"]


def decisions(mesh, traces: set[str]) -> dict[tuple[str, str, int], dict]:
    """The gateway's retry decision records for these traces, keyed like :func:`key`."""
    return {(r["trace_id"], f"call {r['upstream']}/{r['method']}", r["attempt"]): r for r in gateway_log(mesh)
            if r.get("event") == "retry_decision" and r["trace_id"] in traces}


def everything(run) -> list:
    return [*run["burst"].values(), *run["recovery"], *run["after"]]


def answered(run) -> set[str]:
    return {r.trace_id for r in everything(run) if isinstance(r, gateway_pb2.GenerateResponse)}


def endpoint_of(mesh, name: str) -> str:
    return f"127.0.0.1:{mesh.state()['processes'][name]['port']}"


def trickle(stub, first: int) -> list:
    """A request every TRICKLE_EVERY_S for TRICKLE_S: each starts with a tokenizer call at once, so the
    short outage of a killed tokenizer replica (its restart takes about a second) sees traffic."""
    n = int(TRICKLE_S / TRICKLE_EVERY_S)
    with ThreadPoolExecutor(n) as pool:
        futures = []
        for i in range(n):
            futures.append(pool.submit(ask, stub, first + i))
            time.sleep(TRICKLE_EVERY_S)
        return [f.result() for f in futures]


def burst(mesh, pids: dict[str, int], killed_at: dict[str, float]) -> dict[int, object]:
    results = {}
    with grpc.insecure_channel(mesh.gateway) as ch, ThreadPoolExecutor(CLIENTS) as pool, \
            ThreadPoolExecutor(1) as side:
        stub = mesh.stub(ch)
        futures = {pool.submit(ask, stub, i): i for i in range(REQUESTS)}
        extra = None
        for done, fut in enumerate(as_completed(futures), 1):
            results[futures[fut]] = fut.result()
            for name, after in KILLS.items():
                if done == after:
                    killed_at[name] = time.time()  # before the kill: the gateway may log it within the same ms
                    os.kill(pids[name], signal.SIGKILL)
                    if name.startswith("tokenizer"):
                        extra = side.submit(trickle, stub, REQUESTS)
        results.update(enumerate(extra.result(), REQUESTS))
    return results


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    mesh = start_mesh(tmp_path_factory.mktemp("scaleout"), tokenizer_replicas=2, inference_replicas=2,
                      tokenizer_workers=1)  # one process per replica: killing it takes the replica down
    try:
        pids = {name: mesh.state()["processes"][name]["pid"] for name in KILLS}
        killed_at: dict[str, float] = {}
        burst_results = burst(mesh, pids, killed_at)
        endpoints = {name: endpoint_of(mesh, name) for name in KILLS}

        def back_up():  # the gateway's health watch saw every killed replica SERVING again
            ups = {(r.get("endpoint"), r["ts"]) for r in gateway_log(mesh) if r["msg"] == "replica up"}
            return all(any(e == endpoints[n] and ts > killed_at[n] for e, ts in ups) for n in KILLS)
        recovery = []
        give_up = time.monotonic() + RECOVERY_TIMEOUT_S
        with grpc.insecure_channel(mesh.gateway) as ch:
            stub = mesh.stub(ch)
            while not back_up():
                assert time.monotonic() < give_up, "killed replicas not SERVING again in the gateway"
                recovery.append(ask(stub, len(recovery)))
                time.sleep(0.5)  # a trickle, not a load
            after = [ask(stub, i) for i in range(AFTER_RECOVERY)]
        wanted = {r.trace_id for r in [*burst_results.values(), *recovery, *after]
                  if isinstance(r, gateway_pb2.GenerateResponse)}
        wait_until(lambda: wanted <= {a["trace_id"] for a in attempts(mesh)}, 30, "gateway spans flushed")
        yield {"mesh": mesh, "burst": burst_results, "recovery": recovery, "after": after, "pids": pids,
               "killed_at": killed_at, "endpoints": endpoints}
    finally:
        stop_mesh(mesh)


def test_no_request_is_lost_while_replicas_are_killed(run):
    mesh = run["mesh"]
    assert set(run["killed_at"]) == set(KILLS)
    for name, pid in run["pids"].items():
        assert mesh.state()["processes"][name]["pid"] != pid, f"{name} was not restarted"
    # The kills really took the replicas out while traffic flowed (the gateway saw each one down;
    # how many requests fall in the outage depends on how fast the replica comes back).
    downs = {(r.get("endpoint"), r["ts"]) for r in gateway_log(mesh)
             if r["msg"] in ("replica not serving", "replica unreachable")}
    for name, endpoint in run["endpoints"].items():
        assert any(e == endpoint and ts > run["killed_at"][name] for e, ts in downs), f"{name} never seen down"
    lost = [f"{r.code().name} {r.details()}" for r in everything(run)
            if not isinstance(r, gateway_pb2.GenerateResponse)]
    assert not lost, f"{len(lost)}/{len(everything(run))} requests lost: {lost}"
    assert all(r.usage.completion_tokens > 0 and r.text for r in everything(run))


def test_every_failed_attempt_has_a_retry_decision(run):
    mesh, ours = run["mesh"], answered(run)
    failed = [a for a in attempts(mesh) if a["status"] == "ERROR" and a["trace_id"] in ours]
    # kill -9 of an inference replica with four clients running always catches a generation in flight
    assert any(a["attributes"]["upstream"] == "inference" for a in failed), "no inference attempt failed"
    logged = decisions(mesh, ours)
    for a in failed:
        assert key(a) in logged, f"failed attempt without a retry decision: {key(a)}"
        d = logged[key(a)]
        assert d["code"] == a["attributes"]["rpc.grpc.status"] == "UNAVAILABLE"
        assert d["decision"] == "retry"
        if d["reason"] == "replica_lost":
            # a call whose replica died is re-dispatched at once, once, without a retry token
            assert d["delay_source"] == "none" and d["tokens_after"] == d["tokens_before"]
        else:
            # otherwise: jittered backoff, or the hint of a replica still warming up
            assert d["delay_source"] == ("pushback" if d["retry_after_ms"] is not None else "exponential_jitter")
    assert len(logged) == len(failed), "retry decisions that match no failed attempt"


def test_a_retry_never_goes_back_to_the_replica_that_failed(run):
    ours = answered(run)
    by_key = {key(a): a for a in attempts(run["mesh"]) if a["trace_id"] in ours}
    failed = [k for k, a in by_key.items() if a["status"] == "ERROR"]
    assert failed
    for trace_id, name, n in failed:
        before, after = by_key[(trace_id, name, n)], by_key[(trace_id, name, n + 1)]
        assert after["attributes"]["server.address"] != before["attributes"]["server.address"]


@pytest.mark.parametrize("name", sorted(KILLS))
def test_no_attempt_goes_to_a_dead_replica_until_it_is_back(run, name):
    mesh, endpoint, killed = run["mesh"], run["endpoints"][name], run["killed_at"][name]
    log = gateway_log(mesh)
    noticed = min((r["ts"] for r in log if r["ts"] > killed and r.get("endpoint") == endpoint
                   and r["msg"] in ("replica unreachable", "replica not serving")), default=None)
    assert noticed is not None, f"the gateway never marked {endpoint} down"
    back = min(r["ts"] for r in log if r["ts"] > noticed and r.get("endpoint") == endpoint and r["msg"] == "replica up")
    during = [a for a in attempts(mesh) if noticed < a["start_ns"] / 1e9 < back]
    assert any(a["attributes"]["upstream"] == name.split("-")[0] for a in during), "no traffic while it was down"
    sent = [key(a) for a in during if a["attributes"].get("server.address") == endpoint]
    assert not sent, f"{len(sent)} attempts went to {endpoint} while its health said it was down: {sent}"


@pytest.mark.parametrize("stage", ["tokenizer", "inference"])
def test_restarted_replicas_get_traffic_again(run, stage):
    after = {r.trace_id for r in run["after"] if isinstance(r, gateway_pb2.GenerateResponse)}
    hit = {a["attributes"]["server.address"] for a in attempts(run["mesh"])
           if a["trace_id"] in after and a["attributes"]["upstream"] == stage and a["status"] != "ERROR"}
    assert hit == {f"127.0.0.1:{p}" for p in run["mesh"].ports[stage]}


def test_every_generation_attempt_names_its_route(run):
    """With two inference replicas the gateway's router picks each one (prefix_affinity, the default);
    every attempt's span says why. These prompts are shorter than one block: no prefix to match, so
    each pick is the least loaded (miss), or imbalanced under the burst."""
    generations = [a for a in attempts(run["mesh"]) if a["name"] == "call inference/Generate"]
    assert generations
    for a in generations:
        attrs = a["attributes"]
        assert attrs["keel.route.policy"] == "prefix_affinity", attrs
        assert attrs["keel.route.reason"] in ("miss", "imbalanced") and attrs["keel.route.matched_blocks"] == 0, attrs


def test_each_replica_counts_its_prefix_cache_lookups(run):
    """The per-replica counters the routing's hit rate is read from (the dashboard, bench_routing)."""
    totals = {"keel_inference_prefix_cache_prompt_tokens": 0.0, "keel_inference_prefix_cache_hit_tokens": 0.0}
    for port in run["mesh"].layout["stages"]["inference"]["metrics_ports"]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(body):
            if family.name in totals:
                totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    assert totals["keel_inference_prefix_cache_prompt_tokens"] > 0, totals
    assert 0 <= totals["keel_inference_prefix_cache_hit_tokens"] <= totals["keel_inference_prefix_cache_prompt_tokens"]
