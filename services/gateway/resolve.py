"""Replicas named by DNS. A target `dns:///NAME:PORT` (on Kubernetes a headless Service, whose name
resolves to one address per ready pod) stands for every address NAME resolves to, each a replica of
its own: the gateway's router needs to know which pod it sends a prompt to (one Service address
would hide that). pool.Pool re-resolves it every `upstreams.resolve_interval_s`, opening
replicas for new addresses and closing the ones gone.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence

DNS = "dns:///"
# (host, port) -> "address:port" of each replica the name stands for now; raises OSError when it cannot tell
Resolver = Callable[[str, int], Awaitable[list[str]]]


def named(target: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:///host:port` target; None for a replica's own address."""
    if not target.startswith(DNS):
        return None
    host, _, port = target[len(DNS):].rpartition(":")
    return host, int(port)


async def getaddrinfo(host: str, port: int) -> list[str]:
    """The addresses the system resolver gives `host` now (IPv6 in brackets), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{a[0]}]:{port}" if family == socket.AF_INET6 else f"{a[0]}:{port}"
                   for family, _, _, _, a in infos})


async def expand(targets: Sequence[str], resolver: Resolver) -> tuple[str, ...]:
    """The replicas `targets` stand for now, in order, each once (raises OSError as `resolver` does)."""
    out: list[str] = []
    for t in targets:
        name = named(t)
        out += [t] if name is None else await resolver(*name)
    return tuple(dict.fromkeys(out))
