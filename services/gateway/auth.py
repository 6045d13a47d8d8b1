"""Access checks for clients at the gateway: API keys (the mesh credential between stages is shared/meshauth.py).

API keys are stored hashed in config, never in clear. A stored hash is
``sha256$<salt hex>$<hex of sha256(salt || key)>`` (what :func:`hash_key` writes); a bare
64-hex unsalted sha256 is also accepted for configs written by hand with ``sha256sum``.
Keys are long random tokens, so one fast salted hash per configured key is enough: a slow KDF
would only add latency to every request.

Run: python -m services.gateway.auth hash KEY     (or ``hash -`` to read KEY from stdin)
     python -m services.gateway.auth new          (prints a fresh random key and its hash)

No grpc here: ``metadata`` is whatever the servicer has, a mapping or the
``(key, value)`` pairs of ``context.invocation_metadata()`` (pairs keep repeated headers, which
a mapping has already collapsed). A request that presents more than one key (two
``x-api-key`` headers, two ``authorization`` headers, or ``x-api-key`` and a Bearer token that
differ) is refused as AMBIGUOUS_API_KEY rather than picking one. Failed authentications count
per peer address and per key prefix; a blocked address still admits the keys that authenticated
from it before (:class:`services.gateway.ratelimit.AuthFailureLimiter`).
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

from services.gateway.ratelimit import AuthFailureLimit, AuthFailureLimiter
from shared import meshauth, proxyauth
from shared.errors import AMBIGUOUS_API_KEY, Unauthenticated

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"
_SALT_BYTES = 16
# Failures also count per the presented key's first this many characters: longer than any fixed
# prefix keys share ("keel_" from `new`), so each issued key has its own count.
KEY_PREFIX_CHARS = 12
_HEX64 = re.compile(r"[0-9a-f]{64}")

Metadata = Mapping[str, str] | Sequence[tuple[str, str | bytes]] | None


def header_values(metadata: Metadata, name: str) -> list[str]:
    """Every value of header ``name`` (case-insensitive, as gRPC lowercases keys), in order."""
    if not metadata:
        return []
    pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
    name = name.lower()
    return [value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            for key, value in pairs if key.lower() == name]


def header_value(metadata: Metadata, name: str) -> str | None:
    """First value of header ``name`` (case-insensitive, as gRPC lowercases keys), or None."""
    values = header_values(metadata, name)
    return values[0] if values else None


def peer_host(peer: str) -> str:
    """The address of a gRPC peer string without its port: ``ipv4:10.0.0.7:5123`` ->
    ``10.0.0.7``, ``ipv6:[::1]:5123`` (or %5B::1%5D) -> ``::1``; anything else as given."""
    scheme, _, rest = peer.partition(":")
    if scheme not in ("ipv4", "ipv6") or ":" not in rest:
        return peer
    host = rest.rsplit(":", 1)[0].replace("%5B", "[").replace("%5D", "]")
    return host.strip("[]")


def client_peer(metadata: Metadata, peer: str, proxy_token: str | None) -> str:
    """The peer whose authentication failures a call counts against: the client that a process
    fronting clients names (proxyauth.CLIENT_HEADER) beside the proxy credential ``proxy_token``,
    as ``client:<address>``; else the transport peer."""
    named, given = header_value(metadata, proxyauth.CLIENT_HEADER), header_value(metadata, proxyauth.HEADER)
    if named is None or given is None or proxy_token is None or not meshauth.same_secret(given, proxy_token):
        return peer
    return f"client:{named}"


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
    """The key from ``x-api-key`` or ``authorization: Bearer <key>``; None when neither is set.
    Unauthenticated AMBIGUOUS_API_KEY when a header is repeated or the two headers differ."""
    api_keys = header_values(metadata, API_KEY_HEADER)
    auths = header_values(metadata, AUTHORIZATION_HEADER)
    if len(api_keys) > 1 or len(auths) > 1:
        raise Unauthenticated(f"send one API key: the request has {len(api_keys)} "
                              f"'{API_KEY_HEADER}' and {len(auths)} '{AUTHORIZATION_HEADER}' headers",
                              reason=AMBIGUOUS_API_KEY)
    key = api_keys[0] if api_keys else None
    scheme, _, rest = (auths[0] if auths else "").partition(" ")
    bearer = rest.strip() if scheme.lower() == "bearer" else None
    if key and bearer and not hmac.compare_digest(key.encode(), bearer.encode()):
        raise Unauthenticated(f"'{API_KEY_HEADER}' and the Bearer token carry different keys; send one",
                              reason=AMBIGUOUS_API_KEY)
    return key or bearer or None


def key_prefix(metadata: Metadata) -> str | None:
    """What the per-prefix failure count keys on: a digest of the presented key's first
    KEY_PREFIX_CHARS characters (the limiter holds no key material); None without one key."""
    try:
        key = presented_api_key(metadata)
    except Unauthenticated:
        return None
    if not key:
        return None
    return "prefix:" + hashlib.sha256(key[:KEY_PREFIX_CHARS].encode("utf-8", "replace")).hexdigest()[:32]


class ApiKeyAuthenticator:
    """Checks a request's API key against the configured hashes and names the matching key.

    Failed authentications count per peer address and, in a second limiter with the same limits,
    per key prefix (``key_prefix``): guesses at one key's completion spread over many addresses are
    cut off too. While either is blocked, a request is refused before its key is looked at, unless
    its key already authenticated from that address (with that prefix); each refused try counts as
    a further failure, so the block doubles while a client keeps trying."""

    def __init__(self, entries: Iterable[ApiKeyEntry], failures: AuthFailureLimiter | None = None,
                 prefixes: AuthFailureLimiter | None = None):
        self._failures = failures or AuthFailureLimiter(AuthFailureLimit())
        self._prefixes = prefixes or AuthFailureLimiter(self._failures.limit, clock=self._failures.clock,
                                                        subject="keys with this prefix")
        self._entries: list[tuple[str, bytes, bytes]] = []
        seen: set[str] = set()
        for entry in entries:
            if not entry.key_id or entry.key_id in seen:
                raise ValueError(f"API key ids must be non-empty and unique: {entry.key_id!r}")
            seen.add(entry.key_id)
            salt, digest = _parse_stored(entry.key_hash)
            self._entries.append((entry.key_id, salt, digest))

    def authenticate(self, metadata: Metadata, peer: str = "") -> str:
        """Key id of the presented key; Unauthenticated MISSING_API_KEY / INVALID_API_KEY /
        AMBIGUOUS_API_KEY otherwise, each counted as a failure of ``peer`` (a gRPC peer string)
        and of the key's prefix; Overloaded AUTH_FAILURES_LIMITED while either is blocked, unless
        the key is one that already authenticated from both (other clients behind a shared
        address, the key's own holder)."""
        prefix = key_prefix(metadata)
        subjects = [(self._failures, peer_host(peer))] + ([(self._prefixes, prefix)] if prefix else [])
        blocked = [(limiter, subject) for limiter, subject in subjects if limiter.refusal(subject) is not None]
        if blocked:
            known = frozenset.intersection(*(limiter.known_keys(subject) for limiter, subject in blocked))
            try:
                key_id = self._check(metadata, among=known) if known else None
            except Unauthenticated:
                key_id = None
            if key_id is None:
                for limiter, subject in blocked:
                    limiter.failed(subject)  # a try while blocked: the block doubles
                raise next(limiter.refusal(subject) for limiter, subject in blocked)
            return key_id
        try:
            key_id = self._check(metadata)
        except Unauthenticated:
            for limiter, subject in subjects:
                limiter.failed(subject)
            raise
        for limiter, subject in subjects:
            limiter.succeeded(subject, key_id)
        return key_id

    def _check(self, metadata: Metadata, among: frozenset[str] | None = None) -> str:
        """Key id of the presented key, compared with every entry (or only those in ``among``)."""
        key = presented_api_key(metadata)
        if key is None:
            raise Unauthenticated("no API key: send it in 'x-api-key' or 'authorization: Bearer'",
                                  reason="MISSING_API_KEY")
        matched = None
        # Every entry is hashed and compared (no early exit) so the time taken does not say
        # which entry, or how much of a digest, matched.
        for key_id, salt, digest in self._entries:
            if among is not None and key_id not in among:
                continue
            if hmac.compare_digest(_digest(salt, key), digest):
                matched = key_id
        if matched is None:
            raise Unauthenticated("API key not recognised", reason="INVALID_API_KEY")
        return matched


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
