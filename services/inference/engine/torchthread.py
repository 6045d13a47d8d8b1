"""The one thread that runs all of an inference process's torch work.

Why one: once another thread of the process has run an OpenMP parallel region (any parallel torch
op), every parallel region of the batching thread costs more. Measured with
`bench/probes/torch_thread.py`: a decode step of 16 rows takes 1.4x as long in fp32 and 1.7x in
bf16. So the stage loads the model, warms the engine up and runs its batching loop on this thread,
and nothing else in the process calls into torch.

A daemon thread (not a ThreadPoolExecutor, whose workers the interpreter joins at exit): an engine
that was never stopped must not keep the process alive.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class TorchThread:
    def __init__(self, name: str = "keel-torch"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, done = job
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as exc:  # handed to whoever waits on the future
                    done.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on the thread, after what was submitted before; a long-running fn (the
        batching loop) keeps the thread until it returns."""
        done: Future = Future()
        self._jobs.put((fn, args, done))
        return done

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the thread, awaited without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        """Finish what was submitted, then end the thread."""
        self._jobs.put(None)
        self._thread.join()
