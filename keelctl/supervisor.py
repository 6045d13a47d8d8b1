"""Supervise Redis and every stage replica as child processes; restart the ones that die.

Each child tells the supervisor when it is serving (sd_notify ``READY=1``: a stage when it reports
SERVING on grpc.health.v1, Redis when it accepts connections; keelctl/readiness.py). The wait
before a restart depends on how the child died (``next_backoff``):

- it died after it was serving (kill -9 from outside, a crash mid-work): restarted after
  ``restart.initial_backoff_s`` (0.2 s), whatever its previous wait, for up to ``restart.burst``
  such deaths within ``restart.stable_after_s`` (config/keel.yaml);
- it died before it was ever serving (bad config, port in use, import error), or after serving
  with ``burst`` such deaths already in the last ``stable_after_s``: a crash loop. The wait doubles
  on each such death, up to ``max_backoff_s``, and starts over after a run of ``stable_after_s``.

So a loop that dies at start is slowed down to one try per ``max_backoff_s``, and a loop that dies
each time soon after SERVING gets ``burst`` quick restarts per ``stable_after_s``, then the same
doubling. Every restart is one JSON log line (var/log/supervisor.log) and a Prometheus counter.

A child that exits with ``EXIT_CONFIG`` (2: its configuration is invalid) before it ever served is
not restarted: a configuration error does not fix itself. The supervisor records it in ``failed``
with the last line the child wrote to its log (its reason) and ``run`` returns, so that `keel up`
stops the mesh at once and prints that line.

Children die with the supervisor, even with kill -9: each starts through ``keelctl.lifeline``
(Linux parent-death signal) and carries ``KEEL_RUN_DIR`` so that ``keel down``/``keel up`` find any
that are left (keelctl/procs.py). The kernel ties the parent-death signal to the forking thread, so
``start`` and ``poll_once`` must run on the supervisor's main thread.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from keelctl.layout import LOG_DIR, ROOT, RUN_DIR, Layout, RestartPolicy, write_state
from keelctl.procs import RUN_DIR_ENV
from keelctl.readiness import ReadySocket
from shared import meshauth, metrics, modelfile, notify, proxyauth
from shared.config import EXIT_CONFIG
from shared.stages import GATEWAY_UPSTREAMS, STAGE_ORDER

log = logging.getLogger("keel.supervisor")


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    stage: str
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None
    log_path: Path = field(default_factory=Path)
    served_at: float | None = None  # when the running process reported READY=1; None: not yet
    served_deaths: deque[float] = field(default_factory=deque)  # deaths after READY=1, last stable_after_s
    ever_served: bool = False  # any process of this child reported READY=1


def last_line(path: Path, tail_bytes: int = 8192) -> str:
    """The last line a child wrote to its log, readable: a JSON log record as its message and its
    ``error`` field (shared/logging.py), anything else as written; "" for an empty or missing log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    line = next((x.strip() for x in reversed(lines) if x.strip()), "")
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or "msg" not in record:
        return line
    return f"{record['msg']}: {record['error']}" if record.get("error") else str(record["msg"])


def _replica_port(ports: tuple[int, ...], replica: int) -> int:
    """A replica's port of a per-replica list (metrics, webhook); 0 = none."""
    return ports[replica] if replica < len(ports) else 0


def _stage_env(layout: Layout, stage: str, replica: int, worker: int, redis_url: str) -> dict[str, str]:
    """Every port worker ``worker`` of replica ``replica`` binds, and the addresses it calls."""
    sl = layout.stage(stage)
    env = {f"KEEL_{stage.upper()}_SERVER__PORT": str(sl.ports[replica]),
           f"KEEL_{stage.upper()}_SERVER__METRICS_PORT":
               str(worker_metrics_port(_replica_port(sl.metrics_ports, replica), worker))}
    if stage == "gateway":
        for up in (*GATEWAY_UPSTREAMS, "feedback"):  # the feedback stage: replay records, off the request path
            env[f"KEEL_GATEWAY_UPSTREAMS__{up.upper()}"] = "[" + ", ".join(layout.targets(up)) + "]"
    if stage == "openai":
        env["KEEL_OPENAI_GATEWAY"] = "[" + ", ".join(layout.targets("gateway")) + "]"
    if stage == "validator":
        env["KEEL_VALIDATOR_QUARANTINE__REDIS_URL"] = redis_url
    if stage == "feedback":  # rotation switches variants on every inference replica of the mesh
        env["KEEL_FEEDBACK_ROTATION__INFERENCE"] = "[" + ", ".join(layout.targets("inference")) + "]"
        # Alertmanager posts to one address: the replica's first worker listens there, others not at all
        env["KEEL_FEEDBACK_ROTATION__WEBHOOK_PORT"] = str(_replica_port(sl.webhook_ports, replica) if not worker else 0)
    return env


