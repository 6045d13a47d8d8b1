"""The proxy credential: lets a process that fronts clients name the client each call is for.

The OpenAI HTTP server calls the gateway for all of its clients from its own address, and the
gateway counts failed authentications per address. With this credential the server names the
caller's address (CLIENT_HEADER) and the gateway counts by that address instead. The credential
grants nothing else: no stage accepts it in place of the mesh credential (meshauth.py), so the
internet-facing HTTP server holds no key to the inner stages.

`keel up` draws a random token per run and hands it to the processes in ``KEEL_PROXY_TOKEN``
(Kubernetes: key ``proxy-token`` of the ``keel-mesh`` Secret, given to the gateway and the HTTP server).
"""
from __future__ import annotations

import os

HEADER = "x-keel-proxy-token"
CLIENT_HEADER = "x-keel-client-address"
ENV = "KEEL_PROXY_TOKEN"


def token() -> str | None:
    """This process's proxy token, None when it has none."""
    return os.environ.get(ENV) or None


def on_behalf_of(address: str) -> list[tuple[str, str]]:
    """The headers of a call made for the client at ``address`` (nothing without a token: the
    address would not be believed)."""
    t = token()
    return [(HEADER, t), (CLIENT_HEADER, address)] if t and address else []
