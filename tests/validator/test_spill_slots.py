"""Several validator workers share one config: each claims a spill file of its own, and the
backlog of a worker that died is replayed by a live one. Real Redis, stopped and restarted."""
from __future__ import annotations

import time

import pytest

from services.validator.quarantine import Quarantine, QuarantineConfig
from shared.errors import PreconditionFailed
from shared.spill import claim_slot
from tests.validator.test_quarantine import WAIT_S, record, stream_records


def worker(tmp_path, url, **kw) -> Quarantine:
    q = Quarantine(QuarantineConfig(redis_url=url, spill_path=tmp_path / "spill" / "q.spill",
                                    probe_interval_s=0.05, **kw))
    q.start()
    return q


def test_workers_with_one_config_each_take_a_spill_file(tmp_path, redis_server):
    a, b = worker(tmp_path, redis_server.url), worker(tmp_path, redis_server.url)
    try:
        redis_server.stop()
        sent = [record(i) for i in range(20)]
        for i, r in enumerate(sent):
            (a if i % 2 else b).put(r)
        assert a.backlog() == b.backlog() == 10
        redis_server.start()
        assert a.wait_drained(WAIT_S) and b.wait_drained(WAIT_S)
        got = stream_records(redis_server.url)
        assert sorted(r.record_id for r in got) == sorted(r.record_id for r in sent)
    finally:
        a.close()
        b.close()


def test_the_backlog_of_a_dead_worker_is_replayed_by_a_live_one(tmp_path, redis_server):
    live, doomed = worker(tmp_path, redis_server.url), worker(tmp_path, redis_server.url)
    try:
        redis_server.stop()
        stranded = [record(i) for i in range(7)]
        for r in stranded:
            doomed.put(r)
    finally:
        doomed.close()              # gone with its backlog on disk and its lock released
    try:
        redis_server.start()
        fresh = record(99)
        live.put(fresh)             # the live worker finds Redis back, then adopts the orphan
        assert live.wait_drained(WAIT_S)
        expected = {r.record_id for r in stranded} | {fresh.record_id}
        for _ in range(int(WAIT_S / 0.05)):
            if {r.record_id for r in stream_records(redis_server.url)} >= expected:
                break
            time.sleep(0.05)
        got = [r.record_id for r in stream_records(redis_server.url)]
        assert sorted(got) == sorted(expected)              # all of them, none twice
    finally:
        live.close()


def test_no_free_slot_is_refused_with_a_reason(tmp_path):
    held = [claim_slot(tmp_path / "q.spill", 2) for _ in range(2)]
    try:
        with pytest.raises(PreconditionFailed) as exc:
            claim_slot(tmp_path / "q.spill", 2)
        assert exc.value.reason == "SPILL_IN_USE" and "spill_slots" in exc.value.message
    finally:
        for log in held:
            log.close()
