"""Group commit of feedback items: many Submit calls written by one transaction, off the event loop.

Each call puts its item on a bounded queue and waits for its own result. One task takes what is
queued (up to ``max_batch`` items) and writes it with ``write`` (services/feedback/upsert.py:
what would block runs in a worker thread), one transaction and one commit for the lot; while that
commit runs, new items gather for the next one. Under load a commit serves many calls; a lone item
on an idle stage is written at once (there is no timer to wait for). A call is answered only after
the transaction that holds its item committed, so a reply means the row is in the database; when
the write fails, every call of the batch gets the error (the database down: NotReady with a retry
hint) and nothing of it is counted as written. A full queue makes new calls wait for room (their
deadlines bound the wait), so memory stays bounded however many clients send at once. A call
cancelled while queued (its client gave up) is left out of the batch: it was never answered, and a
client that sends it again updates nothing twice because a feedback_id is written once however
often it is sent.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from services.feedback.records import Feedback
from shared import errors

log = logging.getLogger("keel.feedback")

Result = bool | errors.KeelError  # True created, False updated, or the item's own error
STREAM_WINDOW = 64  # batches of one stream taken ahead of their answers; then the stream waits


class SubmitBatcher:
    def __init__(self, write: Callable[[list[Feedback]], Awaitable[list[Result]]], *, max_batch: int, queue_size: int):
        self._write, self._max = write, max_batch
        self._queue: asyncio.Queue[tuple[Feedback, asyncio.Future]] = asyncio.Queue(queue_size)
        self._task: asyncio.Task | None = None
        self._draining = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stop taking batches; calls still queued get NotReady (their clients retry elsewhere)."""
        if self._task is not None:
            self._task.cancel()
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if not fut.done():
                fut.set_exception(errors.NotReady("the feedback stage is shutting down",
                                                  reason=errors.SHUTTING_DOWN, retry_after_ms=1000))

    def begin_drain(self) -> None:
        """Streams stop taking batches, answer the ones they took, and end (see ``answer_stream``)."""
        self._draining.set()

    async def answer_stream(self, batches: AsyncIterator[list[Feedback]]
                            ) -> AsyncIterator[tuple[list[Feedback], list[Result]]]:
        """Each batch with its results (as ``submit_many``), in the order the batches came. A batch is taken
        while earlier ones are still being written, so consecutive batches share commits; at most
        ``STREAM_WINDOW`` wait for their answers, and then no further batch is taken until one is
        answered. Once the stage drains, no further batch is taken: the ones taken are answered,
        then NotReady SHUTTING_DOWN ends the stream (whatever was not taken was not written)."""
        window = asyncio.Semaphore(STREAM_WINDOW)
        answers: asyncio.Queue[tuple[list[Feedback], asyncio.Task] | None] = asyncio.Queue()  # <= the window

        async def take() -> None:
            try:
                async for items in batches:
                    await window.acquire()
                    answers.put_nowait((items, asyncio.create_task(self.submit_many(items))))
            finally:
                answers.put_nowait(None)
        reader = asyncio.create_task(take())
        drain = asyncio.create_task(self._draining.wait())
        drain.add_done_callback(lambda _: reader.cancel())
        try:
            while (taken := await answers.get()) is not None:
                results = await taken[1]
                window.release()
                yield taken[0], results
            if self._draining.is_set():
                raise errors.NotReady("the feedback stage is shutting down; send the rest to another replica",
                                      reason=errors.SHUTTING_DOWN, retry_after_ms=1000)
            reader.result()  # the request stream's own failure, if it broke
        finally:
            drain.cancel()
            reader.cancel()
            while not answers.empty():
                taken = answers.get_nowait()
                if taken is not None:
                    taken[1].cancel()

    async def submit(self, fb: Feedback) -> bool:
        """True when created, False when updated; the item's error (InvalidInput, NotFound, NotReady) raised."""
        (result,) = await self.submit_many([fb])
        if isinstance(result, errors.KeelError):
            raise result
        return result

    async def submit_many(self, items: list[Feedback]) -> list[Result]:
        """Each item's result in order, once every item is committed or failed. The items are
        queued in order (a feedback_id repeated later updates the earlier one); a malformed item
        gets its InvalidInput at once, even while the database is down, and is never queued."""
        loop = asyncio.get_running_loop()
        results: list[Result | None] = [None] * len(items)
        queued: list[tuple[int, asyncio.Future[Result]]] = []
        for i, fb in enumerate(items):
            try:
                fb.check()
            except errors.InvalidInput as exc:
                results[i] = exc
                continue
            fut: asyncio.Future[Result] = loop.create_future()
            await self._queue.put((fb, fut))
            queued.append((i, fut))
        # gather: a caller that gives up cancels its items still queued, so no batch takes them.
        for (i, _), result in zip(queued, await asyncio.gather(*(fut for _, fut in queued))):
            results[i] = result
        return results  # type: ignore[return-value]  # every slot is filled above

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [(fb, fut) for fb, fut in batch if not fut.done()]
            if not batch:
                continue
            items = [fb for fb, _ in batch]
            try:
                results = await self._write(items)
            except errors.KeelError as exc:
                results = [exc] * len(batch)
            except Exception as exc:  # noqa: BLE001 - a dead batcher would hang every later call
                log.exception("feedback batch failed", extra={"items": len(batch)})
                results = [errors.NotReady(f"the feedback write failed: {exc}", reason="DATABASE_UNAVAILABLE",
                                           retry_after_ms=1000)] * len(batch)
            for (_, fut), result in zip(batch, results):
                if not fut.done():
                    fut.set_result(result)
