"""The mesh credential, both sides: a shared secret every stage requires from its callers inside
the mesh (the gateway and other stages), sent in one metadata header.

`keel up` draws a random token per run and hands it to every process in ``KEEL_MESH_TOKEN``
(Kubernetes: a Secret). Callers attach it with ``outgoing()``; a stage checks it with ``check()``.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from shared import errors

HEADER = "x-keel-mesh-token"
ENV = "KEEL_MESH_TOKEN"


def token() -> str | None:
    """This process's mesh token, None when it has none (a stage then accepts any caller)."""
    return os.environ.get(ENV) or None


def outgoing() -> list[tuple[str, str]]:
    """The header a mesh caller attaches to every call (nothing when the process has no token)."""
    t = token()
    return [(HEADER, t)] if t else []


def check(expected: str, metadata: Mapping[str, str]) -> None:
    """Unauthenticated MISSING_MESH_CREDENTIAL / INVALID_MESH_CREDENTIAL unless the caller sent
    ``expected`` (compared by ``same_secret``)."""
    given = metadata.get(HEADER, "")
    if not given:
        raise errors.Unauthenticated("this stage accepts only calls from the Keel mesh",
                                     reason="MISSING_MESH_CREDENTIAL")
    if not same_secret(given, expected):
        raise errors.Unauthenticated("wrong mesh credential", reason="INVALID_MESH_CREDENTIAL")


def same_secret(given: str, expected: str) -> bool:
    """Whether two secrets are equal; fixed-length digests keep it constant-time in their length."""
    return hmac.compare_digest(hashlib.sha256(given.encode()).digest(), hashlib.sha256(expected.encode()).digest())
