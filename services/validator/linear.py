"""Regexes that run in time linear in the text: the input rules' engine.

Input rules (and the regexes of the output checks) are matched on text an attacker chooses or
steers, so they run on RE2 (PyPI ``google-re2``),
an automaton engine with no backtracking: a pattern such as ``\\{\\{.*?\\}\\}`` costs one pass
over the text, where Python's backtracking ``re`` needs time quadratic in a prompt of
repeated ``{{``. RE2 also releases the GIL while it matches, so a long match does not stall
the other threads of the process. The price is RE2's syntax: no lookaround and no
backreferences, which :func:`compile_linear` reports as a ValueError at config load.
"""
from __future__ import annotations

import re2


def compile_linear(pattern: str, *, dot_all: bool = True, ignore_case: bool = False):
    """RE2 compilation of ``pattern``; ``dot_all``: ``.`` matches newlines (``re.DOTALL``),
    ``ignore_case`` as ``re.IGNORECASE``. ValueError names the construct RE2 does not support."""
    options = re2.Options()
    options.dot_nl = dot_all
    options.case_sensitive = not ignore_case
    options.log_errors = False   # the ValueError below carries the message
    try:
        return re2.compile(pattern, options=options)
    except re2.error as exc:
        detail = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(f"not a linear-time (RE2) pattern: {detail}") from None
