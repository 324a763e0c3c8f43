"""What one request's life leaves behind, in time.monotonic_ns: the scheduler's RequestTimings,
the server's RequestTrace (stages from explicit timestamps, bound to the running RPC), and the span
tree that `build_records` makes of them.

A request's life comes from three places:

    server      RequestTrace.add_stage / stage(): receive (request bytes -> proto), decode
                (proto -> request, validation), tokenize (inside decode), encode, send (proto -> bytes)
    scheduler   Completed.timings: queue (admitted -> taken into a batch), batch (packing), execute
                (handed to the executor -> results back on the event loop)
    executor    RequestTimings.executor (a BatchTimings): executor_queue, h2d, launch, one span per DAG
                node, d2h, unpack

`build_records` turns them into one tree of SpanRecords (the request at index 0, every child inside
its parent's interval); the OTel and Chrome renderers (tracing.py, chrome_trace.py) only draw that
tree. With a replayed CUDA graph the nodes have device times only: they are laid back to back from
the graph launch; eager nodes are laid out by their host times.
"""

from __future__ import annotations

import contextvars
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime.requests import BeamResult, ScoreResult
from ..runtime.timings import BatchTimings

# time.monotonic_ns -> time.time_ns, measured once per process: durations stay monotonic
WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


@dataclass(frozen=True)
class RequestTimings:
    """Scheduler times are in the Scheduler's clock (seconds; time.monotonic by default). The
    executor's BatchTimings is the runtime's own, shared by the batch (service/runtime/timings.py:
    time.monotonic_ns stamps, a NodeTiming per node). For a runtime without `submit`, h2d/launch
    equal start and d2h equals done: the copies are inside the node times."""

    priority: enum.Enum  # the request's admission priority (service.sched.admission.Priority)
    enqueued_s: float  # admitted
    dequeued_s: float  # taken into a batch
    batch_start_s: float  # handed to the executor
    batch_end_s: float  # results back on the event loop
    batch_id: int
    batch_size: int  # whole requests in the batch
    batch_index: int  # this request's place in the batch
    bucket: str
    executor: BatchTimings

    @property
    def queue_wait_s(self) -> float:
        return self.dequeued_s - self.enqueued_s


@dataclass(frozen=True)
class Completed:
    result: ScoreResult | BeamResult
    timings: RequestTimings


# ---- one request's timestamps ----------------------------------------------------------------------

class RequestTrace:
    """What the server saw of one request, in time.monotonic_ns. Cheap: a few appends per request."""

    __slots__ = ("kind", "start_ns", "end_ns", "stages", "attrs", "timings", "status", "traceparent")

    def __init__(self, kind: str, start_ns: int | None = None, traceparent: str | None = None) -> None:
        self.kind = kind  # "Score" / "BeamSearch": the request span's name
        self.start_ns = time.monotonic_ns() if start_ns is None else start_ns
        self.end_ns: int | None = None  # set by finish
        self.stages: list[tuple[str, int, int]] = []  # (name, start_ns, end_ns); a repeated name is merged
        self.attrs: dict[str, Any] = {}
        self.timings: RequestTimings | None = None
        self.status = "OK"  # a grpc.StatusCode name
        self.traceparent = traceparent  # W3C trace context of the caller, if it sent one

    def add_stage(self, name: str, start_ns: int, end_ns: int) -> None:
        self.stages.append((name, start_ns, end_ns))

    def stage(self, name: str) -> _StageTimer:
        """`with trace.stage("decode"): ...` times the block (also when it raises)."""
        return _StageTimer(self, name)

    def set(self, **attrs: Any) -> None:
        self.attrs.update(attrs)

    def set_request(self, request: Any, priority: Any) -> None:
        """Attributes of a decoded (valid) ScoreRequest / BeamRequest: its shape, never its content
        (samples, each sample's tokens, prefix tokens, labels; or prompt tokens, beam width, new
        tokens), its tokens and priority. `slmrank traffic` reads them from the access log."""
        if hasattr(request, "num_samples"):
            self.attrs.update(samples=request.num_samples, sample_tokens=list(map(len, request.samples)),
                              prefix_tokens=len(request.prefix_ids), tokens=request.num_tokens,
                              labels=len(request.label_ids))
        else:
            self.attrs.update(prompt_tokens=len(request.prompt_ids), beam_width=request.beam_width,
                              new_tokens=request.new_tokens, tokens=len(request.prompt_ids))
        self.attrs["priority"] = getattr(priority, "name", str(priority))

    def completed(self, done: Completed) -> None:
        """The scheduler's answer: its timings give queue, batch, execute and the DAG nodes."""
        self.timings = done.timings

    @property
    def is_finished(self) -> bool:
        return self.end_ns is not None

    @property
    def latency_ns(self) -> int:
        end = time.monotonic_ns() if self.end_ns is None else self.end_ns
        return end - min([self.start_ns, *(s for _, s, _ in self.stages)])


