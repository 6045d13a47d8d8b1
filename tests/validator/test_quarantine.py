"""Quarantine against a real redis-server: direct writes, outage, slowness, crash in replay."""
from __future__ import annotations

import threading

import pytest
import redis

from services.validator.quarantine import Quarantine, QuarantineConfig
from services.validator.records import QuarantineRecord
from shared.spill import SpillLog

WAIT_S = 30   # how long to wait for a replay before calling it lost (not a speed claim)


def record(i: int, kind: str = "input") -> QuarantineRecord:
    return QuarantineRecord(kind=kind, reason="PROMPT_INJECTION", rule="default.script_tag",
                            trace_id=f"trace-{i}", source="web", domain="default",
                            payload={"prompt": f"<script>{i}</script>", "n": i},
                            message="input matches", flags=("x",))


def make(tmp_path, url, **kw) -> Quarantine:
    cfg = QuarantineConfig(redis_url=url, spill_path=tmp_path / "spill" / "q.spill",
                           probe_interval_s=0.05, **kw)
    q = Quarantine(cfg)
    q.start()
    return q


def stream_records(url, stream="keel:quarantine") -> list[QuarantineRecord]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [QuarantineRecord.from_fields(f) for _, f in client.xrange(stream)]
    finally:
        client.close()


def assert_exactly_once(url, sent: list[QuarantineRecord]) -> None:
    got = stream_records(url)
    assert [r.record_id for r in got] == [r.record_id for r in sent]   # all, once, in order
    assert got == sent                                                  # every field intact


def test_direct_write_round_trips_every_field(tmp_path, redis_url):
    q = make(tmp_path, redis_url)
    try:
        sent = [record(i) for i in range(3)]
        assert [q.put(r) for r in sent] == [r.record_id for r in sent]
        review = record(9, kind="output")
        q.put(review)
        assert q.backlog() == 0 and q.ping()
        assert_exactly_once(redis_url, sent)
        assert stream_records(redis_url, "keel:review") == [review]
    finally:
        q.close()


def test_put_before_start_is_a_bug(tmp_path, redis_url):
    q = Quarantine(QuarantineConfig(redis_url=redis_url, spill_path=tmp_path / "q.spill"))
    with pytest.raises(RuntimeError, match="start"):
        q.put(record(0))
    q.start()
    q.close()
    with pytest.raises(RuntimeError, match="close"):
        q.put(record(0))


def test_redis_restart_loses_nothing_and_duplicates_nothing(tmp_path, redis_server):
    q = make(tmp_path, redis_server.url)
    try:
        sent = [record(i) for i in range(10)]
        for r in sent:
            q.put(r)
        assert q.backlog() == 0
        redis_server.stop()
        assert not q.ping()
        during = [record(i) for i in range(10, 40)]
        for r in during:
            assert q.put(r) == r.record_id          # never raises while Redis is down
        assert q.backlog() == len(during)
        redis_server.start()
        after = [record(i) for i in range(40, 45)]
        for r in after:                               # may spill behind the backlog: order kept
            q.put(r)
        assert q.wait_drained(WAIT_S)
        assert_exactly_once(redis_server.url, sent + during + after)
        stats = q.stats()
        assert stats["spilled"] >= len(during) and stats["backlog"] == 0
        assert stats["direct"] + stats["spilled"] == 45 and stats["replayed"] == stats["spilled"]
    finally:
        q.close()


@pytest.mark.slow
def test_slow_redis_spills_and_a_late_write_is_not_duplicated(tmp_path, redis_url):
    q = make(tmp_path, redis_url, socket_timeout_s=0.05)
    admin = redis.Redis.from_url(redis_url)
    probe = redis.Redis.from_url(redis_url, socket_timeout=0.02)
    try:
        first = record(0)
        q.put(first)
        # Redis stalls for 2 s. The next put's EVALSHA times out on our side and is spilled,
        # but Redis still runs it when it wakes up, so that record lands twice unless the replay
        # de-duplicates it.
        stall = threading.Thread(target=admin.execute_command, args=("DEBUG", "SLEEP", 2))
        stall.start()
        stalled = False
        while not stalled and stall.is_alive():
            try:
                probe.ping()
            except redis.TimeoutError:
                stalled = True
        assert stalled, "the stall ended before it could be observed"
        late = [record(i) for i in range(1, 4)]
        for r in late:
            q.put(r)
        assert q.backlog() == len(late)
        stall.join()
        assert q.wait_drained(WAIT_S)
        assert_exactly_once(redis_url, [first] + late)
    finally:
        probe.close()
        admin.close()
        q.close()


def test_crash_between_replay_and_cursor_commit_is_deduplicated(tmp_path, redis_url, monkeypatch):
    spill = tmp_path / "spill" / "q.spill"
    dead = "redis://127.0.0.1:1/0"                   # nothing listens on port 1
    q = make(tmp_path, dead)
    sent = [record(i) for i in range(25)]
    for r in sent:
        q.put(r)
    q.close()
    # Second process: Redis is back, but it "dies" after each send, before moving the cursor.
    sent_once = threading.Event()

    def crash_on_commit(self, entries):
        sent_once.set()
        raise RuntimeError("simulated crash before the cursor moved")

    monkeypatch.setattr(SpillLog, "commit", crash_on_commit)
    q = make(tmp_path, redis_url, replay_batch=10)
    assert sent_once.wait(WAIT_S)
    q.close()
    assert 10 <= len(stream_records(redis_url)) < 25  # some landed, none committed
    monkeypatch.undo()
    # Third process: replays the whole spill again; only the missing records are added.
    q = make(tmp_path, redis_url, replay_batch=10)
    try:
        assert q.wait_drained(WAIT_S)
        assert_exactly_once(redis_url, sent)
        assert SpillLog(spill).path.stat().st_size == 0
    finally:
        q.close()


def test_down_at_start_spills_then_replays(tmp_path, redis_server):
    redis_server.stop()
    q = make(tmp_path, redis_server.url)
    try:
        sent = [record(i) for i in range(5)]
        for r in sent:
            q.put(r)
        assert q.backlog() == 5 and not q.ping()
        redis_server.start()
        assert q.wait_drained(WAIT_S)
        assert_exactly_once(redis_server.url, sent)
    finally:
        q.close()


@pytest.mark.parametrize("bad", [{"replay_batch": 0}, {"socket_timeout_s": 0}, {"nope": 1},
                                 {"replay_batch": "5"}, {"socket_timeout_s": True},
                                 {"dedup_ttl_s": 5}])
def test_bad_quarantine_config_fails_at_load(bad):
    with pytest.raises(ValueError):
        QuarantineConfig.from_dict(bad)


def test_config_from_dict_types_the_spill_path():
    cfg = QuarantineConfig.from_dict({"spill_path": "var/x.spill", "stream": "s"})
    assert cfg.spill_path.name == "x.spill" and cfg.stream == "s"
