"""Helpers for tests/deploy: which metric names a PromQL expression reads."""
from __future__ import annotations

import re

from shared.metrics import CATALOGUE

# Words PromQL uses that look like metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects; functions, labels, strings and Grafana variables removed."""
    s = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)                 # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)                # ranges, subqueries, [$__rate_interval]
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"\boffset\s+\S+", " ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)               # Grafana variables
    s = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue  # a function call or a keyword
        names.add(m.group(0))
    return names


def catalogue_series() -> set[str]:
    """Every series name shared/metrics.py exposes (histograms as _bucket/_sum/_count)."""
    return {name for spec in CATALOGUE for name in spec.sample_names()}