def worker_metrics_port(replica_port: int, worker: int) -> int:
    """Workers sharing a replica's gRPC port each export metrics on their own port, 10 apart."""
    return replica_port + 10 * worker if replica_port else 0


def layout_ports(layout: Layout) -> dict[int, str]:
    """Every port the mesh of ``layout`` listens on -> the process that needs it."""
    needed = {layout.redis.port: "redis"}
    for stage in STAGE_ORDER:
        sl = layout.stage(stage)
        for r, port in enumerate(sl.ports):
            needed[port] = f"{stage}-{r}"
            mport = _replica_port(sl.metrics_ports, r)
            for w in range(sl.workers if mport else 0):
                needed[worker_metrics_port(mport, w)] = f"{stage}-{r}.{w} metrics"
            if _replica_port(sl.webhook_ports, r):
                needed[sl.webhook_ports[r]] = f"{stage}-{r} webhook"
    if layout.metrics_port:
        needed[layout.metrics_port] = "supervisor metrics"
    return needed


def next_backoff(policy: RestartPolicy, previous_s: float, lived_s: float, *, served: bool,
                 served_deaths: int) -> float:
    """The wait before restarting a child that died after ``lived_s``. ``served``: it had reported
    READY=1; ``served_deaths``: how often it died after READY=1 before, within ``stable_after_s``.
    A child that died while serving is back at the initial backoff unless that happened ``burst``
    times already; any other death doubles the previous wait (capped), except a first one or one
    after a stable run."""
    if served and served_deaths < policy.burst:
        return policy.initial_backoff_s
    if lived_s >= policy.stable_after_s or not previous_s:
        return policy.initial_backoff_s
    return min(policy.max_backoff_s, max(previous_s * 2, policy.initial_backoff_s))


