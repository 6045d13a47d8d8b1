"""Reads and writes of the feedback database (synchronous; the stage calls it from threads).

Every database failure that a retry may cure (server down, connection lost, SQLite file locked)
surfaces as ``errors.NotReady`` with reason DATABASE_UNAVAILABLE and a retry hint; the callers
decide what that means (spill a record, answer UNAVAILABLE to a client).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from services.feedback import db
from services.feedback.records import Feedback, ReplayRecord, dumps
from services.feedback.upsert import feedback_upsert
from shared import errors


def now_ms() -> int:
    return int(time.time() * 1000)


class Store:
    def __init__(self, engine: Engine, connect_timeout_s: int):
        self.engine = engine
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._upsert = feedback_upsert(engine, connect_timeout_s)

    def insert(self, table: sa.Table):
        """The dialect's INSERT (it has ON CONFLICT on both SQLite and PostgreSQL)."""
        return self._insert(table)

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """One transaction; database failures a retry may cure raise NotReady (DATABASE_UNAVAILABLE)."""
        with self._tx() as conn:
            yield conn

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
            raise db.unavailable(exc) from exc

    async def open_writes(self) -> None:
        """Open the feedback write's own connection (PostgreSQL: on the calling event loop)."""
        await self._upsert.open()

    async def close_writes(self) -> None:
        """Close it (on the event loop that wrote); ``close`` for the rest."""
        await self._upsert.aclose()

    def close(self) -> None:
        self.engine.dispose()

    def put_records(self, bodies: list[dict]) -> int:
        """Insert stored-form records; a trace_id already present is skipped. Returns rows inserted."""
        if not bodies:
            return 0
        rows = [{"trace_id": b["trace_id"], "created_ms": b["created_ms"], "input_sha256": b["prompt_sha256"],
                 "prompt_stored": b["prompt_stored"], "body": dumps(b)} for b in bodies]
        stmt = (self._insert(db.replay_records).on_conflict_do_nothing(index_elements=["trace_id"])
                .returning(db.replay_records.c.trace_id))  # only the rows actually inserted come back
        with self._tx() as conn:
            return len(conn.execute(stmt, rows).all())

    def get_record(self, trace_id: str) -> ReplayRecord | None:
        with self._tx() as conn:
            body = conn.execute(sa.select(db.replay_records.c.body)
                                .where(db.replay_records.c.trace_id == trace_id)).scalar_one_or_none()
        return ReplayRecord.from_body(json.loads(body)) if body is not None else None

    def list_records(self, since_ms: int, limit: int | None = None) -> list[ReplayRecord]:
        q = (sa.select(db.replay_records.c.body).where(db.replay_records.c.created_ms >= since_ms)
             .order_by(db.replay_records.c.created_ms, db.replay_records.c.trace_id).limit(limit))
        with self._tx() as conn:
            return [ReplayRecord.from_body(json.loads(b)) for b in conn.execute(q).scalars()]

    def purge_records(self, older_than_ms: int) -> int:
        with self._tx() as conn:
            return conn.execute(sa.delete(db.replay_records)
                                .where(db.replay_records.c.created_ms < older_than_ms)).rowcount or 0

    async def upsert_feedback(self, items: list[Feedback]) -> list[bool | errors.KeelError]:
        """Create or update each item by feedback_id, all in one transaction (one commit for the
        batch). Per item, in order: True when created, False when updated, or NotFound
        TRACE_NOT_FOUND for an unknown trace_id (that item alone is not written). An item whose
        feedback_id came earlier in the same batch updates it, as if sent one after the other.
        NotReady for the whole batch while the database is unavailable: then nothing is written.
        Runs on the stage's event loop (what would block goes to a worker thread)."""
        for fb in items:
            fb.check()
        known, existing = await self._upsert(items, now_ms())
        results: list[bool | errors.KeelError] = []
        for fb in items:
            if fb.trace_id not in known:
                results.append(errors.NotFound(f"no served request has trace_id {fb.trace_id[:64]!r}",
                                               reason="TRACE_NOT_FOUND", metadata={"trace_id": fb.trace_id[:64]}))
                continue
            results.append(fb.feedback_id not in existing)
            existing.add(fb.feedback_id)
        return results

    def checkpoint(self) -> None:
        """SQLite: copy the write-ahead log into the database file (PASSIVE: it waits for no one).
        The feedback write's connection never does (it may run on the event loop); a thread of
        the stage calls this. PostgreSQL: nothing to do."""
        if self.engine.dialect.name == "sqlite":
            with self._tx() as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def list_feedback(self, since_ms: int = 0, *, severities=None, error_types=None,
                      limit: int | None = None) -> list[dict]:
        f = db.feedback.c
        q = sa.select(db.feedback).where(f.created_ms >= since_ms)
        if severities:
            q = q.where(f.severity.in_(list(severities)))
        if error_types:
            q = q.where(f.error_type.in_(list(error_types)))
        q = q.order_by(f.created_ms, f.feedback_id).limit(limit)
        with self._tx() as conn:
            rows = [dict(r._mapping) for r in conn.execute(q)]
        for r in rows:
            r["expected_keywords"] = json.loads(r["expected_keywords"])
        return rows

    def feedback_with_records(self, since_ms: int, severities, error_types) -> Iterator[tuple[dict, ReplayRecord]]:
        """(feedback row, replay record) pairs for the selected feedback, joined on trace_id."""
        f, r = db.feedback.c, db.replay_records.c
        q = (sa.select(db.feedback, r.body).join(db.replay_records, r.trace_id == f.trace_id)
             .where(f.created_ms >= since_ms, f.severity.in_(list(severities)), f.error_type.in_(list(error_types)))
             .order_by(f.feedback_id))
        with self._tx() as conn:
            rows = conn.execute(q).all()
        for row in rows:
            item = dict(row._mapping)
            body = json.loads(item.pop("body"))
            item["expected_keywords"] = json.loads(item["expected_keywords"])
            yield item, ReplayRecord.from_body(body)


def open_store(url: str, *, connect_timeout_s: int = 2, pool_size: int = 5) -> Store:
    """Engine + migrations to the newest version; raises NotReady while the database is unreachable."""
    engine = db.make_engine(url, connect_timeout_s=connect_timeout_s, pool_size=pool_size)
    try:
        db.migrate(engine)
        return Store(engine, connect_timeout_s)
    except (sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        engine.dispose()
        raise db.unavailable(exc) from exc
