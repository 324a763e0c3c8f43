"""A small progress bar for long work (artifact builds, graph capture), on stderr.

A process that configures its own logging (`slmrank serve`, service/observe/logs.py) sets a sink
with set_sink: progress lines and notes then go through it (as log records, e.g. JSON lines)
instead of being written to stderr as bare lines.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

# (message, fields) -> None; None: bare lines on the progress stream
_sink: Callable[[str, dict], None] | None = None


def set_sink(sink: Callable[[str, dict], None] | None) -> None:
    """Routes progress lines and notes (not a terminal's redrawn bar) through sink(message, fields)."""
    global _sink
    _sink = sink


def note(message: str, stream: TextIO | None = None) -> None:
    """A one-off line about long work (e.g. "building artifact ..."): the sink, or stderr."""
    if _sink is not None:
        _sink(message, {})
    else:
        (stream or sys.stderr).write(f"[slmrank] {message}\n")


class Progress:
    """`with Progress("build", total) as p: p.advance(n, note)`; quiet=True prints nothing.

    On a terminal it redraws one line; otherwise it prints a line every 10%, the last one (100%,
    "done") when the work ends.
    """

    def __init__(self, label: str, total: int, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.label, self.total, self.quiet = label, max(total, 1), quiet
        self.stream = stream or sys.stderr
        self.done, self._last_decile = 0, -1
        self._t0 = time.monotonic()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.quiet and exc[0] is None:
            self._draw("done", final=True)

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.done + n, self.total)
        if not self.quiet:
            self._draw(note)

    def _draw(self, note: str, final: bool = False) -> None:
        frac = self.done / self.total
        elapsed = time.monotonic() - self._t0
        if self.stream.isatty():
            bar = "#" * int(frac * 30)
            end = "\n" if final else ""
            self.stream.write(f"\r[{self.label}] [{bar:<30}] {self.done}/{self.total} {elapsed:5.1f}s {note[:40]:<40}{end}")
        else:
            decile = int(frac * 10)
            # the last advance reaches 100% and the end then says "done" at 100%: one line for both
            # (the end's), not the same line twice (as log records, twice for every bar)
            if (decile == self._last_decile or decile == 10) and not final:
                return
            self._last_decile = decile
            if _sink is not None:
                _sink(f"[{self.label}] {frac:4.0%} ({self.done}/{self.total}) {elapsed:.1f}s {note}".rstrip(),
                      {"progress": self.label, "done": self.done, "total": self.total, "elapsed_s": round(elapsed, 1)})
                return
            self.stream.write(f"[{self.label}] {frac:4.0%} ({self.done}/{self.total}) {elapsed:.1f}s {note}\n")
        self.stream.flush()
