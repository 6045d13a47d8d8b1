"""Fixtures of the feedback tests: a database URL for each backend (SQLite file, real PostgreSQL)."""
from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from testing.postgres import PgServer


@pytest.fixture(scope="session")
def pg_server():
    server = PgServer().init()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh, empty database of the session's PostgreSQL server."""
    name = "t_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(pg_server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return pg_server.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database per test: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'feedback.db'}"
    return request.getfixturevalue("pg_url")
