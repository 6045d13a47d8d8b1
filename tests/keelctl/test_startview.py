"""What `keel up` shows while a mesh starts (keelctl/startview.py): on a terminal (a pty) the lines
are redrawn in place and log lines land above them; off a terminal, one plain line per change."""
from __future__ import annotations

import asyncio
import fcntl
import io
import logging
import os
import pty
import struct
import termios
import threading

import grpc
import pytest

from keelctl import startview
from shared.stagestatus import Status, StatusBoard, StatusServicer

ESC = "\x1b["


@pytest.fixture
def stage():
    """A StageStatus server (grpc.aio, on its own loop in a thread) and its board."""
    board, started = StatusBoard(), threading.Event()
    box = {}

    def serve():
        async def main():
            server = grpc.aio.server()
            StatusServicer(board).register(server)
            box["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            box["stop"] = asyncio.Event()
            started.set()
            await box["stop"].wait()
            await server.stop(0)
        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30)
    yield board, f"127.0.0.1:{box['port']}"
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(10)


def targets(address: str) -> dict[str, tuple[str, str]]:
    return {f"inference@{address}": (address, "keel.inference.v1.Inference")}


def test_off_a_terminal_each_change_is_one_plain_line(stage, monkeypatch):
    monkeypatch.setattr(startview, "REFRESH_S", 0)
    board, address = stage
    name = f"inference@{address}"
    out = io.StringIO()
    view = startview.StartView(targets(address), out)
    board.phase("gating int8", total=200)
    for done in (0, 10, 20, 30, 100):
        board.advance(done)
        view.update({name: "NOT_SERVING"})
    view.update({name: "SERVING"})
    lines = out.getvalue().splitlines()
    assert ESC not in out.getvalue()
    # 0 and 10 of 200 are in the same tenth, so are 20 and 30; 100 is in another one
    assert [line.split("gating int8 ")[-1].split(",")[0] for line in lines[:-1]] == ["0/200", "20/200", "100/200"]
    assert lines[0].startswith(f"{name} NOT_SERVING") and lines[-1] == f"{name} SERVING"
    assert "about" in lines[1] and "left" in lines[1]


def test_on_a_terminal_the_block_is_redrawn_in_place_with_logs_above(stage, monkeypatch):
    monkeypatch.setattr(startview, "REFRESH_S", 0)
    board, address = stage
    name = f"inference@{address}"
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        view = startview.StartView(targets(address), tty)
        assert view.tty
        board.phase("gating int8", total=200)
        board.advance(20)
        view.update({name: "NOT_SERVING"})
        logger = logging.getLogger("keel.test-startview")
        logger.addHandler(startview.LogHandler(view))
        logger.propagate = False
        logger.warning("stage exited; restarting", extra={"stage": "inference-0.0", "exit_code": 2})
        logger.info("not for the terminal")
        board.advance(40)
        view.update({name: "NOT_SERVING"})
        view.finish()
    shown = b""
    while chunk := _read(master):
        shown += chunk
    text = shown.decode()
    assert f"{ESC}1F" in text and f"{ESC}2K" in text  # back up one line, clear it, draw again
    assert "gating int8 20/200" in text and "gating int8 40/200" in text
    assert "WARNING test-startview: stage exited; restarting (stage=inference-0.0 exit_code=2)" in text
    assert "not for the terminal" not in text
    # the log line comes before the redraw that follows it
    assert text.index("stage exited") < text.rindex("gating int8 20/200") < text.index("gating int8 40/200")


def test_on_a_narrow_terminal_each_line_is_cut_to_its_width(stage, monkeypatch):
    monkeypatch.setattr(startview, "REFRESH_S", 0)
    board, address = stage
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    with os.fdopen(slave, "w") as tty:
        view = startview.StartView(targets(address), tty)
        board.phase("gating int8, bfloat16, int4 and a long tail", total=200)
        view.update({f"inference@{address}": "NOT_SERVING"})
    shown = b""
    while chunk := _read(master):
        shown += chunk
    drawn = [line for line in shown.decode().split("\r\n") if "inference@" in line]
    assert drawn and all(len(line.split("\x1b[2K")[-1]) <= 39 for line in drawn)


def _read(fd: int) -> bytes:
    import select
    if not select.select([fd], [], [], 0.5)[0]:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def test_a_process_that_does_not_answer_or_just_serves_shows_its_health_only():
    assert startview.row("DOWN", None) == "DOWN"
    assert startview.row("SERVING", None) == "SERVING"
    assert startview.row("SERVING", Status("serving")) == "SERVING"


def test_a_serving_process_with_work_of_its_own_shows_it(stage):
    board, address = stage
    board.phase("gating int8 in the background", total=200)
    board.advance(50)
    shown = startview.row("SERVING", startview.stage_status(address))
    assert shown.startswith("SERVING ") and "gating int8 in the background 50/200" in shown
