"""Fixtures for the validator tests: a real redis-server on a free loopback port.

``redis_url``: a session-wide in-memory server, flushed before each test.
``redis_server``: a server of the test's own with AOF persistence (appendfsync always), which
the test may stop and start again on the same port and data directory.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process bound to 127.0.0.1, data and log under ``workdir``."""

    def __init__(self, workdir: Path, *, persistent: bool, password: str | None = None):
        if not Path(REDIS_BIN).exists():
            pytest.fail("redis-server is not installed (apt-get install redis-server)")
        self.workdir = workdir
        self.port = _free_port()
        self.persistent = persistent
        self.password = password     # requirepass, given in a config file (never on the command line)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        persistence = (["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                       else ["--appendonly", "no"])
        conf = self.workdir / "auth.conf"
        conf.write_text(f"requirepass {self.password}\n" if self.password else "")
        self.proc = subprocess.Popen(
            [REDIS_BIN, str(conf), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", *persistence, "--logfile", str(self.workdir / "redis.log"),
             "--enable-debug-command", "local"],   # DEBUG SLEEP simulates a stalled Redis
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=0.5)
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / "redis.log")
                    raise RuntimeError("redis-server did not start: "
                                       + (log.read_text()[-800:] if log.exists() else "no log"))
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        """SIGTERM: redis flushes the AOF and exits; wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self.proc = None


@pytest.fixture(scope="session")
def _session_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"), persistent=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(_session_redis) -> str:
    client = redis.Redis.from_url(_session_redis.url)
    client.flushall()
    client.close()
    return _session_redis.url


@pytest.fixture
def redis_server(tmp_path):
    workdir = tmp_path / "redis-own"
    workdir.mkdir()
    server = RedisServer(workdir, persistent=True)
    server.start()
    yield server
    server.stop()
