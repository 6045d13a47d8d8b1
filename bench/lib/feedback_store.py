"""bench_feedback.py's section 3 (`--sections store`): the feedback database write alone,
in-process, the store's upsert against the same batch through SQLAlchemy's pool and Core, on
SQLite and on a real PostgreSQL."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from testing.postgres import PgServer


class CoreUpsert:
    """The peer: the same batch through SQLAlchemy's pool and Core, as the store wrote it before it
    had a connection of its own (services/feedback/upsert.py): statements built once, then per batch
    a pre-ping, BEGIN, the two lookups, the insert of the known items, COMMIT."""

    def __init__(self, store):
        import sqlalchemy as sa

        from services.feedback import db, upsert
        f, r = db.feedback.c, db.replay_records.c
        self.store = store
        self.traces = sa.select(r.trace_id).where(r.trace_id.in_(sa.bindparam("ids", expanding=True)))
        self.ids = sa.select(f.feedback_id).where(f.feedback_id.in_(sa.bindparam("ids", expanding=True)))
        # The store's SQLite upsert with named parameters (the same text on both databases).
        self.insert = sa.text(upsert.SQLITE_UPSERT.replace(
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", "VALUES (:feedback_id, :trace_id, :error_type, :severity,"
            " :expected_keywords, :comment, :created_ms, :updated_ms)"))

    def __call__(self, items) -> None:
        with self.store.engine.begin() as conn:
            known = set(conn.execute(self.traces, {"ids": sorted({i.trace_id for i in items})}).scalars())
            conn.execute(self.ids, {"ids": sorted({i.feedback_id for i in items})}).all()
            rows = {i.feedback_id: {"feedback_id": i.feedback_id, "trace_id": i.trace_id, "error_type": i.error_type,
                                    "severity": i.severity, "comment": i.comment, "created_ms": 1, "updated_ms": 1,
                                    "expected_keywords": json.dumps(list(i.expected_keywords))}
                    for i in items if i.trace_id in known}
            conn.execute(self.insert, list(rows.values()))


def server_cpu_ms() -> float:
    """CPU time (user + system, ms) of every process of the `postgres` user (Linux /proc)."""
    import pwd
    uid, total = pwd.getpwnam("postgres").pw_uid, 0.0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


async def store_rows(backend: str, url: str, items_total: int) -> list[str]:
    """Per batch: wall ms, the stage's CPU ms and the database server's CPU ms, for the store's own
    upsert and for the Core peer, alternating blocks, batches of 1, 2 and 16."""
    from services.feedback.records import Feedback, stored_body
    from services.feedback.store import open_store
    from testing.records import record
    store = open_store(url)
    store.put_records([stored_body(record("a" * 32), True)])
    await store.open_writes()
    peer = CoreUpsert(store)

    async def core(items):  # blocks the loop: nothing else runs on it here
        peer(items)
    paths = {"store (own connection)": store.upsert_feedback, "peer: SQLAlchemy Core": core}
    rows = []
    for size in (1, 2, 16):
        n = max(1, items_total // size)
        got = {name: [0.0, 0.0, 0.0] for name in paths}
        for rnd in range(4):  # alternating blocks; the first round warms up and is not counted
            for name, write in paths.items():
                batches = [[Feedback("a" * 32, f"{name[:4]}{size}-{rnd}-{i}-{j}", "fact_error", "severe", ("Paris",),
                                     "bench") for j in range(size)] for i in range(n // 3)]
                t0, c0, s0 = time.perf_counter(), time.process_time(), server_cpu_ms()  # 0 on SQLite
                for items in batches:
                    await write(items)
                if rnd:
                    got[name][0] += (time.perf_counter() - t0) * 1e3
                    got[name][1] += (time.process_time() - c0) * 1e3
                    got[name][2] += server_cpu_ms() - s0
        per = {name: [v / (3 * (n // 3)) for v in vals] for name, vals in got.items()}
        own = per["store (own connection)"]
        for name, (wall, cpu, server) in per.items():
            rows.append(f"| {backend} | {size} | {name} | {wall:.3f} | {cpu:.3f} | "
                        f"{server:.3f} | {(cpu + server) / (own[1] + own[2]):.2f}x |")
    await store.close_writes()
    store.close()
    return rows


def store_section(args) -> str:
    """The database write alone, in-process: the store's upsert against the SQLAlchemy Core peer,
    on SQLite and on a real PostgreSQL (Debian's server, started here)."""
    out = ["| database | items per batch | path | wall ms/batch | stage CPU ms/batch | database server CPU ms/batch "
           "| CPU vs the store's |", "|---|---|---|---|---|---|---|"]
    sqlite_file = Path(tempfile.mkdtemp(prefix="keel-bench-store-")) / "feedback.db"
    out += asyncio.run(store_rows("sqlite", f"sqlite:///{sqlite_file}", args.submits))
    pg = PgServer().init()
    pg.start()
    try:
        out += asyncio.run(store_rows("postgresql", pg.url, args.submits))
    finally:
        pg.stop()
    return "\n".join(out)
