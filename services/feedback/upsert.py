"""The feedback upsert, SubmitFeedback's write, on a connection of its own.

A batch sent through SQLAlchemy's pool and Core paid for a pre-ping, BEGIN, two lookups, the
insert and COMMIT: six round trips to PostgreSQL and Core's per-statement work on each
(``bench/bench_feedback.py --sections store`` measures both paths), and a hop to a worker thread
and back. Here the store holds one connection outside the pool and sends:

- PostgreSQL: one statement in autocommit mode (atomic by itself), from the stage's event loop
  (psycopg's asyncio connection). It looks up which traces are known and which feedback ids
  exist, and upserts, per feedback_id, the batch's last item among those whose trace is known.
  Every part of one statement reads the same snapshot, so the lookups see the table as it was
  before the upsert.
- SQLite: BEGIN IMMEDIATE, one lookup, the upsert, COMMIT: short in-process work, done on
  the event loop when it cannot wait, else in a worker thread (``SqliteUpsert``). Nothing on this
  connection waits on the disk: SQLite in WAL mode with ``synchronous=NORMAL`` syncs only at
  checkpoints, and this connection's commits never checkpoint; ``Store.checkpoint`` runs one from
  a thread of the stage.

Either way the answer is (known trace ids, feedback ids that existed before the batch). A database
failure a retry may cure raises NotReady (DATABASE_UNAVAILABLE) and drops the connection; the
next batch opens a new one.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from services.feedback import db
from services.feedback.records import Feedback

Found = tuple[set[str], set[str]]  # (known trace ids, feedback ids that existed before the batch)

# created_ms stays as first written; an update changes everything else. The batch travels as one
# JSON array of rows, one text parameter whatever the batch size (psycopg adapts array parameters
# in Python: about a third of the stage's CPU per batch); WITH ORDINALITY keeps the items' order
# for DISTINCT ON. The lookups compare with ANY(ARRAY(...)), evaluated once, then the index.
_POSTGRESQL = (
    "WITH item AS (SELECT e->>0 AS feedback_id, e->>1 AS trace_id, e->>2 AS error_type, e->>3 AS severity,"
    " e->>4 AS expected_keywords, e->>5 AS comment, n FROM json_array_elements(%(items)s::json)"
    " WITH ORDINALITY AS i(e, n)),"
    " known AS (SELECT trace_id FROM replay_records WHERE trace_id = ANY(ARRAY(SELECT trace_id FROM item))),"
    " existing AS (SELECT feedback_id FROM feedback WHERE feedback_id = ANY(ARRAY(SELECT feedback_id FROM item))),"
    " written AS (INSERT INTO feedback"
    " (feedback_id, trace_id, error_type, severity, expected_keywords, comment, created_ms, updated_ms)"
    " SELECT DISTINCT ON (feedback_id) feedback_id, trace_id, error_type, severity, expected_keywords, comment,"
    " %(now)s::bigint, %(now)s::bigint FROM item WHERE trace_id IN (SELECT trace_id FROM known)"
    " ORDER BY feedback_id, n DESC"
    " ON CONFLICT (feedback_id) DO UPDATE SET trace_id = excluded.trace_id, error_type = excluded.error_type,"
    " severity = excluded.severity, expected_keywords = excluded.expected_keywords, comment = excluded.comment,"
    " updated_ms = excluded.updated_ms)"
    " SELECT 'trace', trace_id FROM known UNION ALL SELECT 'feedback', feedback_id FROM existing")

# The statement is prepared on the connection and planned once: planning it again for every batch
# took the server more time than running it (bench_feedback.py --sections store). A generic plan does
# not follow the tables' statistics, and one made while they were new and empty would scan them
# whole for the lookups, slower with every row; with sequential scans off on this connection (its
# only statement is this one) the plan looks both tables up by their primary keys whenever it was made.
_SESSION = ("SET plan_cache_mode = force_generic_plan", "SET enable_seqscan = off")

_SQLITE_FOUND = ("SELECT 'trace', trace_id FROM replay_records WHERE trace_id IN (SELECT value FROM json_each(?))"
                 " UNION ALL SELECT 'feedback', feedback_id FROM feedback"
                 " WHERE feedback_id IN (SELECT value FROM json_each(?))")
SQLITE_UPSERT = (
    "INSERT INTO feedback"
    " (feedback_id, trace_id, error_type, severity, expected_keywords, comment, created_ms, updated_ms)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (feedback_id) DO UPDATE SET trace_id = excluded.trace_id, error_type = excluded.error_type,"
    " severity = excluded.severity, expected_keywords = excluded.expected_keywords, comment = excluded.comment,"
    " updated_ms = excluded.updated_ms")


def _keywords(fb: Feedback) -> str:
    return json.dumps(list(fb.expected_keywords), ensure_ascii=False)


def _found(rows: Sequence[tuple[str, str]]) -> Found:
    return {v for k, v in rows if k == "trace"}, {v for k, v in rows if k == "feedback"}


def _sqlite(conn, items: list[Feedback], now: int) -> Found:
    conn.execute("BEGIN IMMEDIATE")  # the writer's lock from the lookup on: nothing changes in between
    try:
        known, existing = _found(conn.execute(_SQLITE_FOUND, (json.dumps([fb.trace_id for fb in items]),
                                                              json.dumps([fb.feedback_id for fb in items]))).fetchall())
        last = {fb.feedback_id: fb for fb in items if fb.trace_id in known}  # the later item of an id wins
        conn.executemany(SQLITE_UPSERT, [(fb.feedback_id, fb.trace_id, fb.error_type, fb.severity, _keywords(fb),
                                           fb.comment, now, now) for fb in last.values()])
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise
    return known, existing


class SqliteUpsert:
    """SQLite: one driver connection of its own. ``__call__`` writes on the event loop when that
    cannot wait (busy timeout 0: the lock held by another writer refuses at once, before anything
    is written) and otherwise in a worker thread, which waits for the lock up to the busy timeout."""

    def __init__(self, engine: Engine):
        self._engine, self._dbapi = engine, engine.dialect.loaded_dbapi
        self._failures = (sa.exc.OperationalError, sa.exc.InterfaceError,
                          self._dbapi.OperationalError, self._dbapi.InterfaceError)
        self._lock = threading.Lock()  # one batch at a time on the connection
        self._wait_ms = self._busy_ms = 0  # the busy timeout of a write in a thread / the one set now
        self._conn = self._open()

    def _open(self):
        pooled = self._engine.raw_connection()  # the pool's connect hooks run (the WAL pragmas)
        driver = pooled.driver_connection
        pooled.detach()  # ours alone: it never goes back to the pool, and closing it closes it
        driver.isolation_level = None  # transactions only where BEGIN says so
        driver.execute("PRAGMA wal_autocheckpoint = 0")  # see the module's docstring
        self._wait_ms = self._busy_ms = driver.execute("PRAGMA busy_timeout").fetchone()[0]
        return driver

    async def open(self) -> None:
        """Opened with the store already (an in-process file)."""

    def _busy_timeout(self, ms: int) -> None:
        if self._busy_ms != ms:
            self._conn.execute(f"PRAGMA busy_timeout = {int(ms)}")
            self._busy_ms = ms

    async def __call__(self, items: list[Feedback], now: int) -> Found:
        found = self._at_once(items, now)
        return found if found is not None else await asyncio.to_thread(self._waiting, items, now)

    def _at_once(self, items: list[Feedback], now: int) -> Found | None:
        """The write on the calling thread, or None where it would have to wait (the connection
        in use or closed, the lock held by another writer)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._conn is None:
                return None  # reopening is the waiting path's work
            self._busy_timeout(0)
            return _sqlite(self._conn, items, now)
        except self._dbapi.OperationalError as exc:
            if exc.sqlite_errorcode & 0xFF == self._dbapi.SQLITE_BUSY:  # refused before anything was written
                return None
            self._close()
            raise db.unavailable(exc) from exc
        finally:
            self._lock.release()

    def _waiting(self, items: list[Feedback], now: int) -> Found:
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = self._open()
                self._busy_timeout(self._wait_ms)
                return _sqlite(self._conn, items, now)
            except self._failures as exc:
                self._close()
                raise db.unavailable(exc) from exc

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except self._failures:
                pass  # already broken: nothing to close cleanly

    async def aclose(self) -> None:
        with self._lock:
            self._close()


