"""Client-side round robin over one upstream's replicas, skipping the ones that are down.

An endpoint goes down on an UNAVAILABLE answer or a connection failure (the transport calls
:meth:`RoundRobinBalancer.observe_error` or :meth:`mark_down`) and up again when the
gRPC health watcher (pool.Pool) reports SERVING (:meth:`mark_up`). Because a watch stream only reports
changes, an endpoint that failed while its health stayed SERVING would never hear a new
SERVING; so a down endpoint is also re-admitted after ``readmit_after_s`` for the next request
to probe it: it goes down again if that fails and up if it succeeds
(:meth:`observe_success`). With every endpoint down, ``pick``
raises NotReady(reason="NO_HEALTHY_UPSTREAM") with a hint of when the first one is re-admitted.
Endpoints are opaque strings ("host:port"); pool.Pool maps them to channels, and replaces them
(`set_endpoints`) when a stage named by DNS gains or loses pods (none at all before its first answer).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence

from shared.errors import KeelError, NotReady

# Errors raised on this side of the wire: they say nothing about the endpoint's health.
_LOCAL_REASONS = frozenset({"NO_HEALTHY_UPSTREAM"})


class RoundRobinBalancer:
    """Round robin for one upstream (e.g. "tokenizer"); clock injectable for tests."""

    def __init__(self, upstream: str, endpoints: Sequence[str], *, readmit_after_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        endpoints = list(dict.fromkeys(endpoints))
        if any(not e for e in endpoints):
            raise ValueError(f"upstream {upstream!r} has an empty endpoint")
        if readmit_after_s <= 0:
            raise ValueError("readmit_after_s must be > 0")
        self.upstream = upstream
        self._readmit_after_s = readmit_after_s
        self._clock = clock
        self._endpoints = endpoints
        self._down_since: dict[str, float] = {}
        self._next = 0

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(self._endpoints)

    def healthy(self) -> tuple[str, ...]:
        """Endpoints ``pick`` may return now (up, or down long enough to be re-admitted).

        Kept although only tests read it: the one view of the state that has no side effect
        (``pick`` starts a re-admission probe)."""
        return tuple(e for e in self._endpoints if self._eligible(e, self._clock()))

    def pick(self, choose: Callable[[Sequence[str]], str] | None = None, skip: Collection[str] = ()) -> str:
        """The next eligible endpoint in round-robin order, or the one ``choose`` takes from the
        eligible ones (given in that order). Eligible endpoints in ``skip`` are passed over and
        marked down (their health says they cannot serve)."""
        now = self._clock()
        n = len(self._endpoints)
        if not n:
            raise NotReady(f"no {self.upstream} endpoint known yet", reason="NO_HEALTHY_UPSTREAM",
                           metadata={"upstream": self.upstream})
        order = [self._endpoints[(self._next + step) % n] for step in range(n)]
        eligible = []
        for endpoint in order:
            if self._eligible(endpoint, now):
                if endpoint in skip:
                    self._down_since[endpoint] = now
                else:
                    eligible.append(endpoint)
        if not eligible:
            wait_s = min(self._down_since.values()) + self._readmit_after_s - now
            raise NotReady(f"no healthy {self.upstream} endpoint ({n} configured, all down)",
                           reason="NO_HEALTHY_UPSTREAM", metadata={"upstream": self.upstream},
                           retry_after_ms=max(0, math.ceil(wait_s * 1000)))
        endpoint = eligible[0] if choose is None else choose(eligible)
        self._next = (self._endpoints.index(endpoint) + 1) % n
        if endpoint in self._down_since:
            # Re-admission probe: restart the clock so concurrent requests do not all
            # pile onto an endpoint that is still recovering.
            self._down_since[endpoint] = now
        return endpoint

    def set_endpoints(self, endpoints: Sequence[str]) -> None:
        """The upstream's endpoints are now these: the ones that stay keep their state, new ones are up."""
        self._endpoints = list(dict.fromkeys(endpoints))
        self._down_since = {e: t for e, t in self._down_since.items() if e in self._endpoints}
        self._next = 0

    def mark_down(self, endpoint: str) -> bool:
        """Take ``endpoint`` out of rotation; False (ignored) if it is not in the current list,
        as happens when a health report races a re-resolution."""
        if endpoint not in self._endpoints:
            return False
        self._down_since[endpoint] = self._clock()
        return True

    def mark_up(self, endpoint: str) -> bool:
        """Put ``endpoint`` back in rotation; False (ignored) if it is not in the current list."""
        if endpoint not in self._endpoints:
            return False
        self._down_since.pop(endpoint, None)
        return True

    def observe_error(self, endpoint: str, err: KeelError) -> bool:
        """After a failed attempt: mark ``endpoint`` down if ``err`` is UNAVAILABLE from it."""
        if err.code != "UNAVAILABLE" or err.reason in _LOCAL_REASONS:
            return False
        return self.mark_down(endpoint)

    def observe_success(self, endpoint: str) -> None:
        """After a successful attempt: a re-admitted endpoint that answered is up again."""
        self.mark_up(endpoint)

    def _eligible(self, endpoint: str, now: float) -> bool:
        since = self._down_since.get(endpoint)
        return since is None or now - since >= self._readmit_after_s
