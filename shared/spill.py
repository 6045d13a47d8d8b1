"""Append-only, fsync'd JSON-lines spill file for records a store could not take (the validator's
quarantine spills what Redis refuses, the feedback stage what its database refuses), and the
replay thread both run over it (:class:`SpillReplayer`).

Layout next to ``path``:
  ``path``          one JSON record per line, appended and fsync'd before ``append`` returns
  ``path.cursor``   byte offset of the prefix already replayed into Redis (atomic rename)
  ``path.lock``     flock held by the one process that owns the spill
  ``path.corrupt``  lines that could not be parsed, set aside (never silently dropped)

Crash safety: a record is durable once ``append`` returns. The cursor only moves *after* Redis
confirmed the records, so a crash in between replays them again; the replay de-duplicates by
record_id, so that costs a lookup, not a duplicate. A torn final line (crash mid-append, so its
``put`` never returned) is cut off on open. Once everything is replayed the file is truncated
and then the cursor reset; a crash between the two leaves cursor > size, read as "empty".

Worker slots: several processes of one validator (config/keel.yaml ``workers``) share one
configured path, so each claims the first free slot (:func:`claim_slot`): ``path`` itself, then
``path.1``, ``path.2``, ... (each with its own cursor, lock and corrupt file). A slot whose owner
died is adopted and replayed by a live worker, or claimed again by the restarted one.

Not thread-safe by itself: :class:`~services.validator.quarantine.Quarantine` serialises calls.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import PreconditionFailed


@dataclass(frozen=True)
class SpillEntry:
    item: Any     # what ``parse`` made of the line; None for a line set aside as corrupt
    end: int      # byte offset just after this line: the cursor value once it is replayed


class SpillLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._cursor_path = self.path.with_name(self.path.name + ".cursor")
        self._corrupt_path = self.path.with_name(self.path.name + ".corrupt")
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._cursor = 0
        self._size = 0
        self._set_aside_upto = 0
        self.pending = 0   # records appended but not yet committed as replayed

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(lock_fd)
            raise PreconditionFailed(f"spill file {self.path} is owned by another process",
                                     reason="SPILL_IN_USE") from exc
        self._lock_fd = lock_fd
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = self._repair_tail()
        self._cursor = self._read_cursor()
        if self._cursor > self._size:   # crash between truncate and cursor reset
            self._cursor = 0
            self._write_cursor(0)
        self.pending = sum(1 for _ in self._lines(self._cursor, None))

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None

    def append(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        os.write(self._fd, data)
        os.fsync(self._fd)
        self._size += len(data)
        self.pending += 1

    def read(self, limit: int, parse: Callable[[str], Any]) -> list[SpillEntry]:
        """Up to ``limit`` unreplayed entries, oldest first, each line through ``parse``. A line
        ``parse`` refuses (ValueError/TypeError/KeyError) is copied to the ``.corrupt`` file and
        comes back with ``item`` None, so the next commit moves the cursor past it."""
        entries: list[SpillEntry] = []
        for line, end in self._lines(self._cursor, limit):
            try:
                item = parse(line)
            except (ValueError, TypeError, KeyError):
                if end > self._set_aside_upto:
                    self._set_aside(line)
                    self._set_aside_upto = end
                item = None
            entries.append(SpillEntry(item, end))
        return entries

    def commit(self, entries: list[SpillEntry]) -> None:
        """Mark ``entries`` (a prefix of what :meth:`read` returned) as replayed."""
        if not entries:
            return
        self._write_cursor(entries[-1].end)
        self._cursor = entries[-1].end
        self.pending -= len(entries)
        if self._cursor == self._size:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self._size = 0
            self._write_cursor(0)
            self._cursor = self._set_aside_upto = 0

    def _lines(self, start: int, limit: int | None):
        """(line, end offset) from ``start``; reads the file through a separate handle."""
        with open(self.path, "rb") as f:
            f.seek(start)
            offset, count = start, 0
            while limit is None or count < limit:
                raw = f.readline()
                if not raw.endswith(b"\n"):
                    return
                offset += len(raw)
                count += 1
                yield raw[:-1].decode("utf-8", "replace"), offset

    def _repair_tail(self) -> int:
        size = os.fstat(self._fd).st_size
        if size == 0:
            return 0
        with open(self.path, "rb") as f:
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return size
            f.seek(0)
            keep = f.read().rfind(b"\n") + 1
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)
        return keep

    def _read_cursor(self) -> int:
        try:
            return int(self._cursor_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            # An unreadable cursor means "replay everything": duplicates are filtered by
            # record_id on the Redis side, lost records could not be recovered.
            return 0

    def _write_cursor(self, value: int) -> None:
        tmp = self._cursor_path.with_name(self._cursor_path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(value))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._cursor_path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _set_aside(self, line: str) -> None:
        with open(self._corrupt_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def slot_path(base: Path, slot: int) -> Path:
    """Spill file of worker slot ``slot``: ``base`` itself for slot 0, ``<base>.<slot>`` after."""
    return base if slot == 0 else base.with_name(f"{base.name}.{slot}")


def claim_slot(base: Path, slots: int) -> SpillLog:
    """The opened spill file of the first of ``slots`` slots no live process owns: several
    worker processes of one validator share a config, and each takes a file of its own."""
    for slot in range(slots):
        log = SpillLog(slot_path(Path(base), slot))
        try:
            log.open()
            return log
        except PreconditionFailed:
            continue
    raise PreconditionFailed(f"all {slots} spill files {base}, {base}.1, ... are owned by other "
                             f"processes; run fewer workers or raise quarantine.spill_slots",
                             reason="SPILL_IN_USE")


class SpillReplayer:
    """The lifecycle both spilling writers share: a spill, a lock ordering writes against replay
    commits, and one thread that wakes every ``interval_s`` (or when woken) to probe the store and
    drain the spill into it. Subclasses write ``_replay_loop`` with ``_wait`` and ``_lock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()        # orders writes against replay commits
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._up = False  # the store takes writes directly (no backlog); set by probes and the drain

    def backlog(self) -> int:
        """Records in the spill not yet in the store."""
        with self._lock:
            return self._spill.pending

    def wait_drained(self, timeout_s: float) -> bool:
        """Block until the spill is empty and the store takes writes directly, or ``timeout_s``
        passes; returns which (shutdown and tests)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._up and self._spill.pending == 0:
                    return True
            if time.monotonic() >= deadline:
                return False
            self._wake.set()
            time.sleep(0.02)

    def _start_replay(self, spill: SpillLog, name: str) -> None:
        self._spill = spill
        self._thread = threading.Thread(target=self._replay_loop, name=name, daemon=True)
        self._thread.start()
        self._wake.set()

    def _stop_replay(self) -> None:
        """Stop and join the thread, then close the spill (writers see ``_thread is None``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._thread = None
            self._spill.close()

    def _wait(self, interval_s: float) -> bool:
        """Sleep until woken or ``interval_s`` passes; False once the replayer is stopping."""
        self._wake.wait(interval_s)
        self._wake.clear()
        return not self._stop.is_set()

    def _replay_loop(self) -> None:
        raise NotImplementedError
