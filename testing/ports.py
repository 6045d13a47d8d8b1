"""Free loopback ports for the tests' and the benches' processes."""
from __future__ import annotations

import random
import socket
from typing import Callable, Iterable

_HANDED_OUT: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(derived: Callable[[int], Iterable[int]] = lambda port: ()) -> int:
    """A loopback port nobody listens on, below Linux's ephemeral range (32768+): a port the kernel
    handed out for ``bind(0)`` can be taken by an outgoing connection before a stage binds it.
    ``derived(port)``: the further ports a process given ``port`` binds (the supervisor's worker
    metrics ports); they must be free as well and are handed out with it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        ports = {port, *derived(port)}
        if ports & _HANDED_OUT or not all(20000 <= p < 32768 and _bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return port
