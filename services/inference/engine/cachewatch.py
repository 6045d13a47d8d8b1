"""One WatchCache stream's view of the prefix cache: the blocks stored and evicted, carried from the
step loop's thread (which owns the cache) to the stream's asyncio loop without ever making the loop
thread wait on a slow stream.

The loop thread records net changes (key -> stored or evicted, the last word per key) since the stream
last took them, at most `capacity` keys; past that it drops them for a snapshot of every key the cache
holds (a resync), as it does when the stream starts. It wakes the stream once per batch it takes.
"""
from __future__ import annotations

import asyncio
import threading


class CacheWatch:
    def __init__(self, capacity: int, loop: asyncio.AbstractEventLoop):
        self.capacity = capacity
        self._loop = loop
        self._lock = threading.Lock()
        self._snapshot: list[bytes] | None = None  # pending: every key held, replacing all before it
        self._changes: dict[bytes, bool] = {}      # after the snapshot: key -> stored (True) or evicted
        self._woken = False                        # a wake-up is on its way to the stream
        self._ready = asyncio.Event()
        self.closed = False                        # the stream ended: the cache drops this watch

    # ---- the step loop's thread ----
    def resync(self, held: list[bytes]) -> None:
        with self._lock:
            self._snapshot, self._changes = held, {}
            self._wake()

    def change(self, key: bytes, stored: bool) -> bool:
        """Record one change; False when `capacity` keys are pending already (the caller resyncs)."""
        with self._lock:
            if key not in self._changes and len(self._changes) >= self.capacity:
                return False
            self._changes[key] = stored
            self._wake()
        return True

    def _wake(self) -> None:
        if self._woken:
            return
        self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the stream's loop is closed: nobody is listening any more
            self.closed = True

    # ---- the stream's asyncio loop ----
    async def take(self, wait_s: float) -> tuple[list[bytes] | None, dict[bytes, bool]]:
        """(snapshot or None, changes after it) pending, waiting up to `wait_s` for any."""
        try:
            await asyncio.wait_for(self._ready.wait(), wait_s)
        except TimeoutError:
            pass
        self._ready.clear()
        with self._lock:
            taken = self._snapshot, self._changes
            self._snapshot, self._changes, self._woken = None, {}, False
        return taken

    def close(self) -> None:
        self.closed = True
