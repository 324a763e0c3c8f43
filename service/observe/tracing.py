"""Which request traces are kept, and where they go: a tail-based sampler over the span trees of
records.py, emitted as OpenTelemetry spans (OTLP when configured) and into a Chrome trace.

Sampling is decided when the request is over (tail-based): always when it was slow, otherwise at
`sample_rate`; either way within a budget of kept traces per second (a token bucket), because a
kept trace costs about a millisecond of the event loop (the OTel SDK, ~50 µs a span on a small
CPU) and under overload every request is slow. A request that is not kept costs a few integers;
no span is ever built for it. The gRPC side (binding a trace to each RPC) is
service/serving/interceptor.py.
"""

from __future__ import annotations

import importlib
import os
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .chrome_trace import ChromeTraceWriter
from .records import WALL_OFFSET_NS, RequestTrace, SpanRecord, build_records

# the codes that make a server span's status ERROR (OpenTelemetry's gRPC semantic conventions): the
# server's failures; a client's mistake (INVALID_ARGUMENT, NOT_FOUND, ...) leaves the span UNSET, or
# every bad request would count as a server error wherever errors are read from spans
SERVER_ERROR_CODES = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                                "DATA_LOSS"})

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
        standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / _PROTOCOL; keyword overrides win (flags).
        OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none turn the OTLP export off."""
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
        exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporters == {"none"}:
            kw["otlp_endpoint"] = None
        return cls(**kw)


# ---- the tracer: sampling, OTel, Chrome --------------------------------------------------------------

def service_resource() -> Resource:
    """The spans' resource: OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as the SDK reads them;
    service.name "slmrank" only where neither names the service."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "slmrank"}))
    return resource


def is_sampled(traceparent: str | None) -> bool:
    """The sampled flag of a W3C traceparent ("00-<trace id>-<parent id>-<flags>")."""
    if not traceparent:
        return False
    parts = traceparent.strip().split("-")
    if len(parts) < 4 or len(parts[3]) != 2:
        return False
    try:
        return bool(int(parts[3], 16) & 1)
    except ValueError:
        return False


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
            self._provider = TracerProvider(resource=service_resource())
            self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("slmrank") if self._provider else None
        if chrome is None and self.config.chrome_max_events:
            from .chrome_trace import ChromeTraceWriter

            chrome = ChromeTraceWriter(self.config.chrome_max_events)
        self.chrome = chrome
        self.num_finished = self.num_kept = self.num_over_budget = 0
        # the trace last emitted as OTel spans, with its trace and server span ids (log_ids)
        self._last_emitted: tuple[RequestTrace, str, str] | None = None
        self._tokens, self._tokens_at = self.config.max_kept_per_s, time.monotonic_ns()  # one second's burst

    def sample(self, trace: RequestTrace) -> str | None:
        """Why the trace is kept ("slow", "parent": the caller sampled it, or "rate"), or None."""
        if trace.latency_ns >= self._slow_ns:
            return "slow"
        if is_sampled(trace.traceparent):
            return "parent"
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
        if trace.status in SERVER_ERROR_CODES:
            spans[0].set_status(Status(StatusCode.ERROR, trace.status))
        for span, r in zip(reversed(spans), reversed(records)):  # children first, as they would end
            span.end(end_time=r.end_ns + WALL_OFFSET_NS)
        context = spans[0].get_span_context()
        self._last_emitted = (trace, format(context.trace_id, "032x"), format(context.span_id, "016x"))

    def log_ids(self, trace: RequestTrace) -> dict[str, str]:
        """The ids a log record of the finished `trace` carries to be found beside its spans:
        trace_id and span_id (the server span) when finish() just emitted it; else the caller's
        trace_id when it sent a traceparent; else none."""
        last = self._last_emitted
        if last is not None and last[0] is trace:
            return {"trace_id": last[1], "span_id": last[2]}
        parts = (trace.traceparent or "").strip().split("-")
        if len(parts) >= 4 and len(parts[1]) == 32 and parts[1].strip("0"):
            try:
                int(parts[1], 16)
            except ValueError:
                return {}
            return {"trace_id": parts[1].lower()}
        return {}

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


__all__ = ["OTLP_PACKAGES", "SERVER_ERROR_CODES", "RequestTracer", "TracingConfig", "otlp_exporter"]
