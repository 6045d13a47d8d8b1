"""The feedback database on SQLite and on a real PostgreSQL: migrations, records, feedback upserts."""
from __future__ import annotations

import asyncio
import time

import pytest
import sqlalchemy as sa

from services.feedback import db
from services.feedback.records import Feedback, ReplayRecord, ids_sha256, stored_body
from services.feedback.store import open_store
from shared import errors
from testing.postgres import PgServer
from testing.records import record
from tests.feedback.records import upsert


def fb(trace_id="a" * 32, feedback_id="fb-1", **kw) -> Feedback:
    values = {"error_type": "fact_error", "severity": "severe", "expected_keywords": ("Paris",), "comment": "wrong"}
    values.update(kw)
    return Feedback(trace_id=trace_id, feedback_id=feedback_id, **values)


def test_migrations_create_the_schema_and_rerun_as_a_no_op(db_url):
    store = open_store(db_url)
    open_store(db_url)  # a second start finds the database at head
    with store.engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        version = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one()
    assert {"replay_records", "feedback", "rotation_decisions", "rotation_retrain_requests",
            "alembic_version"} <= tables
    assert version == "0002"
    if store.engine.dialect.name == "sqlite":
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_record_is_stored_once_per_trace_id(db_url):
    store = open_store(db_url)
    body = stored_body(record("a" * 32), store_prompts=True)
    assert store.put_records([body]) == 1
    assert store.put_records([body, stored_body(record("b" * 32), True)]) == 1
    got = store.get_record("a" * 32)
    assert got.prompt_ids == (1, 2, 3) and got.output_sha256 == ids_sha256([7, 8, 9])
    assert got.sampling.seed == 42 and got == ReplayRecord.from_body(body)
    assert [r.trace_id for r in store.list_records(0)] == ["a" * 32, "b" * 32]


def test_store_prompts_false_keeps_hashes_only(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32), store_prompts=False)])
    got = store.get_record("a" * 32)
    assert got.prompt_ids is None and got.messages is None and got.output_ids is None
    assert got.prompt_sha256 == ids_sha256([1, 2, 3]) and len(got.raw_text_sha256) == 64
    assert not got.prompt_stored


def test_feedback_upsert_is_idempotent_per_feedback_id(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32), True)])
    assert upsert(store, [fb()]) == [True]
    assert upsert(store, [fb(severity="minor", comment="on second thought")]) == [False]
    rows = store.list_feedback()
    assert len(rows) == 1
    assert rows[0]["severity"] == "minor" and rows[0]["comment"] == "on second thought"
    assert rows[0]["expected_keywords"] == ["Paris"]
    assert store.list_feedback(severities=["severe"]) == []


def test_text_fields_round_trip_exactly_whatever_their_characters(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32), True)])
    odd = 'say "no", {not} [an] array\\n\tline\u2028 é 中文 🙂 \\u0041 NULL \'q\''
    assert upsert(store, [fb(feedback_id=odd, comment=odd, expected_keywords=(odd, "", "a,b"))]) == [True]
    [row] = store.list_feedback()
    assert (row["feedback_id"], row["comment"], row["expected_keywords"]) == (odd, odd, [odd, "", "a,b"])


def test_feedback_on_an_unknown_trace_is_not_found(db_url):
    store = open_store(db_url)
    [result] = upsert(store, [fb(trace_id="c" * 32)])
    assert isinstance(result, errors.NotFound) and result.reason == "TRACE_NOT_FOUND"
    assert store.list_feedback() == []


def test_a_batch_is_answered_per_item_as_if_sent_one_after_the_other(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32), True), stored_body(record("b" * 32), True)])
    assert upsert(store, [fb(feedback_id="old")]) == [True]
    results = upsert(store, [fb(feedback_id="new"), fb(trace_id="c" * 32, feedback_id="lost"),
                                     fb(feedback_id="old", comment="edited"),
                                     fb(trace_id="b" * 32, feedback_id="new", severity="minor")])
    assert results[0] is True and results[2] is False and results[3] is False
    assert isinstance(results[1], errors.NotFound)
    rows = {r["feedback_id"]: r for r in store.list_feedback()}
    assert sorted(rows) == ["new", "old"]
    assert (rows["new"]["trace_id"], rows["new"]["severity"]) == ("b" * 32, "minor")
    assert rows["old"]["comment"] == "edited"


