"""The messages other threads send the step loop (loop.py) through its inbox, one type per command.

The loop thread alone changes the rows, the queue and the counters; every other thread only puts one
of these on the inbox, and the loop applies them between two steps, in the order they arrived.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from services.inference.engine.admission import Ticket
from services.inference.engine.cachewatch import CacheWatch
from shared.errors import KeelError


@dataclass(frozen=True)
class Submit:
    """Admit the request, or queue it (refused with a reason when neither is possible)."""

    ticket: Ticket


@dataclass(frozen=True)
class Cancel:
    """Drop the request: from the queue, or from the running batch (its cache freed) before its next step."""

    ticket: Ticket


@dataclass(frozen=True)
class SetVariant:
    """Make the variant `name` serve the rows created from the next iteration on; `done` gets the Switch."""

    name: str
    actor: str
    done: Future


@dataclass(frozen=True)
class Refused:
    """Count a request the engine refused without submitting it (the counters are the loop's)."""

    error: KeelError


@dataclass(frozen=True)
class Watch:
    """Tell `watch` what the prefix cache holds now, then every change (a WatchCache stream began)."""

    watch: CacheWatch


@dataclass(frozen=True)
class Stop:
    """End the loop; every request still queued or running gets `error`."""

    error: Exception


Command = Submit | Cancel | SetVariant | Refused | Watch | Stop
