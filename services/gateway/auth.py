"""Access checks: client API keys at the gateway, the shared mesh credential at the stages.

API keys are stored hashed in config, never in clear. A stored hash is
``sha256$<salt hex>$<hex of sha256(salt || key)>`` (what :func:`hash_key` writes); a bare
64-hex unsalted sha256 is also accepted for configs written by hand with ``sha256sum``.
Keys are long random tokens, so one fast salted hash per configured key is enough: a slow KDF
would only add latency to every request.

Run: python -m services.gateway.auth hash KEY     (or ``hash -`` to read KEY from stdin)
     python -m services.gateway.auth new          (prints a fresh random key and its hash)

No grpc here: ``metadata`` is whatever the servicer has, a mapping or the
``(key, value)`` pairs of ``context.invocation_metadata()``.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import re
import secrets
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.errors import Unauthenticated

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"
MESH_HEADER = "x-keel-mesh-token"  # the name shared/interceptor.py reads
_SALT_BYTES = 16
_HEX64 = re.compile(r"[0-9a-f]{64}")

Metadata = Mapping[str, str] | Sequence[tuple[str, str | bytes]] | None


def header_value(metadata: Metadata, name: str) -> str | None:
    """First value of header ``name`` (case-insensitive, as gRPC lowercases keys), or None."""
    if not metadata:
        return None
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    name = name.lower()
    for key, value in pairs:
        if key.lower() == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode("utf-8")).digest()


def hash_key(key: str, *, salt: bytes | None = None) -> str:
    """Salted sha256 of an API key, in the form stored in config."""
    if not key:
        raise ValueError("an API key must not be empty")
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    return f"sha256${salt.hex()}${_digest(salt, key).hex()}"


def _parse_stored(stored: str) -> tuple[bytes, bytes]:
    """(salt, digest) of a stored hash; ValueError names what is wrong with it."""
    stored = stored.strip().lower()
    if _HEX64.fullmatch(stored):
        return b"", bytes.fromhex(stored)
    parts = stored.split("$")
    if len(parts) != 3 or parts[0] != "sha256" or not _HEX64.fullmatch(parts[2]):
        raise ValueError("stored key hash must be 'sha256$<salt hex>$<64 hex>' or 64 hex chars")
    try:
        salt = bytes.fromhex(parts[1])
    except ValueError:
        raise ValueError("stored key hash has a salt that is not hex") from None
    return salt, bytes.fromhex(parts[2])


@dataclass(frozen=True)
class ApiKeyEntry:
    """One configured client: ``key_id`` is what logs show, ``key_hash`` what ``hash_key`` wrote."""

    key_id: str
    key_hash: str


def presented_api_key(metadata: Metadata) -> str | None:
    """The key from ``x-api-key`` or ``authorization: Bearer <key>``; None when neither is set."""
    key = header_value(metadata, API_KEY_HEADER)
    if not key:
        auth = header_value(metadata, AUTHORIZATION_HEADER) or ""
        scheme, _, rest = auth.partition(" ")
        key = rest.strip() if scheme.lower() == "bearer" else None
    return key or None


class ApiKeyAuthenticator:
    """Checks a request's API key against the configured hashes and names the matching key."""

    def __init__(self, entries: Iterable[ApiKeyEntry]):
        self._entries: list[tuple[str, bytes, bytes]] = []
        seen: set[str] = set()
        for entry in entries:
            if not entry.key_id or entry.key_id in seen:
                raise ValueError(f"API key ids must be non-empty and unique: {entry.key_id!r}")
            seen.add(entry.key_id)
            salt, digest = _parse_stored(entry.key_hash)
            self._entries.append((entry.key_id, salt, digest))

    def authenticate(self, metadata: Metadata) -> str:
        """Key id of the presented key; Unauthenticated MISSING_API_KEY / INVALID_API_KEY otherwise."""
        key = presented_api_key(metadata)
        if key is None:
            raise Unauthenticated("no API key: send it in 'x-api-key' or 'authorization: Bearer'",
                                  reason="MISSING_API_KEY")
        matched = None
        # Every entry is hashed and compared (no early exit) so the time taken does not say
        # which entry, or how much of a digest, matched.
        for key_id, salt, digest in self._entries:
            if hmac.compare_digest(_digest(salt, key), digest):
                matched = key_id
        if matched is None:
            raise Unauthenticated("API key not recognised", reason="INVALID_API_KEY")
        return matched


class MeshCredential:
    """The shared secret a stage requires from its mesh callers (gateway and other stages)."""

    def __init__(self, secret: str):
        if len(secret) < 16:
            raise ValueError("the mesh secret must be at least 16 characters")
        self._secret = secret
        self._digest = hashlib.sha256(secret.encode("utf-8")).digest()

    def outgoing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata a mesh caller attaches to every call to a stage."""
        return ((MESH_HEADER, self._secret),)

    def check(self, metadata: Metadata) -> None:
        """Unauthenticated MISSING_MESH_CREDENTIAL / INVALID_MESH_CREDENTIAL unless the secret matches."""
        presented = header_value(metadata, MESH_HEADER)
        if not presented:
            raise Unauthenticated("stages accept calls only from the Keel mesh",
                                  reason="MISSING_MESH_CREDENTIAL")
        # Comparing fixed-length digests keeps the comparison constant-time in the secret's length.
        if not hmac.compare_digest(hashlib.sha256(presented.encode("utf-8")).digest(), self._digest):
            raise Unauthenticated("mesh credential not recognised", reason="INVALID_MESH_CREDENTIAL")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway.auth",
                                     description="Make API key hashes for the gateway config.")
    sub = parser.add_subparsers(dest="command", required=True)
    hash_cmd = sub.add_parser("hash", help="print the salted hash of KEY ('-' reads stdin)")
    hash_cmd.add_argument("key")
    sub.add_parser("new", help="print a fresh random key and its hash")
    args = parser.parse_args(argv)
    if args.command == "new":
        key = "keel_" + secrets.token_urlsafe(32)
        print(f"key:  {key}\nhash: {hash_key(key)}")
        return 0
    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    if not key:
        print("error: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
