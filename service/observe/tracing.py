"""Per-request traces: every stage of one request from explicit timestamps, kept by a tail-based
sampler, emitted as OpenTelemetry spans (OTLP when configured) and into a Chrome trace.

A request's life, in time.monotonic_ns, comes from three places:

    server      RequestTrace.add_stage / stage(): receive (request bytes -> proto), decode
                (proto -> request, validation), tokenize (inside decode), encode, send (proto -> bytes)
    scheduler   Completed.timings: queue (admitted -> taken into a batch), batch (packing), execute
                (handed to the executor -> results back on the event loop)
    executor    timings["executor"]: executor_queue, h2d, launch, one span per DAG node, d2h, unpack

`build_records` turns them into one tree of SpanRecords (the request at index 0, every child inside
its parent's interval); the OTel and Chrome renderers only draw that tree. With a replayed CUDA
graph the nodes have device times only: they are laid back to back from the graph launch; eager
nodes are laid out by their host times.

Sampling is decided when the request is over (tail-based): always when it was slow, otherwise at
`sample_rate`; either way within a budget of kept traces per second (a token bucket), because a
kept trace costs about a millisecond of the event loop (the OTel SDK, ~50 µs a span on a small
CPU) and under overload every request is slow. A request that is not kept costs a few integers;
no span is ever built for it.

Wiring into grpc.aio: `TracingInterceptor` first in the server's interceptor list (outside the
interceptor that maps exceptions to status codes). It times the request's deserialization
(receive) and the response's serialization (send), binds a RequestTrace to the RPC, and finishes
it with the final status code. Handlers reach it with `current_trace()`.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from ..serving.batcher import Completed, RequestTimings
    from .chrome_trace import ChromeTraceWriter
    from .metrics import ServerMetrics

# time.monotonic_ns -> time.time_ns, measured once per process: durations stay monotonic
WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()

OTLP_PACKAGES = {  # protocol -> (module, the package that has it)
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter",
                      "opentelemetry-exporter-otlp-proto-http"),
}


@dataclass(frozen=True)
class TracingConfig:
    sample_rate: float = 0.01  # share of the requests that are not slow whose trace is kept
    slow_ms: float = 20.0  # a request at least this long (receive -> send) is always kept...
    max_kept_per_s: float = 50.0  # ...within this budget (0: none): a kept trace costs ~1 ms of the loop
    otlp_endpoint: str | None = None  # None: no OTLP export
    otlp_protocol: str = "grpc"  # or "http/protobuf"
    chrome_max_events: int = 20_000  # the Chrome trace keeps the newest kept requests up to this; 0: none
    seed: int | None = None  # of the sampler's random numbers (tests)

    def __post_init__(self) -> None:
        if not 0 <= self.sample_rate <= 1:
            raise ValueError(f"tracing.sample_rate: must be in [0, 1], got {self.sample_rate!r}")
        for name in ("slow_ms", "max_kept_per_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"tracing.{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.otlp_protocol not in OTLP_PACKAGES:
            raise ValueError(f"tracing.otlp_protocol: must be one of {list(OTLP_PACKAGES)}, got {self.otlp_protocol!r}")
        if self.chrome_max_events < 0:
            raise ValueError(f"tracing.chrome_max_events: must be >= 0, got {self.chrome_max_events!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TracingConfig:
        """SLMRANK_TRACE_SAMPLE_RATE, _SLOW_MS, _MAX_KEPT_PER_S, _CHROME_MAX_EVENTS and the
        standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _PROTOCOL; keyword overrides win (flags)."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        kw: dict[str, Any] = {}
        for key, name, cast in (("SLMRANK_TRACE_SAMPLE_RATE", "sample_rate", float),
                                ("SLMRANK_TRACE_SLOW_MS", "slow_ms", float),
                                ("SLMRANK_TRACE_MAX_KEPT_PER_S", "max_kept_per_s", float),
                                ("SLMRANK_TRACE_CHROME_MAX_EVENTS", "chrome_max_events", int)):
            if env.get(key):
                try:
                    kw[name] = cast(env[key])
                except ValueError:
                    raise ValueError(f"{key}: not a number: {env[key]!r}") from None
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol:
            kw["otlp_protocol"] = protocol
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
            if kw.get("otlp_protocol", "grpc") != "grpc":  # the generic endpoint is a base URL for HTTP
                endpoint = endpoint.rstrip("/") + "/v1/traces"
        if endpoint:
            kw["otlp_endpoint"] = endpoint
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


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
        """Attributes of a ScoreRequest / BeamRequest: samples or beam width, tokens, priority."""
        if hasattr(request, "num_samples"):
            self.attrs.update(samples=request.num_samples, tokens=request.num_tokens, labels=len(request.label_ids))
        else:
            self.attrs.update(beam_width=request.beam_width, new_tokens=request.new_tokens,
                              tokens=len(request.prompt_ids))
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
    """layer.3 -> layers, step2.lm_head -> decode lm_head (as ops/bench_executor.py groups them)."""
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
    records.append(SpanRecord("execute", start, end, 0, "request", "stage",
                              {**batch, "graph": bool(ex.get("graph"))}))
    submit, begin, h2d_end, launch, d2h_end = (int(ex[k]) for k in
                                               ("submit_ns", "start_ns", "h2d_end_ns", "launch_ns", "d2h_end_ns"))

    def add(name: str, s: int, e: int, lane: str = "executor", kind: str = "stage", **attrs: Any) -> None:
        records.append(SpanRecord(name, s, e, execute, lane, kind, {"batch_id": t.batch_id, **attrs}))

    if begin > submit:
        add("executor_queue", submit, begin)  # a free executor lane was awaited
    add("h2d", begin, h2d_end)
    nodes = [(str(n), float(h), float(d)) for n, h, d in ex.get("nodes", ())]
    if ex.get("graph"):  # one replay: device times only, laid back to back from the launch
        total = sum(round(max(d, 0.0) * 1e6) for _, _, d in nodes)
        at = max(min(launch, d2h_end - total), h2d_end)
        if at > h2d_end:
            add("launch", h2d_end, at)
        lane = "gpu"
    else:  # eager: host time per node; a GPU's event times ride along as attributes
        at, lane = launch, "executor"
    for name, host_ms, device_ms in nodes:
        dur = round(max(device_ms if lane == "gpu" else host_ms, 0.0) * 1e6)
        add(name, at, at + dur, lane, "node", node=name, category=node_category(name), host_ms=host_ms,
            device_ms=device_ms)
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


