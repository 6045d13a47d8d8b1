"""Quarantine writer: rejected inputs and doubtful outputs into Redis Streams, without loss.

Synchronous API (call it from a thread, e.g. ``asyncio.to_thread``, in an asyncio servicer);
``start()`` launches one background thread that replays the spill file when Redis is back.

Write path of :meth:`Quarantine.put`:
  * Redis believed up and no spill backlog: one EVALSHA (XADD + "seen" marker, atomically).
  * otherwise, or when that call fails or times out (short socket timeout): append the record
    to the fsync'd spill file and return. ``put`` never raises because Redis is down or slow.
While a backlog exists every new record goes to the spill too, so records reach the stream in
``put`` order. The replay thread drains the spill oldest-first in pipelined batches through the
same script, which skips a record whose ``record_id`` already has a seen marker: a write that
timed out on our side but landed in Redis, or a batch replayed again after a crash before the
cursor moved, is not duplicated.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.validator.records import QuarantineRecord
from shared.errors import PreconditionFailed
from shared.spill import SpillEntry, SpillLog, SpillReplayer, claim_slot, slot_path

log = logging.getLogger(__name__)

# KEYS[1] stream, KEYS[2] seen marker of the record; ARGV[1] marker TTL (s), ARGV[2..] fields.
# Returns the stream id the record has (new or, for a duplicate, the one it got before).
_XADD_ONCE = """
local prior = redis.call('GET', KEYS[2])
if prior then return prior end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
redis.call('SET', KEYS[2], id, 'EX', ARGV[1])
return id
"""


@dataclass(frozen=True)
class QuarantineConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    stream: str = "keel:quarantine"          # rejected / flagged inputs
    review_stream: str = "keel:review"       # outputs sent for human review
    key_prefix: str = "keel:quarantine"      # seen markers: <prefix>:seen:<record_id>
    spill_path: Path = Path("var/validator/quarantine.spill")
    socket_timeout_s: float = 0.05           # a slower Redis counts as down for this write
    connect_timeout_s: float = 0.05
    probe_interval_s: float = 0.5            # how often the replay thread retries Redis
    replay_batch: int = 200
    dedup_ttl_s: int = 7 * 86400             # must outlast the longest outage + replay
    group: str = "operators"                 # consumer group of `keel quarantine`
    claim_idle_s: float = 300.0              # an operator claim older than this may be taken over
    spill_slots: int = 8                     # spill files workers may claim: spill_path, spill_path.1, ...
    max_payload_bytes: int = 65536           # larger input payloads are stored clipped (shared/clip.py)
    # Flood control of input records (services/validator/flood.py).
    dedup_window_s: float = 3600.0           # a payload stored within this window is not stored again
    max_per_source: int = 1000               # input records stored per source per source_window_s
    source_window_s: float = 60.0
    max_tracked: int = 100_000               # fingerprints and sources remembered (oldest forgotten)

    def __post_init__(self) -> None:
        # shared.config.build passes YAML strings straight through; keep the field a Path.
        object.__setattr__(self, "spill_path", Path(self.spill_path))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> QuarantineConfig:
        d = dict(d or {})
        # No coercion (as in shared/config.py): "0.05" is an error, not a float. Annotations
        # are strings here (postponed evaluation), hence the names.
        accepts = {"str": (str,), "float": (int, float), "int": (int,), "Path": (str, Path)}
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(d) - set(kinds)
        if unknown:
            raise ValueError(f"validator config quarantine: unknown keys {sorted(unknown)}")
        for key, value in d.items():
            if isinstance(value, bool) or not isinstance(value, accepts[kinds[key]]):
                raise ValueError(f"validator config quarantine.{key}: expected {kinds[key]}, "
                                 f"got {value!r}")
        cfg = cls(**d)
        for name in ("socket_timeout_s", "connect_timeout_s", "probe_interval_s", "claim_idle_s",
                     "dedup_window_s", "source_window_s", "max_payload_bytes", "max_per_source",
                     "max_tracked", "spill_slots"):
            if not float(getattr(cfg, name)) > 0:
                raise ValueError(f"validator config quarantine.{name} must be > 0")
        if cfg.replay_batch < 1 or cfg.dedup_ttl_s < 60:
            raise ValueError("validator config quarantine: replay_batch >= 1, dedup_ttl_s >= 60")
        return cfg

    def connect(self) -> redis.Redis:
        """A client with short timeouts and no client-side retries (redis-py retries 10 times
        by default, which would turn a dead Redis into a multi-second stall per put)."""
        return redis.Redis.from_url(self.redis_url, socket_timeout=self.socket_timeout_s,
                                    socket_connect_timeout=self.connect_timeout_s,
                                    retry=Retry(NoBackoff(), 0), decode_responses=True)


class Quarantine(SpillReplayer):
    def __init__(self, cfg: QuarantineConfig):
        super().__init__()
        self.cfg = cfg
        self._redis = cfg.connect()
        self._script = self._redis.register_script(_XADD_ONCE)
        self._spill = SpillLog(cfg.spill_path)
        self._counts = {"direct": 0, "spilled": 0, "replayed": 0}

    def start(self) -> None:
        """Claim (open and own) a free spill slot and start the replay thread."""
        spill = claim_slot(self.cfg.spill_path, self.cfg.spill_slots)
        self._up = spill.pending == 0 and self.ping()
        self._start_replay(spill, "quarantine-replay")

    def close(self) -> None:
        self._stop_replay()                  # put() sees _thread None under the lock
        self._redis.close()

    def put(self, record: QuarantineRecord) -> str:
        """Store ``record`` in its stream (``input`` -> quarantine, ``output`` -> review) or, if
        Redis cannot take it now, in the spill file. Returns ``record.record_id``."""
        with self._lock:
            if self._thread is None:
                raise RuntimeError("Quarantine.put outside start() ... close()")
            if self._up and self._spill.pending == 0:
                try:
                    self._send([record])
                    self._counts["direct"] += 1
                    return record.record_id
                except redis.RedisError as exc:
                    self._up = False
                    log.warning("quarantine: Redis write failed (%s); spilling to %s",
                                exc, self._spill.path)
            self._spill.append(record.to_json())
            self._counts["spilled"] += 1
        self._wake.set()
        return record.record_id


    def stats(self) -> dict[str, int]:
        """Counters for metrics: records written directly, spilled, replayed; current backlog."""
        with self._lock:
            return {**self._counts, "backlog": self._spill.pending}

    def size(self) -> int | None:
        """Records in the quarantine stream (None while Redis is unreachable)."""
        try:
            return int(self._redis.xlen(self.cfg.stream))
        except redis.RedisError:
            return None

    def memory(self) -> tuple[int, int] | None:
        """Redis (used_memory, maxmemory) in bytes (None while Redis is unreachable)."""
        try:
            info = self._redis.info("memory")
        except redis.RedisError:
            return None
        return int(info["used_memory"]), int(info.get("maxmemory", 0))

    def refused_credentials(self) -> str | None:
        """Redis's answer when it refuses our credentials (a wrong password, or none where it
        requires one), else None: also when Redis is merely unreachable, an outage the spill
        rides out."""
        try:
            self._redis.ping()
        except redis.AuthenticationError as exc:
            return str(exc)
        except redis.RedisError:
            pass
        return None

    def ping(self) -> bool:
        try:
            return bool(self._redis.ping())
        except redis.RedisError:
            return False

    def stream_for(self, record: QuarantineRecord) -> str:
        return self.cfg.review_stream if record.kind == "output" else self.cfg.stream

    def _send(self, records: list[QuarantineRecord]) -> None:
        """XADD each record unless already there. One record: a plain EVALSHA; a batch: one
        pipelined round trip (plus the pipeline's SCRIPT EXISTS check)."""
        if len(records) == 1:
            self._script(**self._script_call(records[0]))
            return
        pipe = self._redis.pipeline(transaction=False)
        for rec in records:
            self._script(**self._script_call(rec), client=pipe)
        pipe.execute()

    def _script_call(self, rec: QuarantineRecord) -> dict[str, list]:
        args: list[Any] = [self.cfg.dedup_ttl_s]
        for key, value in rec.to_fields().items():
            args += [key, value]
        return {"keys": [self.stream_for(rec), f"{self.cfg.key_prefix}:seen:{rec.record_id}"],
                "args": args}

    def _replay_loop(self) -> None:
        while self._wait(self.cfg.probe_interval_s):
            with self._lock:
                idle = self._up and self._spill.pending == 0
            try:
                if idle:
                    self._adopt_orphans()
                elif self.ping():
                    self._drain()
            except redis.RedisError as exc:
                log.warning("quarantine: replay interrupted (%s); %d records wait in %s",
                            exc, self.backlog(), self._spill.path)
                with self._lock:
                    self._up = False
            except Exception:  # noqa: BLE001 - a dead replay thread would strand the spill
                log.exception("quarantine: replay failed; retrying in %.1fs",
                              self.cfg.probe_interval_s)
                with self._lock:
                    self._up = False

    def _drain(self) -> None:
        """Replay the spill oldest-first. Only this thread commits, and put() only appends, so
        the batch read under the lock stays the head of the file while it is sent."""
        while not self._stop.is_set():
            with self._lock:
                batch = self._spill.read(self.cfg.replay_batch, QuarantineRecord.from_json)
                if not batch:
                    self._up = True
                    return
            self._send_batch(batch)
            with self._lock:
                self._spill.commit(batch)
                self._counts["replayed"] += len(batch)

    def _adopt_orphans(self) -> None:
        """Replay the spill files of slots no live process owns: a worker that died with a
        backlog (its lock went with it), or a slot left by a layout with more workers. Their
        records reach the stream after this worker's own, through the same de-duplicating
        script; a slot a live worker owns is left to it."""
        for slot in range(self.cfg.spill_slots):
            path = slot_path(self.cfg.spill_path, slot)
            if path == self._spill.path or not path.exists() or path.stat().st_size == 0:
                continue
            orphan = SpillLog(path)
            try:
                orphan.open()
            except PreconditionFailed:
                continue
            try:
                while not self._stop.is_set():
                    batch = orphan.read(self.cfg.replay_batch, QuarantineRecord.from_json)
                    if not batch:
                        break
                    self._send_batch(batch)
                    orphan.commit(batch)
                    with self._lock:
                        self._counts["replayed"] += len(batch)
            finally:
                orphan.close()

    def _send_batch(self, batch: list[SpillEntry]) -> None:
        records = [e.item for e in batch if e.item is not None]
        if records:
            self._send(records)
