"""Replay records into the database, or into an fsync'd spill file while the database is down.

The same shape as the validator's quarantine (services/validator/quarantine.py), on the same
:class:`~shared.spill.SpillLog`: ``put`` writes directly while the database is up and
no backlog exists; otherwise, or when that write fails, it appends to the spill and returns. A
background thread probes the database every ``probe_interval_s`` and drains the spill oldest-first
in batches. Each batch is an INSERT that skips trace_ids already stored, so a batch that reached
the database before a crash (the cursor had not moved) is not stored twice: every record is
written exactly once.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from services.feedback.records import dumps
from services.feedback.store import Store
from shared import errors
from shared.spill import SpillLog, SpillReplayer

log = logging.getLogger("keel.feedback")


class RecordWriter(SpillReplayer):
    def __init__(self, connect: Callable[[], Store], spill_path: Path, *, probe_interval_s: float = 0.5,
                 batch: int = 500, on_count: Callable[[str, int], None] = lambda path, n: None):
        super().__init__()
        self._connect = connect           # opens (and migrates) the database; raises NotReady while down
        self._store: Store | None = None
        self._spill = SpillLog(spill_path)
        self._probe_s, self._batch = probe_interval_s, batch
        self._on_count = on_count          # (path, records): "direct", "spilled" or "replayed"

    def start(self) -> None:
        self._spill.open()
        self._up = self._spill.pending == 0 and self._probe()
        self._start_replay(self._spill, "feedback-spill-replay")

    def close(self) -> None:
        self._stop_replay()
        if self._store is not None:
            self._store.close()

    def store(self) -> Store:
        """The open store, for reads and feedback writes; NotReady while the database is down."""
        store = self._store
        if store is None:
            raise errors.NotReady("the feedback database is unavailable", reason="DATABASE_UNAVAILABLE",
                                  retry_after_ms=1000)
        return store

    def put(self, bodies: list[dict]) -> tuple[int, int]:
        """Store records (stored form) now or spill them; returns (stored, spilled). Never raises
        because the database is down."""
        with self._lock:
            if self._up and self._spill.pending == 0 and self._store is not None:
                try:
                    stored = self._store.put_records(bodies)
                    self._on_count("direct", len(bodies))
                    return stored, 0
                except errors.NotReady as exc:
                    self._up = False
                    log.warning("database write failed; spilling", extra={"error": str(exc),
                                                                           "spill": str(self._spill.path)})
            for b in bodies:
                self._spill.append(dumps(b))
            self._on_count("spilled", len(bodies))
        self._wake.set()
        return 0, len(bodies)

    def _probe(self) -> bool:
        try:
            if self._store is None:
                self._store = self._connect()
            with self._store.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return True
        except (errors.NotReady, sa.exc.OperationalError, sa.exc.InterfaceError):
            return False

    def _replay_loop(self) -> None:
        while self._wait(self._probe_s):
            with self._lock:
                idle = self._up and self._spill.pending == 0
            if idle or not self._probe():
                continue
            try:
                self._drain()
            except errors.NotReady as exc:
                log.warning("spill replay interrupted", extra={"error": str(exc), "backlog": self.backlog()})
                with self._lock:
                    self._up = False
            except Exception:  # noqa: BLE001 - a dead replay thread would strand the spill
                log.exception("spill replay failed; retrying")
                with self._lock:
                    self._up = False

    def _drain(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                batch = self._spill.read(self._batch, json.loads)
                if not batch:
                    self._up = True
                    return
            self._store.put_records([e.item for e in batch if e.item is not None])
            with self._lock:
                self._spill.commit(batch)
                self._on_count("replayed", len(batch))