# ---- the tracer: sampling, OTel, Chrome --------------------------------------------------------------

class RequestTracer:
    """Finishes RequestTraces: the sampling decision, then spans (OTel) and events (Chrome) for the
    kept ones. exporter: a span exporter to use instead of OTLP (tests: InMemorySpanExporter)."""

    def __init__(self, config: TracingConfig | None = None, exporter: SpanExporter | None = None,
                 chrome: ChromeTraceWriter | None = None) -> None:
        self.config = config or TracingConfig()
        self._rng = random.Random(self.config.seed)
        self._slow_ns = round(self.config.slow_ms * 1e6)
        self._provider: TracerProvider | None = None
        if exporter is None and self.config.otlp_endpoint:
            exporter = otlp_exporter(self.config.otlp_endpoint, self.config.otlp_protocol)
            processor: Any = BatchSpanProcessor(exporter)
        elif exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        if exporter is not None:
            self._provider = TracerProvider(resource=Resource.create({"service.name": "slmrank"}))
            self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("slmrank") if self._provider else None
        if chrome is None and self.config.chrome_max_events:
            from .chrome_trace import ChromeTraceWriter

            chrome = ChromeTraceWriter(self.config.chrome_max_events)
        self.chrome = chrome
        self.num_finished = self.num_kept = self.num_over_budget = 0
        self._tokens, self._tokens_at = self.config.max_kept_per_s, time.monotonic_ns()  # one second's burst

    def sample(self, trace: RequestTrace) -> str | None:
        """Why the trace is kept ("slow" or "rate"), or None."""
        if trace.latency_ns >= self._slow_ns:
            return "slow"
        rate = self.config.sample_rate
        return "rate" if rate > 0 and self._rng.random() < rate else None

    def finish(self, trace: RequestTrace, status: str | None = None) -> bool:
        """Ends the trace (now, unless end_ns is set) and keeps it if sampled. True if kept."""
        if trace.end_ns is None:
            trace.end_ns = time.monotonic_ns()
        if status is not None:
            trace.status = status
        self.num_finished += 1
        reason = self.sample(trace)
        if reason is None or (self._tracer is None and self.chrome is None):
            return False
        if not self._within_budget(trace.end_ns):
            self.num_over_budget += 1
            return False
        self.num_kept += 1
        records = build_records(trace)
        records[0].attrs.update(kind=trace.kind, status=trace.status, sampled=reason,
                                latency_ms=records[0].duration_ns / 1e6)
        if self._tracer is not None:
            self._emit(trace, records)
        if self.chrome is not None:
            self.chrome.add(records)
        return True

    def _within_budget(self, now_ns: int) -> bool:
        rate = self.config.max_kept_per_s
        if rate == 0:
            return True
        self._tokens = min(rate, self._tokens + max(now_ns - self._tokens_at, 0) * rate / 1e9)
        self._tokens_at = max(now_ns, self._tokens_at)
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _emit(self, trace: RequestTrace, records: list[SpanRecord]) -> None:
        assert self._tracer is not None
        parent = otel_context.Context()  # a root, unless the caller sent its trace context
        if trace.traceparent:
            parent = TraceContextTextMapPropagator().extract({"traceparent": trace.traceparent}, context=parent)
        spans: list[otel_trace.Span] = []
        for i, r in enumerate(records):
            ctx = parent if r.parent < 0 else otel_trace.set_span_in_context(spans[r.parent])
            kind = SpanKind.SERVER if i == 0 else SpanKind.INTERNAL
            spans.append(self._tracer.start_span(r.name, context=ctx, kind=kind, attributes=_otel_attrs(r),
                                                 start_time=r.start_ns + WALL_OFFSET_NS))
        if trace.status != "OK":
            spans[0].set_status(Status(StatusCode.ERROR, trace.status))
        for span, r in zip(reversed(spans), reversed(records)):  # children first, as they would end
            span.end(end_time=r.end_ns + WALL_OFFSET_NS)

    def shutdown(self) -> None:
        """Flushes and stops the exporter (call once, when the server stops)."""
        if self._provider is not None:
            self._provider.shutdown()


