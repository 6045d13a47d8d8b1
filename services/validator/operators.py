"""Operator work on a quarantine (or review) stream, through one Redis consumer group.

Each operator is a consumer of the group. Work is handed out only by ``XREADGROUP >`` (and by
``XAUTOCLAIM`` for claims left idle longer than ``claim_idle_s``, i.e. by an operator who went
away), so Redis guarantees that two operators never hold the same entry. Replaying or closing an
entry needs :meth:`QuarantineOps.hold` to succeed (the caller holds it) and ends with
:meth:`QuarantineOps.done` (``XACK``).

Status of an entry, derived from the group: ``claimed`` (in the pending list, with its owner),
``new`` (after the group's last-delivered id), else ``done`` (delivered and acknowledged).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass

import redis

from services.validator.records import QuarantineRecord
from shared.errors import NotFound, PreconditionFailed

_STREAM_ID = re.compile(r"\d+-\d+")

# Atomically: if ARGV[2] is pending for consumer ARGV[3], reset its idle time (so nobody can
# take it over while we work on it) and return 'ok'; else return the owner, or false.
_TOUCH_IF_MINE = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 then return false end
if p[1][2] ~= ARGV[3] then return p[1][2] end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 'ok'
"""


def _id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class Entry:
    stream_id: str
    record: QuarantineRecord
    status: str            # new | claimed | done
    owner: str | None = None


class QuarantineOps:
    def __init__(self, client: redis.Redis, *, stream: str, group: str, operator: str,
                 key_prefix: str, claim_idle_s: float = 300.0):
        if not operator:
            raise ValueError("an operator name is required")
        self.r, self.stream, self.group, self.operator = client, stream, group, operator
        self.key_prefix = key_prefix
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self._touch = client.register_script(_TOUCH_IF_MINE)

    def ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def list(self, count: int = 20, status: str | None = None) -> list[Entry]:
        """Newest first, up to ``count`` entries (of one ``status`` if given)."""
        last, pending = self._group_state()
        out: list[Entry] = []
        upper = "+"
        while len(out) < count:
            page = self.r.xrevrange(self.stream, max=upper, min="-", count=max(count, 50))
            for sid, fields in page:
                entry = self._entry(sid, fields, last, pending)
                if status is None or entry.status == status:
                    out.append(entry)
            if len(page) < max(count, 50):
                break
            ms, seq = _id_key(page[-1][0])
            upper = f"({ms}-{seq}"
        return out[:count]

    def show(self, ident: str) -> Entry:
        """By stream id, or by record_id (through the record's seen marker, or a scan)."""
        rows = self._find(ident)
        if not rows:
            raise NotFound(f"no quarantine entry {ident!r} in {self.stream}")
        last, pending = self._group_state()
        return self._entry(rows[0][0], rows[0][1], last, pending)

    def claim(self, count: int = 10) -> list[Entry]:
        """Take up to ``count`` entries: stale claims of others first, then new entries."""
        self.ensure_group()
        got: list[tuple[str, dict]] = []
        _, claimed, _ = self.r.xautoclaim(self.stream, self.group, self.operator,
                                          self.claim_idle_ms, "0-0", count=count)
        got += [(sid, f) for sid, f in claimed if f]
        if len(got) < count:
            reply = self.r.xreadgroup(self.group, self.operator, {self.stream: ">"},
                                      count=count - len(got))
            for _, rows in reply or []:
                got += [(sid, f) for sid, f in rows if f]
        return [Entry(sid, QuarantineRecord.from_fields(f), "claimed", self.operator)
                for sid, f in got]

    def hold(self, ident: str) -> Entry:
        """The entry ``ident`` if this operator holds it (its claim is refreshed, so it cannot
        be taken over while being worked on); PreconditionFailed/NotFound otherwise."""
        entry = self.show(ident)
        state = self._touch(keys=[self.stream], args=[self.group, entry.stream_id, self.operator])
        if state == "ok":
            return Entry(entry.stream_id, entry.record, "claimed", self.operator)
        if state:
            raise PreconditionFailed(f"entry {entry.stream_id} is claimed by {state}",
                                     reason="CLAIMED_BY_OTHER", metadata={"owner": state})
        if entry.status == "done":
            raise PreconditionFailed(f"entry {entry.stream_id} is already done",
                                     reason="ALREADY_DONE")
        raise PreconditionFailed(f"entry {entry.stream_id} is not claimed; run `claim` first",
                                 reason="NOT_CLAIMED")

    def done(self, entry: Entry) -> None:
        """Acknowledge a held entry: it leaves the pending list and counts as done."""
        self.r.xack(self.stream, self.group, entry.stream_id)

    def purge(self, older_than_s: float) -> int:
        """Delete entries older than ``older_than_s`` (by stream id time), whatever their
        status, and drop their pending claims. Returns how many entries were deleted."""
        min_id = f"{int((time.time() - older_than_s) * 1000)}-0"
        self.ensure_group()
        while True:
            stale = self.r.xpending_range(self.stream, self.group, min="-", max=f"({min_id}",
                                          count=500)
            if not stale:
                break
            self.r.xack(self.stream, self.group, *[p["message_id"] for p in stale])
        return int(self.r.xtrim(self.stream, minid=min_id, approximate=False))

    def _group_state(self) -> tuple[str, dict[str, str]]:
        """(last-delivered id, {pending id: owner}) of the group; group created if missing."""
        self.ensure_group()
        info = next(g for g in self.r.xinfo_groups(self.stream) if g["name"] == self.group)
        pending: dict[str, str] = {}
        start = "-"
        while True:
            page = self.r.xpending_range(self.stream, self.group, min=start, max="+", count=500)
            pending.update({p["message_id"]: p["consumer"] for p in page})
            if len(page) < 500:
                break
            ms, seq = _id_key(page[-1]["message_id"])
            start = f"({ms}-{seq}"
        return info["last-delivered-id"], pending

    def _entry(self, sid: str, fields: dict, last: str, pending: dict[str, str]) -> Entry:
        record = QuarantineRecord.from_fields(fields)
        if sid in pending:
            return Entry(sid, record, "claimed", pending[sid])
        status = "new" if _id_key(sid) > _id_key(last) else "done"
        return Entry(sid, record, status)

    def _find(self, ident: str) -> list:
        if _STREAM_ID.fullmatch(ident):
            return self.r.xrange(self.stream, min=ident, max=ident)
        # The marker names a stream id but not the stream (review and quarantine share
        # markers), so check the record found is really the one asked for.
        marker = self.r.get(f"{self.key_prefix}:seen:{ident}")
        rows = self.r.xrange(self.stream, min=marker, max=marker) if marker else []
        if rows and rows[0][1].get("record_id") == ident:
            return rows
        return [(sid, f) for sid, f in self._scan() if f.get("record_id") == ident][:1]

    def _scan(self):
        start = "-"
        while True:
            page = self.r.xrange(self.stream, min=start, max="+", count=500)
            yield from page
            if len(page) < 500:
                return
            ms, seq = _id_key(page[-1][0])
            start = f"({ms}-{seq}"
