"""`keel etl run` over N feedback items with their replay records, against reading the same rows.

Run: .venv/bin/python -m bench.bench_etl [--records 100000] [--duplicates 0.1]

Fills an embedded SQLite database (the default backend) with N replay records (prompts of ~40
tokens, answers of ~32) and one severe fact_error feedback item on each; a share of them repeat an
earlier prompt, so deduplication has work. Then, same run: the peer reads the joined rows the ETL
selects (one query, JSON decoded), and the ETL runs whole (select, dedup, split, shuffle, write
JSONL + npz + manifest). The setup writes rows in bulk (it is not what is measured).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.machine import machine_line
from services.feedback import db
from services.feedback.config import EtlConfig
from services.feedback.etl import run
from services.feedback.records import stored_body
from services.feedback.store import open_store
from testing.records import record

ROOT = Path(__file__).resolve().parent.parent


def fill(store, n: int, duplicates: float) -> None:
    rng = random.Random(1)
    batch = 5000
    for start in range(0, n, batch):
        bodies, items = [], []
        for i in range(start, min(n, start + batch)):
            source = rng.randrange(max(1, i)) if i and rng.random() < duplicates else i
            prompt = [source % 49152, source // 49152] + [(source * 7 + k) % 49152 for k in range(38)]
            bodies.append(stored_body(record(f"{i:032x}", created_ms=1_000_000 + i, prompt=prompt,
                                             output=[rng.randrange(49152) for _ in range(32)],
                                             content=f"question {source}"), True))
            items.append({"feedback_id": f"fb-{i}", "trace_id": f"{i:032x}", "error_type": "fact_error",
                          "severity": "severe", "expected_keywords": json.dumps([f"kw{source}"]),
                          "comment": "wrong", "created_ms": 1_000_000 + i, "updated_ms": 1_000_000 + i})
        store.put_records(bodies)
        with store.engine.begin() as conn:
            conn.execute(db.feedback.insert(), items)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--duplicates", type=float, default=0.1)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="keel-bench-etl-"))
    store = open_store(f"sqlite:///{tmp / 'feedback.db'}")
    t0 = time.perf_counter()
    fill(store, args.records, args.duplicates)
    print(f"setup: {args.records} records + feedback in {time.perf_counter() - t0:.1f} s", flush=True)
    cfg = EtlConfig(val_percent=10, seed=1)
    t0 = time.perf_counter()
    rows = sum(1 for _ in store.feedback_with_records(0, cfg.severities, cfg.error_types))
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = run(store, tmp / "out", 0, cfg)
    etl_s = time.perf_counter() - t0
    print(f"peer (read the {rows} joined rows): {read_s:.2f} s; etl run: {etl_s:.2f} s; ratio {etl_s / read_s:.2f}x")
    print(f"manifest counts: {manifest['counts']}")
    print(machine_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
