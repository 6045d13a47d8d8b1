"""The feedback stage's database: tables (SQLAlchemy Core), engine, and Alembic migrations run at start.

``replay_records``: one row per served request, keyed by trace_id (the primary key is what makes a
replayed spill exactly-once). ``feedback``: one row per client-chosen feedback_id.
``rotation_decisions``: one row per alert phase the rotation executor saw (services/feedback/rotation),
unique per (fingerprint, starts_at, phase), so a redelivered alert never acts twice;
``rotation_retrain_requests``: one row per adapter a decision asked to retrain.
The schema changes only through versioned migrations in ``services/feedback/migrations/versions``;
``migrate`` brings any database (a fresh SQLite file, an existing PostgreSQL) to the newest one.
"""
from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Engine

from shared import errors

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
RETRY_AFTER_MS = 1000  # the hint a caller gets while the database is unavailable


def unavailable(exc: Exception) -> errors.NotReady:
    """A database failure a retry may cure (server down, connection lost, SQLite file locked)."""
    return errors.NotReady(f"the feedback database is unavailable: {getattr(exc, 'orig', None) or exc}",
                           reason="DATABASE_UNAVAILABLE", retry_after_ms=RETRY_AFTER_MS)

metadata = sa.MetaData()

replay_records = sa.Table(
    "replay_records", metadata,
    sa.Column("trace_id", sa.String(32), primary_key=True),
    sa.Column("created_ms", sa.BigInteger, nullable=False, index=True),
    sa.Column("input_sha256", sa.String(64), nullable=False, index=True),
    sa.Column("prompt_stored", sa.Boolean, nullable=False),
    # The whole record as JSON text (ids, sampling, engine, verdicts, hashes): read back as one piece.
    sa.Column("body", sa.Text, nullable=False),
)

feedback = sa.Table(
    "feedback", metadata,
    sa.Column("feedback_id", sa.String(128), primary_key=True),
    sa.Column("trace_id", sa.String(32), nullable=False, index=True),
    sa.Column("error_type", sa.String(32), nullable=False),
    sa.Column("severity", sa.String(16), nullable=False),
    sa.Column("expected_keywords", sa.Text, nullable=False),  # JSON list
    sa.Column("comment", sa.Text, nullable=False),
    sa.Column("created_ms", sa.BigInteger, nullable=False, index=True),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)

rotation_decisions = sa.Table(
    "rotation_decisions", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    # The idempotency key: Alertmanager's fingerprint of the alert, its startsAt, and firing/resolved.
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("starts_at", sa.String(64), nullable=False),
    sa.Column("phase", sa.String(16), nullable=False),
    sa.Column("rule", sa.String(200), nullable=False, index=True),   # the alertname
    sa.Column("action", sa.String(64), nullable=False, index=True),
    sa.Column("labels", sa.Text, nullable=False),                    # JSON object
    sa.Column("snapshot", sa.Text, nullable=False),                  # JSON: the alert's annotations (metric values)
    sa.Column("mode", sa.String(16), nullable=False),                # propose | apply
    # pending, proposed, applied, failed, cooldown, skipped, expired (docs/rotation.md)
    sa.Column("outcome", sa.String(16), nullable=False, index=True),
    sa.Column("detail", sa.Text, nullable=False),
    sa.Column("result", sa.Text, nullable=False),                    # JSON: what the action did
    sa.Column("actor", sa.String(200), nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("reverts", sa.Integer, nullable=True),                 # the firing decision a resolved one undoes
    sa.Column("created_ms", sa.BigInteger, nullable=False, index=True),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
    sa.Column("applied_ms", sa.BigInteger, nullable=True),
    sa.UniqueConstraint("fingerprint", "starts_at", "phase", name="uq_rotation_decisions_alert"),
)

rotation_retrain_requests = sa.Table(
    "rotation_retrain_requests", metadata,
    sa.Column("decision_id", sa.Integer, sa.ForeignKey("rotation_decisions.id"), primary_key=True),
    sa.Column("adapter", sa.String(200), primary_key=True),
    sa.Column("version", sa.String(200), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),              # requested (the training side takes it)
    sa.Column("created_ms", sa.BigInteger, nullable=False),
)


def make_engine(url: str, *, connect_timeout_s: int = 2, pool_size: int = 5) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": connect_timeout_s})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")      # readers never block the writer
            cur.execute("PRAGMA synchronous=NORMAL")    # durable at each WAL checkpoint; safe with WAL
            cur.close()
        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return sa.create_engine(url, pool_size=pool_size, pool_pre_ping=True,
                            connect_args={"connect_timeout": connect_timeout_s})


def migrate(engine: Engine) -> None:
    """Upgrade the database to the newest migration (idempotent)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