class _StageTimer:
    __slots__ = ("trace", "name", "start_ns")

    def __init__(self, trace: RequestTrace, name: str) -> None:
        self.trace, self.name, self.start_ns = trace, name, 0

    def __enter__(self) -> _StageTimer:
        self.start_ns = time.monotonic_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        self.trace.stages.append((self.name, self.start_ns, time.monotonic_ns()))


# A context variable, not a global: each RPC runs in its own task, whose deserializer, handler and
# serializer see the same trace without it being passed through the codec.
_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("slmrank_trace", default=None)


def current_trace() -> RequestTrace:
    """The trace of the running RPC (bound by TracingInterceptor); a throwaway one outside an RPC,
    so handlers and the codec can always record into it."""
    trace = _CURRENT.get()
    return trace if trace is not None else RequestTrace("untraced")


def bind_trace(trace: RequestTrace) -> contextvars.Token:
    return _CURRENT.set(trace)


def bound_trace() -> RequestTrace | None:
    """The trace bound to the running RPC, or None."""
    return _CURRENT.get()


# ---- the span tree ---------------------------------------------------------------------------------

@dataclass
class SpanRecord:
    name: str
    start_ns: int  # time.monotonic_ns
    end_ns: int
    parent: int  # index of the parent record; -1 for the request
    lane: str  # "request" (server and scheduler), "executor" (the batch on the host), "gpu" (device times)
    category: str  # "request", "stage" or "node"
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def node_category(node: str) -> str:
    """layer.3 -> layers, step2.lm_head -> decode lm_head (as ops/bench/bench_executor.py groups them)."""
    category = _CATEGORIES.get(node)
    if category is None:
        if len(_CATEGORIES) >= 4096:  # node names come from the artifact's DAGs: a few hundred
            _CATEGORIES.clear()
        category = _CATEGORIES[node] = _node_category(node)
    return category


_CATEGORIES: dict[str, str] = {}


def _node_category(node: str) -> str:
    prefix = ""
    if node.startswith("step") and "." in node:
        node, prefix = node.split(".", 1)[1], "decode "
    kind = node.split(".")[0]
    return prefix + ("layers" if kind == "layer" else kind)


def build_records(trace: RequestTrace) -> list[SpanRecord]:
    """The request's span tree, parents before children, each child inside its parent."""
    end = trace.end_ns if trace.end_ns is not None else time.monotonic_ns()
    records = [SpanRecord(trace.kind, trace.start_ns, end, -1, "request", "request", dict(trace.attrs))]
    stack: list[int] = []  # server stages that may enclose the next one (tokenize inside decode)
    for name, start, stop, attrs in _merged(trace.stages):
        while stack and not records[stack[-1]].start_ns <= start <= stop <= records[stack[-1]].end_ns:
            stack.pop()
        records.append(SpanRecord(name, start, stop, stack[-1] if stack else 0, "request", "stage", attrs))
        stack.append(len(records) - 1)
    if trace.timings is not None:
        _add_execution(records, trace.timings)
    return _clamped(records)


