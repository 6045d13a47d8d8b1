"""shared/durations.py: the durations operators type."""
from __future__ import annotations

import pytest

from shared.durations import parse_duration


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("15m", 900), ("1h30m", 5400),
                                           ("7d", 604800), ("2w", 1209600), ("0.5s", 0.5)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d7", "1x", "1h 30m", "0s", "-1h"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)