class Supervisor:
    def __init__(self, layout: Layout, *, mesh_token: str | None = None, redis: bool = True):
        self.layout = layout
        self.mesh_token = mesh_token or meshauth.token() or secrets.token_hex(16)
        # Redis's password, random per `keel up` like the mesh token; only the validator gets it.
        self.redis_password = os.environ.get("KEEL_REDIS_PASSWORD") or secrets.token_hex(16)
        self.redis_url = f"redis://:{self.redis_password}@127.0.0.1:{layout.redis.port}/0"
        self.children: list[Child] = []
        # "<child> exited 2 before serving: <its last log line>" once a child failed that way
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._restarts = metrics.metrics_for("supervisor").counter("keel_supervisor_restarts_total")
        self._ready = ReadySocket()
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        # The proxy credential (shared/proxyauth.py): the HTTP server names its callers to the gateway.
        proxy_token = proxyauth.token() or secrets.token_hex(16)
        # The model, pinned for the mesh's lifetime: a stage restarted after config/keel.yaml changed
        # still serves the model its peers serve.
        self.model = {modelfile.ENV: str(modelfile.model_path()), modelfile.NAME_ENV: modelfile.model_id()}
        base_env = dict(os.environ, **{meshauth.ENV: self.mesh_token, proxyauth.ENV: proxy_token}, PYTHONUNBUFFERED="1",
                        **{RUN_DIR_ENV: str(RUN_DIR.resolve()), notify.ENV: self._ready.name}, **self.model)
        if redis:
            redis_dir = ROOT / layout.redis.dir  # an absolute dir replaces ROOT
            redis_dir.mkdir(parents=True, exist_ok=True)
            server = shutil.which("redis-server") or "/usr/bin/redis-server"
            # appendonly + fsync every second: quarantine records survive a redis restart
            argv = [server, str(self._redis_conf()), "--port", str(layout.redis.port), "--bind", "127.0.0.1",
                    "--dir", str(redis_dir), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                    "--protected-mode", "yes", "--supervised", "systemd"]  # READY=1 once it accepts connections
            self.children.append(Child("redis", argv, base_env, layout.redis.port, "redis"))
        for stage in STAGE_ORDER:
            sl = layout.stage(stage)
            for r, port in enumerate(sl.ports):
                for w in range(sl.workers):
                    env = dict(base_env, **_stage_env(layout, stage, r, w, self.redis_url))
                    argv = [sys.executable, "-m", f"services.{stage}"]
                    self.children.append(Child(f"{stage}-{r}.{w}", argv, env, port, stage))
        for c in self.children:
            c.log_path = LOG_DIR / f"{c.name}.log"
            self._restarts.labels(stage=c.stage)  # exported from 0 so increase() sees the first restart

    def _redis_conf(self) -> Path:
        """Redis settings that stay off the command line (ps shows it): the password, the cap."""
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        path = RUN_DIR / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {self.redis_password}\nmaxmemory {self.layout.redis.maxmemory_mb}mb\n"
                    "maxmemory-policy noeviction\n")
        return path

    def _spawn(self, c: Child) -> None:
        out = open(c.log_path, "ab")
        argv = [sys.executable, "-m", "keelctl.lifeline", str(os.getpid()), *c.argv]
        c.popen = subprocess.Popen(argv, env=c.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        out.close()
        c.started_at = time.monotonic()
        c.served_at = None
        c.restart_at = None
        log.info("started", extra={"stage": c.name, "pid": c.popen.pid, "port": c.port})

    def start(self) -> None:
        for c in self.children:
            self._spawn(c)
        self._write_state()

    def _write_state(self) -> None:
        write_state({
            "pid": os.getpid(), "mesh_token": self.mesh_token, "redis_url": self.redis_url, "failed": self.failed,
            "model": self.model,
            "processes": {c.name: {"pid": c.popen.pid if c.popen else None, "port": c.port, "stage": c.stage,
                                   "restarts": c.restarts, "log": str(c.log_path)} for c in self.children},
        })

    def _note_ready(self, now: float) -> None:
        """Mark the children whose current process sent READY=1 (a dead process's message, read
        after its successor started, names the old pid and is ignored)."""
        by_pid = {c.popen.pid: c for c in self.children if c.popen is not None}
        for pid in self._ready.ready_pids():
            c = by_pid.get(pid)
            if c is not None and c.served_at is None and c.restart_at is None:
                c.served_at = now
                c.ever_served = True
                log.info("serving", extra={"stage": c.name, "pid": pid, "start_s": round(now - c.started_at, 3)})

    def _on_death(self, c: Child, now: float) -> None:
        policy = self.layout.restart
        rc = c.popen.returncode
        lived = now - c.started_at
        if rc == EXIT_CONFIG and not c.ever_served:
            reason = last_line(c.log_path)
            self.failed = self.failed or f"{c.name} exited {rc} before serving: {reason or 'see ' + str(c.log_path)}"
            c.popen = None  # dead and not to be restarted: nothing left to watch
            log.error("stage has an invalid configuration; not restarting", extra={
                "stage": c.name, "exit_code": rc, "reason": reason, "log": str(c.log_path)})
            return
        while c.served_deaths and now - c.served_deaths[0] >= policy.stable_after_s:
            c.served_deaths.popleft()
        served, earlier = c.served_at is not None, len(c.served_deaths)
        c.backoff = next_backoff(policy, c.backoff, lived, served=served, served_deaths=earlier)
        if served:
            c.served_deaths.append(now)
        c.restart_at = now + c.backoff
        c.restarts += 1
        self._restarts.labels(stage=c.stage).inc()
        log.warning("stage exited; restarting", extra={
            "stage": c.name, "exit_code": rc, "signal": -rc if rc < 0 else None, "lived_s": round(lived, 3),
            "served": served, "served_deaths": len(c.served_deaths), "restart": c.restarts, "backoff_s": c.backoff})

    def poll_once(self) -> None:
        """Notice readiness and deaths, start what is due; called every 100 ms by ``run``. Readiness
        is read first: a child that reported READY=1 and then died counts as having served."""
        now = time.monotonic()
        changed = False
        with self._lock:
            self._note_ready(now)
            for c in self.children:
                if c.restart_at is None and c.popen is not None and c.popen.poll() is not None:
                    failed = self.failed
                    self._on_death(c, now)
                    changed = changed or self.failed != failed
                if c.restart_at is not None and now >= c.restart_at:
                    self._spawn(c)
                    changed = True
        if changed:
            self._write_state()

    def run(self, stop: threading.Event) -> None:
        """Supervise until ``stop`` is set or a child failed on its configuration (``failed``)."""
        while not stop.wait(0.1):
            self.poll_once()
            if self.failed:
                return

    def stop(self, grace_s: float = 45.0) -> None:
        """SIGTERM in reverse order (gateway first, Redis last) so in-flight calls drain; grace_s must
        exceed every stage's server.drain_grace_s or a slow drain is cut short by SIGKILL."""
        with self._lock:
            for c in reversed(self.children):
                if c.popen and c.popen.poll() is None:
                    c.popen.send_signal(signal.SIGTERM)
                    try:
                        c.popen.wait(grace_s)
                    except subprocess.TimeoutExpired:
                        log.warning("did not drain in time; killing", extra={"stage": c.name})
                        c.popen.kill()
                        c.popen.wait()
                c.restart_at = None
        self._ready.close()
        log.info("all stopped")
