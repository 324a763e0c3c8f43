"""Prometheus metrics in the text exposition format (0.0.4), written here: no client library.

Two sources. Per request, pushed when a request finishes (`ServerMetrics.observe`, called by
TracingInterceptor): requests by kind and status code, latency and stage-time histograms by kind,
DAG node time by node category. Per scrape, read from the scheduler (`stats_source`, normally
Scheduler.stats): queue depth by lane, batches in flight, batch sizes, bucket occupancy, refused
and dropped requests by reason, the admission model's τ and ρ. Scraping reads, never resets.

`MetricsServer` answers GET /metrics (and GET /trace: the Chrome trace of the kept requests, when
given a ChromeTraceWriter) on its own port, on the running event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .records import RequestTrace, node_category

LATENCY_BUCKETS_S = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.5, 1.0)
STAGE_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


# ---- the exposition format ---------------------------------------------------------------------------

@dataclass
class Family:
    """One metric family as exposed: samples are (name suffix, labels, value)."""

    name: str
    type: str  # counter, gauge, histogram, summary, untyped
    help: str
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.type}"]
        lines += [f"{self.name}{suffix}{_labels(labels)} {_value(v)}" for suffix, labels, v in self.samples]
        return "\n".join(lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels)
    return "{" + body + "}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def render(families: Iterable[Family]) -> str:
    return "".join(f.render() for f in families)


# ---- live instruments ----------------------------------------------------------------------------------

class Counter:
    def __init__(self, name: str, help: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help, tuple(label_names)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        self._values[label_values] = self._values.get(label_values, 0.0) + amount

    def value(self, *label_values: str) -> float:
        return self._values.get(label_values, 0.0)

    def family(self) -> Family:
        return Family(self.name, "counter", self.help,
                      [("", tuple(zip(self.label_names, k)), v) for k, v in sorted(self._values.items())])


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float], label_names: Sequence[str] = ()) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be increasing, got {buckets!r}")
        self.name, self.help, self.label_names = name, help, tuple(label_names)
        self.buckets = tuple(float(b) for b in buckets)
        self._series: dict[tuple[str, ...], list[float]] = {}  # per bucket count (not cumulative), +Inf, sum

    def observe(self, value: float, *label_values: str) -> None:
        s = self._series.get(label_values)
        if s is None:
            s = self._series[label_values] = [0.0] * (len(self.buckets) + 2)
        s[bisect.bisect_left(self.buckets, value)] += 1  # le: value <= bound
        s[-1] += value

    def family(self) -> Family:
        f = Family(self.name, "histogram", self.help)
        for key, s in sorted(self._series.items()):
            f.samples += histogram_samples(tuple(zip(self.label_names, key)), self.buckets, s[:-1], s[-1])
        return f


def histogram_samples(labels: Labels, bounds: Sequence[float], counts: Sequence[float], total: float
                      ) -> list[tuple[str, Labels, float]]:
    """_bucket (cumulative, +Inf last), _sum and _count from per-bucket counts (len(bounds) + 1)."""
    out, running = [], 0.0
    for bound, n in zip([*bounds, math.inf], counts):
        running += n
        out.append(("_bucket", (*labels, ("le", _value(float(bound)))), running))
    return out + [("_sum", labels, total), ("_count", labels, running)]


# ---- the server's metrics ------------------------------------------------------------------------------

class ServerMetrics:
    """Everything /metrics shows. observe() runs on the event loop once per finished request."""

    def __init__(self, stats_source: Callable[[], dict[str, Any]] | None = None) -> None:
        self.stats_source = stats_source  # Scheduler.stats once the model is loaded
        self.requests = Counter("slmrank_requests_total", "Finished RPCs by kind and gRPC status code.",
                                ("kind", "code"))
        self.latency = Histogram("slmrank_request_latency_seconds",
                                 "End-to-end latency of a request (received -> response serialized), by kind.",
                                 LATENCY_BUCKETS_S, ("kind",))
        self.stage = Histogram("slmrank_request_stage_seconds",
                               "Time of one stage of a request (receive, decode, tokenize, queue, batch, execute, "
                               "encode, send), by kind and stage.", STAGE_BUCKETS_S, ("kind", "stage"))
        self.node_seconds = Counter("slmrank_node_seconds_total",
                                    "Executor time of DAG nodes by node category (device time when measured, "
                                    "else host time), summed over batches.", ("category", "clock"))
        self.node_batches = Counter("slmrank_node_batches_total", "Batches whose node times are in "
                                    "slmrank_node_seconds_total, by graph replay or eager.", ("mode",))

    def observe(self, trace: RequestTrace) -> None:
        kind = trace.kind
        self.requests.inc(kind, trace.status)
        self.latency.observe(trace.latency_ns / 1e9, kind)
        for name, start, end in trace.stages:
            self.stage.observe((end - start) / 1e9, kind, name)
        t = trace.timings
        if t is None:
            return
        for name, seconds in (("queue", t.dequeued_s - t.enqueued_s), ("batch", t.batch_start_s - t.dequeued_s),
                              ("execute", t.batch_end_s - t.batch_start_s)):
            self.stage.observe(seconds, kind, name)
        if t.batch_index == 0:  # a batch's node times once, with its first request
            ex = t.executor
            self.node_batches.inc("graph" if ex.get("graph") else "eager")
            for node, host_ms, device_ms in ex.get("nodes", ()):
                clock, ms = ("device", device_ms) if device_ms >= 0 else ("host", host_ms)
                self.node_seconds.inc(node_category(node), clock, amount=ms / 1e3)

    def families(self) -> list[Family]:
        live = [self.requests.family(), self.latency.family(), self.stage.family(), self.node_seconds.family(),
                self.node_batches.family()]
        return live + (scheduler_families(self.stats_source()) if self.stats_source is not None else [])

    def exposition(self) -> str:
        return render(self.families())


def scheduler_families(stats: dict[str, Any]) -> list[Family]:
    """Families read from Scheduler.stats() (admission counters, batch sizes, occupancy, model)."""
    g = [
        Family("slmrank_queue_depth", "gauge", "Requests queued (admitted, not yet batched), by priority lane.",
               [("", (("lane", lane),), n) for lane, n in stats["queue_depth"].items()]),
        Family("slmrank_batches_inflight", "gauge", "Batches handed to the executor and not yet back.",
               [("", (), stats["inflight"])]),
        Family("slmrank_admitted_total", "counter", "Requests admitted to a queue, by priority.",
               [("", (("priority", p),), n) for p, n in stats["admitted_by_priority"].items()]),
        Family("slmrank_refused_total", "counter", "Requests refused at admission (UNAVAILABLE), by reason.",
               [("", (("reason", r),), n) for r, n in stats["refused"].items()]),
        Family("slmrank_dropped_total", "counter", "Admitted requests dropped before they ran, by reason.",
               [("", (("reason", r),), stats[r]) for r in ("expired", "cancelled", "drained")]),
        Family("slmrank_batches_total", "counter", "Batches run, by outcome.",
               [("", (("outcome", "ok"),), stats["batches"] - stats["batches_failed"]),
                ("", (("outcome", "failed"),), stats["batches_failed"])]),
    ]
    sizes: dict[int, int] = stats["batch_sizes"]
    counts = [0.0] * (len(BATCH_SIZE_BUCKETS) + 1)
    for size, n in sizes.items():
        counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += n
    g.append(Family("slmrank_batch_size", "histogram", "Whole requests per batch.",
                    histogram_samples((), BATCH_SIZE_BUCKETS, counts, float(sum(s * n for s, n in sizes.items())))))
    buckets = stats["buckets"]
    g.append(Family("slmrank_bucket_occupancy", "gauge", "Mean useful share of a shape bucket: real tokens / "
                    "bucket tokens (Score), real beams / beam rows (BeamSearch), by bucket.",
                    [("", (("bucket", k),), b["occupancy_mean"]) for k, b in sorted(buckets.items())]))
    g.append(Family("slmrank_bucket_batches_total", "counter", "Batches run per shape bucket.",
                    [("", (("bucket", k),), b["batches"]) for k, b in sorted(buckets.items())]))
    model = stats.get("model")
    if model:
        g.append(Family("slmrank_batch_service_seconds", "gauge", "Admission's measured time per batch (τ, EWMA).",
                        [("", (), model["tau_s"])]))
        g.append(Family("slmrank_utilisation", "gauge", "Executor busy share over the admission window (ρ), "
                        "counting the given priority and above.",
                        [("", (("priority", p),), v) for p, v in model["rho_by_priority"].items()]))
    return g


# ---- HTTP ----------------------------------------------------------------------------------------------

class MetricsServer:
    """GET /metrics (and /trace with a Chrome writer) on the running event loop; one request per
    connection. port 0: any free port (see .port after start)."""

    def __init__(self, metrics: ServerMetrics, host: str = "0.0.0.0", port: int = 9464, chrome: Any = None) -> None:
        self.metrics, self.host, self.port, self.chrome = metrics, host, port, chrome
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        path = path.split("?", 1)[0]
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE, self.metrics.exposition().encode()
        if path == "/trace" and self.chrome is not None:
            return "200 OK", "application/json", self.chrome.dumps().encode()
        return "404 Not Found", "text/plain", b"try /metrics\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await asyncio.wait_for(reader.readline(), 5.0)).decode("latin-1").split()
            while (await asyncio.wait_for(reader.readline(), 5.0)).strip():
                pass  # headers: nothing in them changes the answer
            if len(request_line) < 2:
                status, ctype, body = "400 Bad Request", "text/plain", b"bad request line\n"
            else:
                status, ctype, body = self._route(request_line[0], request_line[1])
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
