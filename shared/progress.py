"""Progress of a long command-line step (`keel lora register`, `keel verify determinism`, `keel etl
run`, `keel replay` of many): a tqdm bar on a terminal, plain lines anywhere else.

Off a terminal (a pipe, a CI log) a line is printed at the start, at each further tenth of a
counted step (every `PLAIN_EVERY` items of an uncounted one) and at the end: "probe runs: 24/48
(50%), 6.1 s". Lines that belong to the command's own output go through `write`, so on a terminal
they print above the bar instead of breaking it. The bar and the plain lines go to stderr by
default, leaving stdout to the command's results.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

PLAIN_EVERY = 1000  # items between plain lines when the total is unknown
FALLBACK_COLUMNS = 80  # for a terminal that reports no size (a fresh pty, some CI runners)


def _width(out: TextIO) -> dict:
    """tqdm's width: the terminal's, followed as it changes; a fixed one when it reports 0 columns,
    where tqdm would draw nothing."""
    try:
        columns = os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return {"dynamic_ncols": True} if columns else {"ncols": FALLBACK_COLUMNS}


class Progress:
    def __init__(self, desc: str, total: int | None = None, out: TextIO | None = None, tty: bool | None = None,
                 unit: str = "it"):
        self.desc, self.total, self.done = desc, total, 0
        self.out = out if out is not None else sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self._t0 = time.monotonic()
        self._mark = -1
        self._bar = tqdm(total=total, desc=desc, file=self.out, unit=unit, **_width(self.out)) if self.tty else None
        if self._bar is None:
            self._plain()

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._plain()

    def write(self, text: str, out: TextIO | None = None) -> None:
        """A line of the command's output (stdout by default), above the bar on a terminal."""
        out = out if out is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(text, file=out)
        else:
            out.write(text + "\n")
            out.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _plain(self) -> None:
        mark = (self.done * 10 // self.total if self.total else 0) if self.total is not None \
            else self.done // PLAIN_EVERY
        if mark != self._mark:
            self._mark = mark
            self._line()

    def _line(self, final: bool = False) -> None:
        count = f"{self.done}/{self.total} ({100 * self.done // self.total if self.total else 100}%)" \
            if self.total is not None else f"{self.done}"
        self.out.write(f"{self.desc}: {count}{' done' if final else ''}, {time.monotonic() - self._t0:.1f} s\n")
        self.out.flush()
