"""Operator commands (`keel quarantine ...`) on a real Redis, through the consumer group."""
from __future__ import annotations

import io
import json
import threading

import pytest
import redis

from services.validator.operators import QuarantineOps
from services.validator.quarantine import Quarantine, QuarantineConfig
from services.validator.quarantine_cli import main
from services.validator.records import QuarantineRecord


def record(i: int) -> QuarantineRecord:
    return QuarantineRecord(kind="input", reason="CONTRACT_VIOLATION", rule="contract.default",
                            trace_id=f"t{i}", source="web", domain="default",
                            payload={"prompt": f"p{i}"})


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def add(client, n: int, start: int = 0) -> list[str]:
    """Stream ids of ``n`` new records (written as the Quarantine writes them)."""
    return [client.xadd("keel:quarantine", record(i).to_fields())
            for i in range(start, start + n)]


def cli(redis_url, *args, operator="alice", replay_fn=None, cfg=None):
    out = io.StringIO()
    rc = main(["--redis-url", redis_url, "--operator", operator, *args], replay_fn,
              cfg=cfg, out=out)
    return rc, out.getvalue()


def claimed_ids(redis_url, operator, count, cfg=None) -> list[str]:
    rc, out = cli(redis_url, "--json", "claim", "--count", str(count), operator=operator, cfg=cfg)
    assert rc == 0
    return [e["stream_id"] for e in json.loads(out)]


def test_two_operators_never_get_the_same_item(redis_url, client):
    ids = add(client, 60)
    taken: dict[str, list[str]] = {"alice": [], "bob": []}

    def work(name):
        while batch := claimed_ids(redis_url, name, 3):
            taken[name] += batch

    threads = [threading.Thread(target=work, args=(n,)) for n in taken]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(taken["alice"]) & set(taken["bob"])
    assert sorted(taken["alice"] + taken["bob"]) == sorted(ids)


def test_replay_only_by_the_holder_and_only_once(redis_url, client):
    sid = add(client, 1)[0]
    calls = []

    def replay_fn(payload):
        calls.append(payload)
        return {"text": "ok"}

    assert cli(redis_url, "replay", sid, replay_fn=replay_fn)[0] == 3      # not claimed yet
    assert claimed_ids(redis_url, "alice", 1) == [sid]
    rc, _ = cli(redis_url, "replay", sid, operator="bob", replay_fn=replay_fn)
    assert rc == 3 and calls == []                                         # bob may not
    rc, out = cli(redis_url, "replay", sid, replay_fn=replay_fn)
    assert rc == 0 and calls == [{"prompt": "p0"}]
    assert json.loads(out) == {"replayed": sid, "result": {"text": "ok"}}
    assert cli(redis_url, "replay", sid, replay_fn=replay_fn)[0] == 3     # already done
    assert len(calls) == 1
    rc, out = cli(redis_url, "--json", "list")
    assert [(e["stream_id"], e["status"]) for e in json.loads(out)] == [(sid, "done")]


def test_failed_replay_keeps_the_claim(redis_url, client):
    sid = add(client, 1)[0]
    claimed_ids(redis_url, "alice", 1)

    def broken(payload):
        raise ConnectionError("gateway down")

    assert cli(redis_url, "replay", sid, replay_fn=broken)[0] == 1
    rc, out = cli(redis_url, "show", sid)
    assert rc == 0 and (json.loads(out)["status"], json.loads(out)["owner"]) == ("claimed", "alice")
    assert cli(redis_url, "replay", sid, replay_fn=lambda p: {"ok": True})[0] == 0


def test_stale_claim_of_an_absent_operator_is_taken_over(redis_url, client):
    sid = add(client, 1)[0]
    assert claimed_ids(redis_url, "alice", 1) == [sid]
    patient = QuarantineConfig(claim_idle_s=3600)
    assert claimed_ids(redis_url, "bob", 1, cfg=patient) == []
    impatient = QuarantineConfig(claim_idle_s=0.001)
    client.execute_command("XCLAIM", "keel:quarantine", "operators", "alice", 0, sid,
                           "IDLE", 60000, "JUSTID")           # alice went quiet a minute ago
    assert claimed_ids(redis_url, "bob", 1, cfg=impatient) == [sid]
    assert cli(redis_url, "ack", sid, operator="alice")[0] == 3
    assert cli(redis_url, "ack", sid, operator="bob")[0] == 0