class PostgresUpsert:
    """PostgreSQL: one connection of its own on the stage's event loop (psycopg's AsyncConnection),
    in autocommit mode: the batch's one statement is atomic by itself. Opened by ``open`` at the
    stage's start (or by the first write after a failure dropped it)."""

    def __init__(self, engine: Engine, connect_timeout_s: int):
        self._psycopg = engine.dialect.loaded_dbapi
        self._failures = (self._psycopg.OperationalError, self._psycopg.InterfaceError)
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._timeout_s = connect_timeout_s
        self._conn = None

    async def open(self) -> None:
        try:
            await self._connected()
        except self._failures as exc:
            raise db.unavailable(exc) from exc

    async def _connected(self):
        if self._conn is None or self._conn.closed:
            self._conn = await self._psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, connect_timeout=self._timeout_s)
            for setting in _SESSION:
                await self._conn.execute(setting)
        return self._conn

    async def __call__(self, items: list[Feedback], now: int) -> Found:
        rows = [[fb.feedback_id, fb.trace_id, fb.error_type, fb.severity, _keywords(fb), fb.comment] for fb in items]
        params = {"items": json.dumps(rows, ensure_ascii=False), "now": now}
        try:
            cur = await (await self._connected()).execute(_POSTGRESQL, params, prepare=True)
            return _found(await cur.fetchall())
        except self._failures as exc:
            await self.aclose()
            raise db.unavailable(exc) from exc

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except self._failures:
                pass  # already broken: nothing to close cleanly


def feedback_upsert(engine: Engine, connect_timeout_s: int) -> SqliteUpsert | PostgresUpsert:
    return SqliteUpsert(engine) if engine.dialect.name == "sqlite" else PostgresUpsert(engine, connect_timeout_s)
