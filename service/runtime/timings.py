"""What running one batch took: the one record both runtimes return (BatchTimings), its per-node
entries (NodeTiming), and the host-side timer of a DAG walk that fills one (NodeTimer).

    CppRuntime     the C++ executor returns a plain tuple (cpp_dag/bindings.cpp, timings_tuple);
                   BatchTimings.from_executor is the one place that turns it into the record
    PythonRuntime  times its own walk with a NodeTimer (last_timings, as the C++ runtime's)
    the batcher    _ThreadExecutor times a synchronous runtime's walk through its trace hook, with
                   the pauses a heavy batch spends waiting for light ones (paused_ns)

Timestamps are host steady-clock nanoseconds (time.monotonic_ns, which is the C++ executor's
std::chrono::steady_clock); node times are milliseconds, device_ms -1 where nothing measured it.
A runtime that times on the host only has no copies of its own: h2d/launch are its start and d2h
its end (BatchTimings.host), the copies being inside the node times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NamedTuple


class NodeTiming(NamedTuple):
    name: str  # the DAG node's name
    host_ms: float  # host clock around the node's launch (eager), or its share of the replay (graph)
    device_ms: float  # device time between the node's events; -1 where there is no device timer


_tuple_new = tuple.__new__  # tuple.__new__(NodeTiming, (name, host_ms, device_ms)): a NodeTiming without
# the Python-level __new__ of a NamedTuple (a batch has ~30-150 of them)


@dataclass(frozen=True, slots=True)
class BatchTimings:
    submit_ns: int  # handed to the runtime (queued for a free lane)
    start_ns: int  # the run began (a lane took it)
    h2d_end_ns: int  # the inputs staged and their copies enqueued
    launch_ns: int  # the graph launched / the first node about to run
    d2h_end_ns: int  # the outputs back on the host
    done_ns: int  # the run ended (outputs cloned, node times read)
    graph: bool  # replayed from a captured CUDA graph (nodes have device times only)
    nodes: tuple[NodeTiming, ...]  # one per executed node, in DAG order
    paused_ns: int = 0  # inside start..done, waiting (a heavy batch paused for light ones), not running

    @classmethod
    def from_executor(cls, raw: tuple[Any, ...]) -> BatchTimings:
        """The C++ executor's timings tuple (submit_ns, start_ns, h2d_end_ns, launch_ns, d2h_end_ns,
        done_ns, graph, [(name, host_ms, device_ms)], paused_ns) as the record: the only conversion."""
        submit, start, h2d_end, launch, d2h_end, done, graph, nodes, paused = raw
        return cls(submit, start, h2d_end, launch, d2h_end, done, graph,
                   tuple([_tuple_new(NodeTiming, n) for n in nodes]), paused)

    @classmethod
    def host(cls, submit_ns: int, start_ns: int, done_ns: int, nodes: tuple[NodeTiming, ...] = (),
             paused_ns: int = 0) -> BatchTimings:
        """A run timed on the host only: no copies of its own (h2d and launch at its start, d2h at
        its end), no graph."""
        return cls(submit_ns, start_ns, start_ns, start_ns, done_ns, done_ns, False, nodes, paused_ns)

    @property
    def queue_ns(self) -> int:
        """Handed over -> started: waiting for a free lane."""
        return self.start_ns - self.submit_ns

    @property
    def run_ns(self) -> int:
        """The run itself: start -> done, less its pauses."""
        return self.done_ns - self.start_ns - self.paused_ns


class NodeTimer:
    """Host times of one DAG walk: lap(name) as each node ends; skip() where what ran since the
    last lap was no node's (a trace hook; a pause, whose ns it counts in paused_ns); timings() at
    the end."""

    __slots__ = ("submit_ns", "start_ns", "nodes", "paused_ns", "_last_ns")

    def __init__(self, submit_ns: int | None = None) -> None:
        self.start_ns = self._last_ns = time.monotonic_ns()
        self.submit_ns = self.start_ns if submit_ns is None else submit_ns
        self.nodes: list[NodeTiming] = []
        self.paused_ns = 0

    def lap(self, name: str) -> None:
        now_ns = time.monotonic_ns()
        self.nodes.append(_tuple_new(NodeTiming, (name, (now_ns - self._last_ns) / 1e6, -1.0)))
        self._last_ns = now_ns

    def skip(self, paused_ns: int = 0) -> None:
        """Since the last lap: no node's time, paused_ns of it spent waiting. The next node starts now."""
        self.paused_ns += paused_ns
        self._last_ns = time.monotonic_ns()

    def timings(self) -> BatchTimings:
        return BatchTimings.host(self.submit_ns, self.start_ns, time.monotonic_ns(), tuple(self.nodes),
                                 self.paused_ns)
