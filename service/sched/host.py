"""How much of the CPU this process got while it wanted it: the share that tells a batch slowed by
the host (another process on the cores) from the executor's own service time.

Linux keeps, per thread, the time it ran and the time it waited on a run queue, ready to run but
with no CPU free (/proc/self/task/<tid>/schedstat: run ns, wait ns, slices). Over an interval,

    share = Σ run / Σ (run + wait)    over this process's threads

is 1 on a host that gives the process every core it asks for, and falls as other processes take
them (a CPU hog beside a 2-thread batch on 2 cores: about 2/3). The ServiceTimeModel reads it at
a batch's start and end; a batch run at a low share is "starved": it took longer than the
executor would on an idle host, by about 1 / share.

Reading costs ~20 µs a thread, so the totals are read at most every `min_interval_s` (a shorter
batch gets the share of the interval around it: the host's load changes slowly). Elsewhere than
Linux (no schedstat) `read` returns None and nothing is ever counted as starved.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

TASKS = "/proc/self/task"


class CpuShare:
    """Cumulative run and wait seconds of this process's threads (module docstring)."""

    def __init__(self, min_interval_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.min_interval_s, self.clock = min_interval_s, clock
        self._per_thread: dict[str, tuple[int, int]] = {}
        self._run_ns = self._wait_ns = 0
        self._read_at = -float("inf")
        self.recent = 1.0  # the share over the interval between the last two scans
        self.available = os.path.exists("/proc/thread-self/schedstat")

    def read(self) -> tuple[float, float] | None:
        """(run s, wait s) summed over the threads since the first read; None where unknown."""
        if not self.available:
            return None
        now = self.clock()
        if now - self._read_at >= self.min_interval_s:
            self._read_at = now
            self._scan()
        return self._run_ns / 1e9, self._wait_ns / 1e9

    def _scan(self) -> None:
        seen: dict[str, tuple[int, int]] = {}
        run0, wait0 = self._run_ns, self._wait_ns
        try:
            tids = os.listdir(TASKS)
        except OSError:
            return
        for tid in tids:
            try:
                with open(f"{TASKS}/{tid}/schedstat", "rb") as f:
                    fields = f.read().split()
                run, wait = int(fields[0]), int(fields[1])
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
            last_run, last_wait = self._per_thread.get(tid, (0, 0))  # a new thread: all it did is new
            self._run_ns += max(run - last_run, 0)
            self._wait_ns += max(wait - last_wait, 0)
            seen[tid] = (run, wait)
        self._per_thread = seen  # threads gone are forgotten (their time stays counted)
        if run0 or wait0:
            self.recent = share_between((run0, wait0), (self._run_ns, self._wait_ns), self.recent)


def share_between(before: tuple[float, float] | None, after: tuple[float, float] | None,
                  fallback: float = 1.0) -> float:
    """The CPU share over an interval from two reads (`fallback` when nothing was read between
    them, 1.0 when unknown)."""
    if before is None or after is None:
        return 1.0
    run, wait = after[0] - before[0], after[1] - before[1]
    if run + wait <= 0:
        return fallback
    return min(max(run / (run + wait), 0.0), 1.0)


__all__ = ["CpuShare", "share_between"]
