"""Tell the process's supervisor that the stage is serving: systemd's sd_notify protocol.

``NOTIFY_SOCKET`` names a Unix datagram socket (a leading ``@`` means Linux's abstract namespace);
``ready()`` sends it ``READY=1`` once, when the stage reports SERVING on grpc.health.v1. `keel up`
(keelctl/supervisor.py) uses it to tell a stage killed while serving from one that fails to start;
systemd (``Type=notify``) reads the same message. Without ``NOTIFY_SOCKET`` (Kubernetes, compose,
a stage run by hand) nothing is sent. Redis speaks the same protocol (``--supervised systemd``).
"""
from __future__ import annotations

import logging
import os
import socket

ENV = "NOTIFY_SOCKET"

log = logging.getLogger("keel.notify")


def address(name: str) -> str:
    """The socket address of a ``NOTIFY_SOCKET`` value: ``@x`` is ``x`` in the abstract namespace."""
    return "\0" + name[1:] if name.startswith("@") else name


def ready() -> None:
    name = os.environ.get(ENV)
    if not name:
        return
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"READY=1\n", address(name))
    except OSError as exc:  # the supervisor then treats a later death as a start-up failure
        log.warning("could not notify the supervisor", extra={"socket": name, "error": str(exc)})