def _otel_attrs(r: SpanRecord) -> dict[str, Any]:
    out = {f"slmrank.{k}": v for k, v in r.attrs.items() if v is not None}
    if r.parent < 0:
        out.update({"rpc.system": "grpc", "rpc.service": "slmrank.v1.Ranker", "rpc.method": r.name})
        status = r.attrs.get("status")
        if status in grpc.StatusCode.__members__:
            out["rpc.grpc.status_code"] = grpc.StatusCode[status].value[0]
    return out


def otlp_exporter(endpoint: str, protocol: str = "grpc") -> SpanExporter:
    """The OTLP span exporter, imported only when asked for: its package is optional."""
    module, package = OTLP_PACKAGES[protocol]
    try:
        exporter_cls = importlib.import_module(module).OTLPSpanExporter
    except ImportError as e:
        raise RuntimeError(f"OTLP export to {endpoint} ({protocol}) needs the Python package {package}, which is "
                           f"not installed: pip install {package} (or unset OTEL_EXPORTER_OTLP_ENDPOINT)") from e
    return exporter_cls(endpoint=endpoint)


# ---- grpc.aio wiring -------------------------------------------------------------------------------

class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Traces every unary RPC of `service`: receive (deserialization) -> handler -> send
    (serialization), with the final status code; then the tracer and the metrics see it.
    When the inner handler takes raw bytes (it parses them itself), the parse should be timed
    there as `with current_trace().stage("receive"): ...`.

    Put it first in the server's interceptor list, so that it wraps the interceptor that turns
    exceptions into status codes and reads the code from the context. A response that never
    reaches serialization (the client went away) is not counted."""

    def __init__(self, tracer: RequestTracer, metrics: ServerMetrics | None = None,
                 service: str = "slmrank.v1.Ranker") -> None:
        self.tracer, self.metrics, self.prefix = tracer, metrics, f"/{service}/"

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not details.method.startswith(self.prefix):
            return handler
        kind = details.method.rsplit("/", 1)[1]
        traceparent = next((v for k, v in details.invocation_metadata or () if k == "traceparent"), None)
        behavior = handler.unary_unary
        deserialize, serialize = handler.request_deserializer, handler.response_serializer

        def receive(raw: bytes) -> Any:
            start = time.monotonic_ns()
            trace = RequestTrace(kind, start, traceparent if isinstance(traceparent, str) else None)
            trace.attrs["request_bytes"] = len(raw)
            if deserialize is None:  # an inner interceptor parses: it records "receive" itself
                message = raw
            else:
                message = deserialize(raw)
                trace.add_stage("receive", start, time.monotonic_ns())
            _CURRENT.set(trace)  # the same task runs the handler and the serializer
            return message

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            trace = _CURRENT.get()
            if trace is None:
                trace = RequestTrace(kind)
                _CURRENT.set(trace)
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:
                self._finish(trace, "CANCELLED")
                raise
            except grpc.aio.AbortError:
                code = context.code()
                self._finish(trace, code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN")
                raise
            except BaseException:
                self._finish(trace, "UNKNOWN")
                raise

        def send(response: Any) -> bytes:
            start = time.monotonic_ns()
            raw = serialize(response) if serialize else response
            trace = _CURRENT.get()
            if trace is not None and not trace.is_finished:
                trace.add_stage("send", start, time.monotonic_ns())
                trace.attrs["response_bytes"] = len(raw)
                self._finish(trace, "OK")
            return raw

        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=receive, response_serializer=send)

    def _finish(self, trace: RequestTrace, status: str) -> None:
        if trace.is_finished:
            return
        self.tracer.finish(trace, status)
        if self.metrics is not None:
            self.metrics.observe(trace)


__all__ = ["RequestTrace", "RequestTracer", "SpanRecord", "TracingConfig", "TracingInterceptor", "WALL_OFFSET_NS",
           "bind_trace", "build_records", "current_trace", "node_category", "otlp_exporter"]
