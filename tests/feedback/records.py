"""Writes feedback from synchronous test code (replay records: testing/records.py)."""
from __future__ import annotations

import asyncio


def upsert(store, items: list) -> list:
    """``store.upsert_feedback`` from synchronous code: an event loop per call, the write's own
    connection closed with it (a PostgreSQL asyncio connection belongs to the loop that opened it)."""
    async def once():
        try:
            return await store.upsert_feedback(items)
        finally:
            await store.close_writes()
    return asyncio.run(once())
