"""Durations as operators type them (``keel replay --since 24h``, ``keel quarantine purge --older-than
7d``, the rotation's ``resample.since``)."""
from __future__ import annotations

import re

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> float:
    """``90s``, ``15m``, ``12h``, ``7d``, ``2w`` or sums like ``1h30m`` -> seconds (> 0)."""
    text = text.strip().lower()
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"bad duration {text!r}; use e.g. 30m, 12h, 7d, 1h30m")
    seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError("duration must be > 0")
    return seconds
