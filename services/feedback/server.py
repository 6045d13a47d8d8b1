"""Assembles the feedback stage: the database (migrated at start), the spill writer, retention,
and the rotation executor with its Alertmanager webhook (services/feedback/rotation, docs/rotation.md).

Ready = the spill file is open and its replay thread runs. The database itself may be down at
start or later: replay records then spill and reach it once it is back, and SubmitFeedback
answers UNAVAILABLE with a retry hint meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from keel.feedback.v1 import feedback_pb2_grpc
from services.feedback import config as fb_config
from services.feedback.batcher import Result, SubmitBatcher
from services.feedback.records import Feedback, ReplayRecord, stored_body
from services.feedback.rotation.service import Rotation
from services.feedback.servicer import FeedbackServicer
from services.feedback.store import now_ms, open_store
from services.feedback.writer import RecordWriter
from shared import errors, metrics
from shared.config import ServerConfig
from shared.stages import SERVICE_NAMES

log = logging.getLogger("keel.feedback")
DAY_MS = 86_400_000
RETENTION_EVERY_S = 3600.0
CHECKPOINT_EVERY_S = 1.0  # SQLite: the write-ahead log grows by a few MB a second at most between them
DRAIN_ON_CLOSE_S = 2.0


class FeedbackCore:
    """The stage's work in domain terms (no grpc): record, submit, retention."""

    def __init__(self, cfg: fb_config.FeedbackConfig):
        self.cfg = cfg
        db = cfg.database
        m = metrics.metrics_for("feedback")
        self._feedback = m.counter("keel_feedback_total")
        records = m.counter("keel_replay_records_total")
        for path in ("direct", "spilled", "replayed"):
            records.labels(path=path)  # exported from 0 so increase() sees the first spill
        self.writer = RecordWriter(lambda: open_store(cfg.database_url, connect_timeout_s=db.connect_timeout_s,
                                                      pool_size=db.pool_size),
                                   cfg.spill_path, probe_interval_s=cfg.replay.probe_interval_s,
                                   batch=cfg.replay.replay_batch,
                                   on_count=lambda path, n: records.labels(path=path).inc(n))
        m.gauge("keel_feedback_spill_backlog").set_function(self.writer.backlog)
        self.submits = SubmitBatcher(self.write_feedback, max_batch=cfg.submit.max_batch,
                                     queue_size=cfg.submit.queue_size)

    def record(self, records: list[ReplayRecord]) -> tuple[int, int]:
        for r in records:
            r.check()
        return self.writer.put([stored_body(r if r.created_ms else replace(r, created_ms=now_ms()),
                                            self.cfg.replay.store_prompts) for r in records])

    async def write_feedback(self, items: list[Feedback]) -> list[Result]:
        """One transaction for a batch of feedback items (SubmitBatcher's write)."""
        results = await self.writer.store().upsert_feedback(items)
        for fb, result in zip(items, results):
            if result is True:
                self._feedback.labels(error_type=fb.error_type, severity=fb.severity).inc()
        return results

    def checkpoint(self) -> None:
        self.writer.store().checkpoint()

    def purge_expired(self) -> int:
        cutoff = now_ms() - self.cfg.replay.retention_days * DAY_MS
        return self.writer.store().purge_records(cutoff)


class FeedbackStage:
    name = "feedback"
    service_name = SERVICE_NAMES["feedback"]

    def __init__(self, cfg: fb_config.FeedbackConfig):
        self.cfg = cfg
        self.core = FeedbackCore(cfg)
        self.rotation = Rotation(cfg, self.core.writer.store)
        self._retention: asyncio.Task | None = None
        self._checkpoints: asyncio.Task | None = None

    def register(self, server: grpc.aio.Server) -> None:
        feedback_pb2_grpc.add_FeedbackServicer_to_server(FeedbackServicer(self.core, self.rotation), server)

    async def warmup(self) -> None:
        await asyncio.to_thread(self.core.writer.start)
        try:
            await self.core.writer.store().open_writes()
        except errors.NotReady:
            pass  # the database is down: the first write after it is back opens the connection
        self.core.submits.start()
        self._retention = asyncio.create_task(self._retention_loop())
        self._checkpoints = asyncio.create_task(self._checkpoint_loop())
        await self.rotation.start()

    def begin_drain(self) -> None:
        self.core.submits.begin_drain()

    async def _retention_loop(self) -> None:
        while True:
            try:
                purged = await asyncio.to_thread(self.core.purge_expired)
                log.info("retention", extra={"purged": purged, "days": self.cfg.replay.retention_days})
            except errors.NotReady:
                pass  # the database is down: the next round purges
            await asyncio.sleep(RETENTION_EVERY_S)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY_S)
            try:
                await asyncio.to_thread(self.core.checkpoint)
            except errors.NotReady:
                pass  # the database is down or busy: the next round checkpoints

    async def close(self) -> None:
        for task in (self._retention, self._checkpoints):
            if task is not None:
                task.cancel()
        await self.rotation.close()
        await self.core.submits.close()
        try:
            await self.core.writer.store().close_writes()
        except errors.NotReady:
            pass  # never opened: the database was down
        # A database that is up gets the spilled records now; else they wait in the file for the next start.
        await asyncio.to_thread(self.core.writer.wait_drained, DRAIN_ON_CLOSE_S)
        await asyncio.to_thread(self.core.writer.close)


def build() -> tuple[FeedbackStage, ServerConfig]:
    cfg = fb_config.load()
    return FeedbackStage(cfg), cfg.server
