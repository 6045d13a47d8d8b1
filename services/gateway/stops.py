"""Stop strings on the answer's text: cut before the first occurrence of any, holding back text
while a stop string may be starting.

The inference stage ends generation at the token whose bytes complete a stop string
(services/inference/engine/controls.py); the text that token and its predecessors decode to holds that
stop string, so the gateway finds it there too and cuts before it. While streaming, the longest
tail of the text so far that is the start of some stop string is held back, and released with
the next delta once what follows shows it is not one (or at the end of the answer).
"""
from __future__ import annotations


class StopText:
    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.cut = False      # a stop string was found: nothing more is released
        self._held = ""

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held back) that can go to the client now."""
        if self.cut:
            return ""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.cut, self._held = True, ""
            return buf[:min(hits)]
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """The end of the answer: whatever was held back was no stop string after all."""
        held, self._held = self._held, ""
        return "" if self.cut else held

    def whole(self, text: str) -> str:
        """The whole answer at once, cut before its first stop string."""
        return self.feed(text) + self.flush()
