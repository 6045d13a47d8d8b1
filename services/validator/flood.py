"""Flood control in front of the input quarantine: duplicates and per-source caps.

A client stuck in a loop can send the same bad request thousands of times, or thousands of
different ones; without a limit each becomes a Redis stream entry. :class:`FloodGate` decides,
per rejected or flagged input, whether it is stored:

* a record whose ``fingerprint`` (sha256 of the payload) was stored within ``dedup_window_s``
  is a duplicate: not stored again, and the answer names the earlier record's id;
* at most ``max_per_source`` records per ``source`` are stored per ``source_window_s``.

Every dropped record is counted (``on_drop(why)``: the validator's
``keel_validator_quarantine_dropped_total{why}``) and the client's answer says so, never
silently. The gate is per process and in memory (bounded: ``max_tracked`` fingerprints and
sources, oldest forgotten first); what it admits goes through :class:`Quarantine` unchanged,
which loses nothing it accepts.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.validator.records import QuarantineRecord

DUPLICATE = "duplicate"
SOURCE_CAP = "source_cap"


@dataclass(frozen=True)
class Drop:
    why: str                 # DUPLICATE or SOURCE_CAP
    earlier_id: str = ""     # record_id of the stored record this one duplicates


class FloodGate:
    def __init__(self, *, dedup_window_s: float, max_per_source: int, source_window_s: float,
                 max_tracked: int, clock: Callable[[], float] = time.monotonic,
                 on_drop: Callable[[str], None] = lambda why: None):
        self.dedup_window_s, self.max_per_source = dedup_window_s, max_per_source
        self.source_window_s, self.max_tracked = source_window_s, max_tracked
        self._clock, self._on_drop = clock, on_drop
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, tuple[str, float]] = OrderedDict()    # fingerprint -> (id, at)
        self._sources: OrderedDict[str, tuple[float, int]] = OrderedDict()  # source -> (start, n)

    def admit(self, record: QuarantineRecord) -> Drop | None:
        """None when ``record`` is to be stored (and is remembered as stored), else why not."""
        with self._lock:
            now = self._clock()
            while self._seen and now - next(iter(self._seen.values()))[1] > self.dedup_window_s:
                self._seen.popitem(last=False)
            earlier = self._seen.get(record.fingerprint)
            if earlier is not None:
                drop = Drop(DUPLICATE, earlier[0])
            else:
                start, count = self._sources.pop(record.source, (now, 0))
                if now - start >= self.source_window_s:
                    start, count = now, 0
                self._sources[record.source] = (start, count + (count < self.max_per_source))
                drop = Drop(SOURCE_CAP) if count >= self.max_per_source else None
            if drop is None:
                self._seen[record.fingerprint] = (record.record_id, now)
            for table in (self._seen, self._sources):
                while len(table) > self.max_tracked:
                    table.popitem(last=False)
        if drop is not None:
            self._on_drop(drop.why)
        return drop
