"""The spill file: durability across reopen, torn tails, cursor, corrupt lines, ownership."""
from __future__ import annotations

import json

import pytest

from shared.errors import PreconditionFailed
from shared.spill import SpillLog


def parse(line: str) -> int:
    return json.loads(line)["n"]


def filled(tmp_path, n: int) -> SpillLog:
    log = SpillLog(tmp_path / "q.spill")
    log.open()
    for i in range(n):
        log.append(json.dumps({"n": i}))
    return log


def test_pending_survives_reopen_and_commit_moves_the_cursor(tmp_path):
    log = filled(tmp_path, 5)
    batch = log.read(3, parse)
    assert [e.item for e in batch] == [0, 1, 2] and log.pending == 5
    log.commit(batch)
    log.close()
    again = SpillLog(tmp_path / "q.spill")
    again.open()
    assert again.pending == 2
    assert [e.item for e in again.read(10, parse)] == [3, 4]
    again.close()


def test_reading_twice_without_commit_returns_the_same_head(tmp_path):
    log = filled(tmp_path, 3)
    assert [e.item for e in log.read(2, parse)] == [e.item for e in log.read(2, parse)] == [0, 1]
    log.close()


def test_fully_replayed_file_is_truncated(tmp_path):
    log = filled(tmp_path, 2)
    log.commit(log.read(10, parse))
    assert log.pending == 0 and (tmp_path / "q.spill").stat().st_size == 0
    log.append(json.dumps({"n": 9}))
    assert [e.item for e in log.read(10, parse)] == [9]
    log.close()


def test_torn_tail_is_cut_on_open(tmp_path):
    log = filled(tmp_path, 2)
    log.close()
    with open(tmp_path / "q.spill", "ab") as f:
        f.write(b'{"n": 2')                      # crash in the middle of an append
    log = SpillLog(tmp_path / "q.spill")
    log.open()
    assert log.pending == 2
    log.append(json.dumps({"n": 3}))
    assert [e.item for e in log.read(10, parse)] == [0, 1, 3]
    log.close()


def test_cursor_beyond_size_means_truncated(tmp_path):
    log = filled(tmp_path, 2)
    log.close()
    (tmp_path / "q.spill").write_bytes(b"")     # crash between truncate and cursor reset
    (tmp_path / "q.spill.cursor").write_text("999")
    log = SpillLog(tmp_path / "q.spill")
    log.open()
    assert log.pending == 0
    log.append(json.dumps({"n": 5}))
    assert [e.item for e in log.read(10, parse)] == [5]
    log.close()


def test_corrupt_line_is_set_aside_once_and_skipped(tmp_path):
    log = filled(tmp_path, 1)
    log.append("not json")
    log.append(json.dumps({"n": 2}))
    first = log.read(10, parse)
    assert [e.item for e in first] == [0, None, 2]
    log.read(10, parse)                         # a retry must not copy the line again
    log.commit(first)
    assert (tmp_path / "q.spill.corrupt").read_text() == "not json\n"
    assert log.pending == 0
    log.close()


def test_second_owner_is_refused(tmp_path):
    log = filled(tmp_path, 0)
    other = SpillLog(tmp_path / "q.spill")
    with pytest.raises(PreconditionFailed) as exc:
        other.open()
    assert exc.value.reason == "SPILL_IN_USE"
    log.close()
    other.open()                                # free again once the owner closed it
    other.close()