def _merged(stages: list[tuple[str, int, int]]) -> list[tuple[str, int, int, dict[str, Any]]]:
    """A name recorded several times (tokenize, once per text segment) becomes one span over all
    of them, with its busy time and count as attributes."""
    by_name: dict[str, list[int]] = {}
    for name, start, end in stages:
        s = by_name.setdefault(name, [start, end, 0, 0])
        s[0], s[1], s[2], s[3] = min(s[0], start), max(s[1], end), s[2] + end - start, s[3] + 1
    out = [(name, s, e, {"busy_ms": busy / 1e6, "count": n} if n > 1 else {})
           for name, (s, e, busy, n) in by_name.items()]
    return sorted(out, key=lambda r: (r[1], -r[2]))


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _add_execution(records: list[SpanRecord], t: RequestTimings) -> None:
    ex = t.executor
    batch = {"batch_id": t.batch_id, "batch_size": t.batch_size, "batch_index": t.batch_index, "bucket": t.bucket}
    start, end = _ns(t.batch_start_s), _ns(t.batch_end_s)
    records[0].attrs.update(batch, priority=t.priority.name)
    records.append(SpanRecord("queue", _ns(t.enqueued_s), _ns(t.dequeued_s), 0, "request", "stage",
                              {"priority": t.priority.name}))
    records.append(SpanRecord("batch", _ns(t.dequeued_s), start, 0, "request", "stage", dict(batch)))
    execute = len(records)
    records.append(SpanRecord("execute", start, end, 0, "request", "stage", {**batch, "graph": ex.graph}))
    submit, begin, h2d_end, launch, d2h_end = ex.submit_ns, ex.start_ns, ex.h2d_end_ns, ex.launch_ns, ex.d2h_end_ns

    def add(name: str, s: int, e: int, lane: str = "executor", kind: str = "stage", **attrs: Any) -> None:
        records.append(SpanRecord(name, s, e, execute, lane, kind, {"batch_id": t.batch_id, **attrs}))

    if begin > submit:
        add("executor_queue", submit, begin)  # a free executor lane was awaited
    add("h2d", begin, h2d_end)
    nodes = ex.nodes
    if ex.graph:  # one replay: device times only, laid back to back from the launch
        total = sum(round(max(d, 0.0) * 1e6) for _, _, d in nodes)
        at = max(min(launch, d2h_end - total), h2d_end)
        if at > h2d_end:
            add("launch", h2d_end, at)
        lane = "gpu"
    else:  # eager: host time per node; a GPU's event times ride along as attributes
        at, lane = launch, "executor"
    on_gpu, batch_id = lane == "gpu", t.batch_id
    for name, host_ms, device_ms in nodes:  # ~150 a batch for a real model: kept lean
        dur = round(max(device_ms if on_gpu else host_ms, 0.0) * 1e6)
        records.append(SpanRecord(name, at, at + dur, execute, lane, "node",
                                  {"batch_id": batch_id, "node": name, "category": node_category(name),
                                   "host_ms": host_ms, "device_ms": device_ms}))
        at += dur
    add("d2h", min(at, d2h_end), d2h_end)
    add("unpack", d2h_end, end, lane="request")  # results back on the event loop, split per request


def _clamped(records: list[SpanRecord]) -> list[SpanRecord]:
    """The request spans everything; every other record lies inside its parent (clocks read in
    different places may disagree by a rounding)."""
    root = records[0]
    root.start_ns = min(r.start_ns for r in records)
    root.end_ns = max(max(r.end_ns for r in records), root.start_ns)
    for r in records[1:]:
        p = records[r.parent]
        r.start_ns = min(max(r.start_ns, p.start_ns), p.end_ns)
        r.end_ns = min(max(r.end_ns, r.start_ns), p.end_ns)
    return records
