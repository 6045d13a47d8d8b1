"""Free loopback ports for the tests' and the benches' processes."""
from __future__ import annotations

import random
import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, below Linux's ephemeral range (32768+): a port the kernel
    handed out for ``bind(0)`` can be taken by an outgoing connection before a stage binds it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
