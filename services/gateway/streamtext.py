"""The text of a streamed answer, decoded by the tokenizer's DecodeStream as the ids arrive.

The tokenizer keeps one exact byte-level stream decoder per stream (services/tokenizer/decoding.py):
each batch of ids sent returns exactly the text those ids complete, a character split across tokens
comes out whole with the token that completes it, and the texts concatenated equal the decoding of
every id. So the gateway holds nothing back and never decodes the answer a second time.

Each batch is one attempt under the gateway's retry policy. A failed attempt drops the stream; the
retry opens a new one and sends every id so far. Its answer is the decoding of all of them cut at a
whole character, which begins with the text already returned (a prefix of a stream's output is the
decoding of a prefix of the bytes): that part is skipped, so nothing is sent to the client twice.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Protocol


class DecodeStream(Protocol):
    """One open DecodeStream call (services/gateway/upstreams.py)."""

    async def send(self, ids: list[int], finish: bool) -> str: ...
    def close(self) -> None: ...


# Opens a DecodeStream: (timeout_s, metadata) -> the open stream.
Opener = Callable[[float, dict], Awaitable[DecodeStream]]


class StreamedText:
    def __init__(self, open_stream: Opener):
        self._open = open_stream
        self._stream: DecodeStream | None = None
        self.ids: list[int] = []
        self.text = ""

    def attempt(self, new_ids: list[int], finish: bool) -> Callable[[float, dict], Awaitable[str]]:
        """Add ``new_ids``; the returned attempt function (for RetryExecutor) gives the new text.
        ``finish``: the answer is complete, flush what the decoder holds back."""
        start = len(self.ids)
        self.ids.extend(new_ids)

        async def run(timeout: float, md: dict) -> str:
            replay = self._stream is None
            if replay:
                self._stream = await self._open(timeout, md)
            try:
                text = await self._stream.send(self.ids if replay else self.ids[start:], finish)
            except BaseException:
                self.close()
                raise
            if replay:
                text = text[len(self.text):]
            self.text += text
            if finish:
                self._stream = None  # the tokenizer ends the stream after a finish
            return text
        return run

    def close(self) -> None:
        """Abandon the open stream, if any."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