def test_list_shows_status_and_owner(redis_url, client):
    ids = add(client, 3)
    claimed_ids(redis_url, "alice", 2)
    cli(redis_url, "ack", ids[0])
    rc, out = cli(redis_url, "--json", "list", "--count", "10")
    statuses = {e["stream_id"]: (e["status"], e["owner"]) for e in json.loads(out)}
    assert statuses == {ids[0]: ("done", None), ids[1]: ("claimed", "alice"),
                        ids[2]: ("new", None)}
    rc, out = cli(redis_url, "--json", "list", "--status", "new")
    assert [e["stream_id"] for e in json.loads(out)] == [ids[2]]
    rc, out = cli(redis_url, "list")
    assert rc == 0 and len(out.splitlines()) == 3 and "claimed(alice)" in out


def test_show_by_stream_id_or_record_id_and_not_found(redis_url, client):
    sid = add(client, 1)[0]
    stored = json.loads(cli(redis_url, "show", sid)[1])
    assert stored["payload"] == {"prompt": "p0"} and stored["status"] == "new"
    rc, out = cli(redis_url, "show", stored["record_id"])
    assert rc == 0 and json.loads(out)["stream_id"] == sid
    assert cli(redis_url, "show", "0-1")[0] == 4
    assert cli(redis_url, "show", "no-such-record")[0] == 4


def test_purge_older_than_drops_old_entries_and_their_claims(redis_url, client):
    old = [client.xadd("keel:quarantine", record(i).to_fields(), id=f"{1000 + i}-0")
           for i in range(3)]
    new = add(client, 2, start=3)
    claimed_ids(redis_url, "alice", 2)                        # claims two old entries
    rc, out = cli(redis_url, "purge", "--older-than", "1d")
    assert rc == 0 and out.strip() == "purged 3 entries"
    assert [sid for sid, _ in client.xrange("keel:quarantine")] == new
    assert client.xpending("keel:quarantine", "operators")["pending"] == 0
    assert old[0] not in cli(redis_url, "list")[1]


def test_review_stream_is_separate(redis_url, client):
    client.xadd("keel:review", record(0).to_fields())
    assert json.loads(cli(redis_url, "--json", "list")[1]) == []
    assert len(json.loads(cli(redis_url, "--stream", "review", "--json", "list")[1])) == 1


def test_usage_and_wiring_errors(redis_url, client):
    sid = add(client, 1)[0]
    assert cli(redis_url, "frobnicate")[0] == 2
    assert cli(redis_url, "purge", "--older-than", "soon")[0] == 2
    claimed_ids(redis_url, "alice", 1)
    assert cli(redis_url, "replay", sid)[0] == 2              # no replay function wired in
    assert main(["--redis-url", "redis://127.0.0.1:1/0", "list"], out=io.StringIO()) == 5


def test_ops_needs_an_operator_name(client):
    with pytest.raises(ValueError):
        QuarantineOps(client, stream="s", group="g", operator="", key_prefix="k")


def test_show_finds_records_written_by_the_quarantine(tmp_path, redis_url):
    q = Quarantine(QuarantineConfig(redis_url=redis_url, spill_path=tmp_path / "q.spill"))
    q.start()
    try:
        inp = record(1)
        out = QuarantineRecord(kind="output", reason="LOW_CONFIDENCE_OUTPUT", rule="probes",
                               trace_id="t", source="web", domain="default", payload={"output": "x"})
        q.put(inp)
        q.put(out)
    finally:
        q.close()
    rc, shown = cli(redis_url, "show", inp.record_id)          # found through its seen marker
    assert rc == 0 and json.loads(shown)["trace_id"] == "t1"
    assert cli(redis_url, "show", out.record_id)[0] == 4         # lives in the review stream
    rc, shown = cli(redis_url, "--stream", "review", "show", out.record_id)
    assert rc == 0 and json.loads(shown)["reason"] == "LOW_CONFIDENCE_OUTPUT"
