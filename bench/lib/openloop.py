"""The benchmarks' open-loop sender: calls started on a fixed schedule whatever the answers do."""
from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable


async def at_rate(one: Callable[[int, float], Awaitable[None]], n: int, rate: float) -> float:
    """Start ``one(i, due)`` for each i < n at its ``due`` time (t0 + i / rate, perf_counter
    seconds), wait for them all and return t0. The sender's own pauses would count as the latency
    of what it measures: its heap so far is frozen out of the collector's walks meanwhile, and it
    keeps only the calls still in flight."""
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    pending: set[asyncio.Task] = set()
    for i in range(n):
        due = t0 + i / rate
        if (delay := due - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending)
    gc.unfreeze()
    return t0