def test_an_id_sent_again_on_an_unknown_trace_keeps_its_earlier_item_of_the_batch(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32), True)])
    results = upsert(store, [fb(feedback_id="x", comment="kept"), fb(trace_id="c" * 32, feedback_id="x")])
    assert results[0] is True and isinstance(results[1], errors.NotFound)
    [row] = store.list_feedback()
    assert (row["feedback_id"], row["trace_id"], row["comment"]) == ("x", "a" * 32, "kept")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_feedback_write_after_postgresql_restarted_reconnects(tmp_path):
    server = PgServer().init()
    server.start()
    try:
        store = open_store(server.url, connect_timeout_s=1)
        store.put_records([stored_body(record("a" * 32), True)])
        await store.open_writes()
        assert await store.upsert_feedback([fb(feedback_id="before")]) == [True]
        server.kill()
        with pytest.raises(errors.NotReady) as exc:  # the held connection is gone, and so is the server
            await store.upsert_feedback([fb(feedback_id="down")])
        assert exc.value.reason == "DATABASE_UNAVAILABLE" and exc.value.retry_after_ms > 0
        server.start()
        assert await store.upsert_feedback([fb(feedback_id="after")]) == [True]
        assert {r["feedback_id"] for r in store.list_feedback()} == {"before", "after"}
        await store.close_writes()
        store.close()
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_a_sqlite_write_that_waits_for_the_lock_waits_off_the_event_loop(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    store = open_store(url)
    store.put_records([stored_body(record("a" * 32), True)])
    assert await store.upsert_feedback([fb(feedback_id="now")]) == [True]
    holder = db.make_engine(url).connect()
    holder.exec_driver_sql("BEGIN IMMEDIATE")                 # another writer holds the lock
    try:
        write = asyncio.create_task(store.upsert_feedback([fb(feedback_id="later")]))
        t0 = time.monotonic()
        await asyncio.sleep(0.3)
        assert time.monotonic() - t0 < 1.0                    # the loop ran on: not stuck in a 2 s busy wait
        assert not write.done()
    finally:
        holder.rollback()
        holder.close()
    assert await write == [True]
    assert {r["feedback_id"] for r in store.list_feedback()} == {"now", "later"}


@pytest.mark.asyncio
async def test_feedback_writes_never_checkpoint_sqlite_and_the_stage_does_it_apart(tmp_path):
    path = tmp_path / "f.db"
    store = open_store(f"sqlite:///{path}")
    store.put_records([stored_body(record("a" * 32), True)])
    store.checkpoint()
    before = path.stat().st_size
    for i in range(400):  # > 1000 pages of log: SQLite's own rule would have checkpointed by now
        assert await store.upsert_feedback([fb(feedback_id=f"x{i}")]) == [True]
    assert (tmp_path / "f.db-wal").stat().st_size > 1000 * 4096
    assert path.stat().st_size == before       # all of it still in the log: no write checkpointed
    store.checkpoint()
    assert path.stat().st_size > before


@pytest.mark.parametrize("field,kw", [("error_type", {"error_type": "typo"}), ("severity", {"severity": "fatal"}),
                                      ("feedback_id", {"feedback_id": " "}), ("trace_id", {"trace_id": ""}),
                                      ("comment", {"comment": "a\x00b"}), ("feedback_id", {"feedback_id": "x\x00"}),
                                      ("expected_keywords", {"expected_keywords": ("ok", "\x00")})])
def test_a_bad_field_is_invalid_input_naming_it(field, kw):
    with pytest.raises(errors.InvalidInput) as exc:
        fb(**kw).check()
    assert exc.value.reason == "INVALID_FEEDBACK_FIELD" and exc.value.metadata["field"] == field


def test_retention_purges_only_old_records(db_url):
    store = open_store(db_url)
    store.put_records([stored_body(record("a" * 32, created_ms=1000), True),
                       stored_body(record("b" * 32, created_ms=5000), True)])
    assert store.purge_records(older_than_ms=2000) == 1
    assert [r.trace_id for r in store.list_records(0)] == ["b" * 32]


def test_a_locked_sqlite_file_is_database_unavailable(tmp_path):
    url = f"sqlite:///{tmp_path / 'f.db'}"
    store = open_store(url, connect_timeout_s=1)
    holder = db.make_engine(url).connect()
    holder.exec_driver_sql("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(errors.NotReady) as exc:
            store.put_records([stored_body(record("a" * 32), True)])
        assert exc.value.reason == "DATABASE_UNAVAILABLE" and exc.value.retry_after_ms > 0
    finally:
        holder.rollback()
        holder.close()


def _scans(url: str) -> dict[str, tuple[int, int]]:
    """(sequential scans, index scans) so far per table, from PostgreSQL's statistics."""
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT relname, seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables"
                                    " WHERE relname IN ('feedback', 'replay_records')")).all()
    engine.dispose()
    return {name: (seq, idx) for name, seq, idx in rows}


@pytest.mark.asyncio
async def test_postgresql_writes_look_rows_up_by_key_however_the_tables_grew(pg_url):
    """The write's plan is made once per connection, here while the tables are all but empty; after
    they grow it still finds rows through the primary keys, never by reading a table whole."""
    store = open_store(pg_url)
    store.put_records([stored_body(record("a" * 32), True)])
    await store.open_writes()
    assert await store.upsert_feedback([fb(feedback_id="first")]) == [True]
    store.put_records([stored_body(record(f"{i:032x}"), True) for i in range(2000)])
    with store.engine.begin() as conn:  # grown without ANALYZE: nothing tells the cached plan
        conn.execute(db.feedback.insert(), [
            {"feedback_id": f"grown-{i}", "trace_id": "a" * 32, "error_type": "fact_error", "severity": "severe",
             "expected_keywords": "[]", "comment": "", "created_ms": 1, "updated_ms": 1} for i in range(5000)])
    before = _scans(pg_url)
    for i in range(20):
        assert await store.upsert_feedback([fb(feedback_id=f"next-{i}"), fb(feedback_id="grown-7")]) == [True, False]
    await store.close_writes()  # a connection's statistics reach the server's view when it ends
    for _ in range(100):
        after = _scans(pg_url)
        if after["feedback"][1] > before["feedback"][1]:
            break
        await asyncio.sleep(0.1)
    assert after["feedback"][1] - before["feedback"][1] >= 20, "the writes' index lookups were not counted"
    assert after["feedback"][0] == before["feedback"][0] and after["replay_records"][0] == before["replay_records"][0]
    store.close()
