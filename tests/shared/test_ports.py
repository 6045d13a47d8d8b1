"""testing/ports.py: a port handed out to one process is never handed out again, and a port whose
derived ports (a replica's worker metrics ports) are held elsewhere is skipped."""
from __future__ import annotations

import socket

from testing import ports


class Sequence:
    """random.Random stand-in whose randrange yields the given ports in order."""

    def __init__(self, values):
        self.values = iter(values)

    def randrange(self, lo, hi):
        return next(self.values)


def listener() -> socket.socket:
    """A listener on a port inside the range free_port draws from."""
    for port in range(24000, 32000, 13):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        s.listen()
        return s
    raise AssertionError("no free port to listen on")


def test_a_port_whose_derived_port_is_held_is_skipped(monkeypatch):
    held = listener()
    try:
        taken = held.getsockname()[1]
        # a base whose worker port (base + 10) is the held one, then a base clear of it
        clear = next(p for p in range(20000, 32000, 37) if p != taken - 10 and p + 10 != taken
                     and p not in ports._HANDED_OUT and p + 10 not in ports._HANDED_OUT)
        monkeypatch.setattr(ports.random, "Random", lambda: Sequence([taken - 10, clear]))
        assert ports.free_port(lambda p: [p + 10]) == clear
        assert {clear, clear + 10} <= ports._HANDED_OUT
    finally:
        held.close()


def test_a_derived_port_is_never_handed_out_again(monkeypatch):
    base = next(p for p in range(20001, 32000, 41) if p not in ports._HANDED_OUT and p + 10 not in ports._HANDED_OUT
                and p + 20 not in ports._HANDED_OUT)
    monkeypatch.setattr(ports.random, "Random", lambda: Sequence([base, base + 10, base + 20]))
    assert ports.free_port(lambda p: [p + 10]) == base
    assert ports.free_port() == base + 20  # base + 10 went out with base
