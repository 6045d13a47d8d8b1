"""The supervisor's end of sd_notify (shared/notify.py): which child processes reported READY=1.

One Unix datagram socket in the abstract namespace (no file to clean up, even after kill -9; no
path-length limit), named in every child's ``NOTIFY_SOCKET``. The kernel stamps each datagram with
its sender's pid (SO_PASSCRED), so a message counts only for the child process that sent it, never
for a restarted process of the same name or for anyone else who found the socket.
"""
from __future__ import annotations

import os
import secrets
import socket
import struct

from shared import notify

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ReadySocket:
    def __init__(self) -> None:
        self.name = f"@keel-supervisor-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(notify.address(self.name))

    def ready_pids(self) -> list[int]:
        """Pids that sent READY=1 since the last call, in arrival order (never blocks)."""
        pids = []
        while True:
            try:
                msg, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
            except BlockingIOError:
                return pids
            sender = next((_UCRED.unpack(data[:_UCRED.size])[0] for level, kind, data in ancillary
                           if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), None)
            if sender and b"READY=1" in msg.splitlines():
                pids.append(sender)

    def close(self) -> None:
        self._sock.close()
