"""Replay records survive the database going away: spilled to an fsync'd file, written exactly once."""
from __future__ import annotations

import threading
import time

import pytest

from services.feedback.records import dumps, stored_body
from services.feedback.store import open_store
from services.feedback.writer import RecordWriter
from testing.postgres import PgServer
from testing.records import record


@pytest.mark.slow
def test_killing_postgresql_mid_load_loses_and_duplicates_nothing(tmp_path):
    server = PgServer().init()
    server.start()
    counts = {"direct": 0, "spilled": 0, "replayed": 0}
    writer = RecordWriter(lambda: open_store(server.url, connect_timeout_s=1), tmp_path / "records.spill",
                          probe_interval_s=0.1, batch=50,
                          on_count=lambda path, n: counts.__setitem__(path, counts[path] + n))
    try:
        writer.start()
        total, sent = 600, []
        stop = threading.Event()

        def load() -> None:
            for i in range(total):
                body = stored_body(record(f"{i:032x}", created_ms=1_000 + i), store_prompts=True)
                writer.put([body])  # never raises while the database is down
                sent.append(body["trace_id"])
                time.sleep(0.002)
            stop.set()

        loader = threading.Thread(target=load)
        loader.start()
        while len(sent) < total // 4:
            time.sleep(0.01)
        server.kill()                      # SIGKILL mid-load
        while len(sent) < total // 2:
            time.sleep(0.01)
        server.start()                     # back: the spill drains while the load goes on
        loader.join()
        assert writer.wait_drained(60), f"{writer.backlog()} records still in the spill"
        rows = writer.store().list_records(0)
        ids = [r.trace_id for r in rows]
        assert len(ids) == len(set(ids)) == total
        assert set(ids) == set(sent)
        assert counts["spilled"] > 0 and counts["replayed"] == counts["spilled"]
        assert counts["direct"] + counts["spilled"] == total
    finally:
        writer.close()
        server.stop()


def test_a_database_down_at_start_gets_the_spilled_records_once_it_is_up(tmp_path):
    url = f"sqlite:///{tmp_path / 'db' / 'f.db'}"
    available = threading.Event()

    def connect():
        if not available.is_set():
            return open_store("postgresql+psycopg://nobody@127.0.0.1:1/none", connect_timeout_s=1)
        return open_store(url)

    writer = RecordWriter(connect, tmp_path / "records.spill", probe_interval_s=0.05)
    writer.start()
    try:
        assert writer.put([stored_body(record("a" * 32), True)]) == (0, 1)
        assert writer.backlog() == 1
        available.set()
        assert writer.wait_drained(30)
        assert [r.trace_id for r in writer.store().list_records(0)] == ["a" * 32]
        assert writer.put([stored_body(record("b" * 32), True)]) == (1, 0)
    finally:
        writer.close()


def test_a_spill_left_by_a_crash_is_replayed_by_the_next_process_without_duplicates(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    spill = tmp_path / "records.spill"
    store = open_store(url)
    first = [stored_body(record(f"{i:032x}"), True) for i in range(3)]
    store.put_records(first[:2])           # reached the database, but the cursor never moved (crash)
    spill.write_text("".join(dumps(b) + "\n" for b in first))
    writer = RecordWriter(lambda: open_store(url), spill, probe_interval_s=0.05)
    writer.start()
    try:
        assert writer.wait_drained(30)
        assert sorted(r.trace_id for r in writer.store().list_records(0)) == [b["trace_id"] for b in first]
    finally:
        writer.close()
