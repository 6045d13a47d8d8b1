"""Validator benchmark: per-request latency in-process, and quarantine throughput into Redis.

Run: .venv/bin/python -m bench.bench_validator [--requests 3000] [--records 5000] [--repeat 3]
                                               [--write docs/bench/validator.md]

Peers, measured in the same run on the same inputs:
  * contracts: stock ``jsonschema`` (Draft202012Validator.iter_errors on the same finance-cn
    contract, references resolved the same way) against Keel's whole input check (contract +
    semantic rules + injection patterns).
  * quarantine: a bare redis-py loop of ``XADD(record.to_fields())`` over the same records, the
    upper bound for one un-pipelined writer, against ``Quarantine.put`` (dedup script + marker
    key in one EVALSHA). Also the spill
    path (Redis down: one fsync per record) and the replay rate of a spilled backlog.
A redis-server of its own is started on a free loopback port (in-memory, no persistence).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import redis
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from services.validator.contracts import InputChecker
from services.validator.output_pipeline import OutputPipeline, PipelineConfig
from services.validator.plugins import OutputContext
from services.validator.quarantine import Quarantine, QuarantineConfig
from services.validator.records import QuarantineRecord

ROOT = Path(__file__).resolve().parents[1]

PAYLOAD = {"messages": [{"role": "system", "content": "你是一名谨慎的金融分析师。"},
                        {"role": "user", "content": "请分析本月LPR和MLF利率走势，以及对房贷利率的影响。"}],
           "max_tokens": 256, "temperature": 0.7, "top_p": 0.9, "seed": 7, "domain": "finance-cn",
           "source": "finance-cn"}
ANSWER = ("本月一年期LPR为3.45%，五年期以上LPR为3.95%，均与上月持平。中国人民银行开展MLF操作，"
          "中标利率维持不变，显示政策利率保持稳定。从流动性看，公开市场操作以逆回购为主，"
          "市场资金面总体平稳。对房贷利率而言，五年期以上LPR未变，存量房贷利率短期内不会调整，"
          "新发放房贷利率仍取决于各地政策下限与银行定价。后续若通胀回落、信贷需求偏弱，"
          "不排除进一步降息或降准的可能。以上内容仅供参考，不构成投资建议。") * 2
ENTROPIES = [0.4 + 0.01 * (i % 50) for i in range(256)]


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return p(0.50), p(0.99)


def timed(fn, n: int) -> list[float]:
    for _ in range(min(200, n)):   # warm caches (regex, jsonschema, lru) before measuring
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_latency(n: int) -> dict:
    cfg = PipelineConfig.load(ROOT / "config" / "validator" / "pipeline.yaml")
    checker = InputChecker.from_config(ROOT / "config" / "contracts", cfg.domains)
    pipe = OutputPipeline.from_config(cfg, review=lambda r: r.record_id)
    ctx = OutputContext(domain="finance-cn", trace_id="t", token_entropies=ENTROPIES,
                        prompt=PAYLOAD["messages"][-1]["content"], source="finance-cn")
    assert checker.check(PAYLOAD, source="finance-cn", domain="finance-cn").accepted
    result = pipe.run(ANSWER, ctx)
    assert not result.blocked and not result.verdicts, result.verdicts

    schemas = [json.loads((ROOT / "config" / "contracts" / f).read_text())
               for f in ("default.schema.json", "finance-cn.schema.json")]
    registry = Registry().with_resources(
        [(s["$id"], Resource.from_contents(s, default_specification=DRAFT202012)) for s in schemas])
    stock = jsonschema.Draft202012Validator(schemas[1], registry=registry)
    assert not list(stock.iter_errors(PAYLOAD))

    runs = {
        "jsonschema alone (peer)": timed(lambda: list(stock.iter_errors(PAYLOAD)), n),
        "keel input check": timed(lambda: checker.check(PAYLOAD, source="finance-cn",
                                                        domain="finance-cn"), n),
        "keel output pipeline": timed(lambda: pipe.run(ANSWER, ctx), n),
        "keel input + output": timed(lambda: (checker.check(PAYLOAD, source="finance-cn",
                                                            domain="finance-cn"),
                                              pipe.run(ANSWER, ctx)), n),
    }
    return {name: percentiles(s) for name, s in runs.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_quarantine(n: int, workdir: Path) -> dict:
    port = _free_port()
    server = subprocess.Popen([shutil.which("redis-server") or "/usr/bin/redis-server",
                               "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        records = [QuarantineRecord(kind="input", reason="PROMPT_INJECTION", rule="default.tpl",
                                    trace_id=f"{i:032x}", source="web", domain="default",
                                    payload={**PAYLOAD, "n": i}) for i in range(n)]
        t0 = time.perf_counter()
        for r in records:   # the same serialisation Quarantine.put does, then a plain XADD
            client.xadd("bench:bare", r.to_fields())
        bare = n / (time.perf_counter() - t0)

        q = Quarantine(QuarantineConfig(redis_url=url, spill_path=workdir / "a" / "q.spill",
                                        socket_timeout_s=1.0))
        q.start()
        t0 = time.perf_counter()
        for r in records:
            q.put(r)
        direct = n / (time.perf_counter() - t0)
        q.close()
        assert client.xlen("keel:quarantine") == n

        # Spill path: Redis unreachable, every put is an fsync'd append. Then replay.
        client.flushall()
        spill_n = min(n, 2000)
        dead = Quarantine(QuarantineConfig(redis_url="redis://127.0.0.1:1/0",
                                           spill_path=workdir / "b" / "q.spill"))
        dead.start()
        t0 = time.perf_counter()
        for r in records[:spill_n]:
            dead.put(r)
        spill = spill_n / (time.perf_counter() - t0)
        dead.close()
        back = Quarantine(QuarantineConfig(redis_url=url, spill_path=workdir / "b" / "q.spill",
                                           probe_interval_s=0.01, socket_timeout_s=1.0))
        t0 = time.perf_counter()
        back.start()
        assert back.wait_drained(120)
        replay = spill_n / (time.perf_counter() - t0)
        back.close()
        assert client.xlen("keel:quarantine") == spill_n
        return {"bare redis-py XADD loop (peer)": bare, "keel Quarantine.put (Redis up)": direct,
                "keel Quarantine.put (Redis down, spill+fsync)": spill,
                "keel spill replay into Redis": replay}
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines()
                    if ln.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def _med(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(lats: list[dict], thrs: list[dict], args) -> str:
    """Median over the repeats, with the [min-max] spread (a shared machine is noisy)."""
    def spread(values, fmt):
        return f"{fmt.format(_med(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"

    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True,
                                   text=True).stdout.split()[2]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"Command: `.venv/bin/python -m bench.bench_validator --requests {args.requests} "
             f"--records {args.records} --repeat {args.repeat}`",
             f"Machine: {cpu_model()}, {len(os.sched_getaffinity(0))} cores, "
             f"Python {platform.python_version()}, redis-server {redis_version}; "
             f"load average at the end {load} (machine shared with other work)",
             f"Figures: median of {args.repeat} repeats, [min-max] across repeats.",
             "", f"Latency per request, in-process, {args.requests} requests per repeat "
             "(finance-cn: contract, 4 injection patterns, length + CJK rules; 2 processors, "
             "6 validators, all probes on a 2-paragraph answer with 256 token entropies):", "",
             "| stage | p50 ms | p99 ms | p50 vs jsonschema alone |", "|---|---|---|---|"]
    peer = "jsonschema alone (peer)"
    for name in lats[0]:
        p50s = [run[name][0] for run in lats]
        p99s = [run[name][1] for run in lats]
        ratio = [run[name][0] / run[peer][0] for run in lats]
        lines.append(f"| {name} | {spread(p50s, '{:.3f}')} | {spread(p99s, '{:.3f}')} | "
                     f"{_med(ratio):.2f}x |")
    lines += ["", f"Quarantine throughput, one writer, {args.records} records per repeat "
              "(spill/replay: up to 2000):", "",
              "| writer | records/s | vs bare XADD |", "|---|---|---|"]
    bare = "bare redis-py XADD loop (peer)"
    for name in thrs[0]:
        rates = [run[name] for run in thrs]
        ratio = [run[name] / run[bare] for run in thrs]
        lines.append(f"| {name} | {spread(rates, '{:,.0f}')} | {_med(ratio):.2f}x |")
    total = _med([run["keel input + output"][0] for run in lats])
    lines += ["", f"Target \"validator adds <= 2 ms p50\": {total:.3f} ms p50 for input + output "
              f"-> {'met' if total <= 2.0 else 'NOT met'} "
              "(in-process; the gRPC hop is not included).",
              "The peer XADD loop serialises the same records (`to_fields()`), so the put ratio is "
              "the cost of the dedup script and marker key. The spill rate is one fsync per record "
              "and depends on the disk; replay is pipelined in batches of 200."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--records", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--write", type=Path, help="also write the markdown table to this file")
    args = ap.parse_args()
    lats, thrs = [], []
    for _ in range(args.repeat):
        lats.append(bench_latency(args.requests))
        with tempfile.TemporaryDirectory() as tmp:
            thrs.append(bench_quarantine(args.records, Path(tmp)))
    text = report(lats, thrs, args)
    print(text)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text("# Validator benchmark\n\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
