"""Prometheus metrics (prometheus_client), served on their own address by a thread of their own.

Three sources, one registry per ServerMetrics:
- per request, pushed when a request finishes (`ServerMetrics.observe`, on the event loop):
  requests by kind and status code, latency by kind and priority lane, stage-time histograms by
  kind, DAG node time by node category;
- per scrape, read from the scheduler (`stats_source`, normally Scheduler.stats, called on the
  event loop when one is attached, since the scheduler's counters are the loop's): queue depth by
  lane, batches in flight, batch sizes, bucket occupancy, refused and dropped requests by
  reason, the admission model's τ and ρ;
- the process: CPU, memory, open files (prometheus_client's process collector), device memory
  per GPU, build info (versions) and the served model's identity (labels of slmrank_model_info).
Scraping reads, never resets.

`MetricsServer` answers GET /metrics, or GET /trace (the Chrome trace of the kept requests), or
both, on its own port, from threads of its own: a scrape never waits for the gRPC event loop to be
free. Connections are served concurrently (at most `max_clients` at once; one more is answered 503
at once), and each request has `timeout_s` in all to arrive (request line and headers), however
slowly its bytes trickle in: a slow or malformed HTTP client costs one thread a few seconds, never
the loop and never another scrape.
The server runs two of them, one per port: /metrics on the scrape port, /trace (megabytes of
request timings, off unless asked for) on the loopback, so a client reading a trace never delays
a scrape behind it and a scraper's network never sees the timings.
"""

from __future__ import annotations

import asyncio
import bisect
import http.server
import logging
import os
import platform
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from importlib import metadata
from typing import Any

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..runtime.requests import BindError
from .records import RequestTrace, node_category
from ..siblings import sibling

LATENCY_BUCKETS_S = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.5, 1.0)
STAGE_BUCKETS_S = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# the latency's priority label: the names of service.sched.verdict.Priority (a layer above this one,
# so named here; tests/service/test_metrics.py checks they agree), or NO_LANE
LANES = frozenset({"ONLINE", "NORMAL", "BACKGROUND"})
NO_LANE = "none"
# generate_latest writes the classic text format; our names are plain ASCII, so every Prometheus reads it
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOOP_READ_TIMEOUT_S = 2.0  # a scrape waits this long for the event loop, then shows the last numbers

log = logging.getLogger("slmrank.metrics")
# No `_created` series: the counters here start with the process, whose start time is exported.
# (An older prometheus_client, without the switch, still renders them: they are only extra samples.)
getattr(prometheus_client, "disable_created_metrics", lambda: None)()


# ---- the server's metrics ------------------------------------------------------------------------------

class ServerMetrics:
    """Everything /metrics shows. observe() runs on the event loop once per finished request."""

    def __init__(self, stats_source: Callable[[], dict[str, Any]] | None = None) -> None:
        self.stats_source = stats_source  # Scheduler.stats once the model is loaded
        self.loop: asyncio.AbstractEventLoop | None = None  # where stats_source must run (None: the caller's)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("slmrank_requests", "Finished RPCs by kind and gRPC status code.",
                                ("kind", "code"), registry=r)
        self.latency = Histogram("slmrank_request_latency_seconds",
                                 "End-to-end latency of a request (received -> response serialized), by kind and "
                                 "admission lane (priority: ONLINE, NORMAL, BACKGROUND; none for an RPC without "
                                 "one, such as ModelInfo, or a request refused before its message was read).",
                                 ("kind", "priority"), buckets=LATENCY_BUCKETS_S, registry=r)
        self.stage = Histogram("slmrank_request_stage_seconds",
                               "Time of one stage of a request (receive, decode, tokenize, queue, batch, execute, "
                               "encode, send), by kind and stage.", ("kind", "stage"), buckets=STAGE_BUCKETS_S,
                               registry=r)
        self.node_seconds = Counter("slmrank_node_seconds", "Executor time of DAG nodes by node category (device "
                                    "time when measured, else host time), summed over batches.",
                                    ("category", "clock"), registry=r)
        self.node_batches = Counter("slmrank_node_batches", "Batches whose node times are in "
                                    "slmrank_node_seconds_total, by graph replay or eager.", ("mode",), registry=r)
        ProcessCollector(namespace="", registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.loop_thread_id: int | None = None  # the event loop's OS thread (Linux: its CPU time is exported)
        self._model_labels: dict[str, str] | None = None
        self._catalogs: tuple[tuple[str, str, int], ...] = ()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # (metric, label values) -> its child
        self._last_stats: dict[str, Any] | None = None
        r.register(_Callback(self._scheduler_families))
        r.register(_Callback(self._process_families))

    def set_model(self, info: Any) -> None:
        """The served model's identity (a ModelInfoResponse) as the labels of slmrank_model_info."""
        self._model_labels = {"model": info.model, "artifact_sha256": info.artifact_sha256, "arch": info.arch,
                              "runtime": info.runtime, "device": info.device, "dtype": info.compute_dtype,
                              "kernels": info.kernels, "beam_graphs": info.beam_graphs}
        # (name, version, items) of each catalog served now (set again when one is replaced)
        self._catalogs = tuple((c.name, c.version, c.num_items) for c in info.catalogs)

    def observe(self, trace: RequestTrace) -> None:
        kind = trace.kind
        self._child(self.requests, kind, trace.status).inc()
        lane = trace.attrs.get("priority")
        # only the lanes' names or "none": a label's values must stay a small fixed set
        self._child(self.latency, kind, lane if lane in LANES else NO_LANE).observe(trace.latency_ns / 1e9)
        for name, start, end in trace.stages:
            self._child(self.stage, kind, name).observe((end - start) / 1e9)
        t = trace.timings
        if t is None:
            return
        for name, seconds in (("queue", t.dequeued_s - t.enqueued_s), ("batch", t.batch_start_s - t.dequeued_s),
                              ("execute", t.batch_end_s - t.batch_start_s)):
            self._child(self.stage, kind, name).observe(seconds)
        if t.batch_index == 0:  # a batch's node times once, with its first request
            ex = t.executor
            self._child(self.node_batches, "graph" if ex.graph else "eager").inc()
            # summed by category first: one labelled sample per category, not one per DAG node (a
            # real model's batch has ~150 nodes; this runs on the event loop)
            totals: dict[tuple[str, str], float] = {}
            get = totals.get
            for node, host_ms, device_ms in ex.nodes:  # NodeTimings
                if device_ms >= 0:
                    key, ms = (node_category(node), "device"), device_ms
                else:
                    key, ms = (node_category(node), "host"), host_ms
                totals[key] = get(key, 0.0) + ms
            for (category, clock), ms in totals.items():
                self._child(self.node_seconds, category, clock).inc(ms / 1e3)

    def _child(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), kept: prometheus_client's lookup takes a lock and builds its key
        on every call, and observe() makes ~a dozen of them per request on the event loop."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def exposition(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()

    def _scheduler_families(self) -> list[Metric]:
        if self.stats_source is None:
            return []
        try:
            self._last_stats = self.call_on_loop(self.stats_source)
        except TimeoutError:
            log.warning("scrape: the event loop did not answer within %.0f s; showing older numbers",
                        LOOP_READ_TIMEOUT_S)
        return scheduler_families(self._last_stats) if self._last_stats is not None else []

    def call_on_loop(self, fn: Callable[[], Any]) -> Any:
        """fn() on the event loop whose state it reads (from the HTTP thread); TimeoutError when
        the loop does not get to it in time."""
        loop = self.loop
        if loop is None or not loop.is_running() or _on_loop(loop):
            return fn()

        async def call() -> Any:
            return fn()

        try:
            return asyncio.run_coroutine_threadsafe(call(), loop).result(LOOP_READ_TIMEOUT_S)
        except (FutureTimeout, RuntimeError) as e:  # a busy or closing loop
            raise TimeoutError("the event loop did not answer") from e

    def _process_families(self) -> list[Metric]:
        out = [_build_info()]
        if self._model_labels is not None:
            info = GaugeMetricFamily("slmrank_model_info", "The served model: name, artifact sha256, architecture, "
                                     "runtime, device, compute dtype, kernels, the C++ runtime's BeamSearch graphs (value 1).",
                                     labels=list(self._model_labels))
            info.add_metric(list(self._model_labels.values()), 1)
            out.append(info)
        if catalogs := self._catalogs:
            items = GaugeMetricFamily("slmrank_catalog_items", "Items of each catalog served now, by its version "
                                      "(Admin.ReplaceCatalog changes it).", labels=["catalog", "version"])
            for name, version, num_items in catalogs:
                items.add_metric([name, version], num_items)
            out.append(items)
        return out + self._loop_families() + gpu_memory_families()

    def _loop_families(self) -> list[Metric]:
        """The serving event loop's CPU time and delay. Every request passes through that one
        thread (gRPC, parsing, admission, packing, the response): when its CPU seconds grow by ~1 a
        second it is saturated, requests wait in gRPC's queue before any handler runs, and the
        server's capacity is the loop's, not the GPU's."""
        out: list[Metric] = []
        seconds = thread_cpu_seconds(self.loop_thread_id) if self.loop_thread_id is not None else None
        if seconds is not None:
            c = CounterMetricFamily("slmrank_event_loop_cpu_seconds", "CPU time of the serving event loop's thread.")
            c.add_metric([], seconds)
            out.append(c)
        model = (self._last_stats or {}).get("model")
        if model and "loop_lag_s" in model:
            g = GaugeMetricFamily("slmrank_event_loop_lag_seconds", "Delay between a batch's results and its "
                                  "handlers resuming on the event loop (quantile over recent batches).")
            g.add_metric([], model["loop_lag_s"])
            out.append(g)
        return out


def thread_cpu_seconds(native_id: int, pid: int | str = "self") -> float | None:
    """user + system CPU seconds of a thread (of this process by default; Linux /proc), None
    elsewhere or when it is gone."""
    try:
        with open(f"/proc/{pid}/task/{native_id}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Callback(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        yield from self.fn()

    def describe(self) -> list[Metric]:
        return []  # dynamic: nothing to check against other collectors at registration


def _version() -> str:
    try:
        return metadata.version("slmrank")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def _build_info() -> Metric:
    try:
        core = sibling("cpp_dag._core")
        extension = "cuda" if core.build_info()["with_cuda"] else "cpu"
    except ImportError:
        extension = "none"
    g = GaugeMetricFamily("slmrank_build_info", "Versions of slmrank and what it runs on (value 1).",
                          labels=["version", "python", "torch", "cuda", "extension", "platform"])
    g.add_metric([_version(), platform.python_version(), torch.__version__, torch.version.cuda or "none", extension,
                  sys.platform], 1)
    return g


def gpu_memory_families() -> list[Metric]:
    """Device memory per GPU: what torch's allocator holds (allocated, reserved) and what the
    device has (total, free), when this process has initialised CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    used = GaugeMetricFamily("slmrank_gpu_memory_bytes", "Device memory by GPU and kind: allocated (live "
                             "tensors), reserved (held by torch's caching allocator), total and free (the device).",
                             labels=["gpu", "kind"])
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        for kind, value in (("allocated", torch.cuda.memory_allocated(i)), ("reserved", torch.cuda.memory_reserved(i)),
                            ("total", total), ("free", free)):
            used.add_metric([str(i), kind], value)
    return [used]


def scheduler_families(stats: dict[str, Any]) -> list[Metric]:
    """Families read from Scheduler.stats() (admission counters, batch sizes, occupancy, model)."""
    def gauge(name: str, help: str, label: str | None, values: Iterable[tuple[str, float]]) -> Metric:
        g = GaugeMetricFamily(name, help, labels=[label] if label else [])
        for key, v in values:
            g.add_metric([key] if label else [], v)
        return g

    def counter(name: str, help: str, label: str, values: Iterable[tuple[str, float]]) -> Metric:
        c = CounterMetricFamily(name, help, labels=[label])
        for key, v in values:
            c.add_metric([key], v)
        return c

    out = [
        gauge("slmrank_queue_depth", "Requests queued (admitted, not yet batched), by priority lane.", "lane",
              stats["queue_depth"].items()),
        gauge("slmrank_batches_inflight", "Batches handed to the executor and not yet back.", None,
              [("", stats["inflight"])]),
        counter("slmrank_admitted", "Requests admitted to a queue, by priority.", "priority",
                stats["admitted_by_priority"].items()),
        counter("slmrank_refused", "Requests refused at admission (UNAVAILABLE), by reason.", "reason",
                stats["refused"].items()),
        counter("slmrank_dropped", "Admitted requests dropped before they were answered, by reason: in the queue or "
                "as members of a running batch.", "reason", [(r, stats[r]) for r in ("expired", "cancelled", "drained")]),
        counter("slmrank_dropped_in_flight", "Of slmrank_dropped, the members of a batch already handed to the "
                "executor, by reason (expired: its batch could not end by the deadline; cancelled: gRPC ended the "
                "call first).", "reason", [(r, stats.get(f"{r}_in_flight", 0)) for r in ("expired", "cancelled")]),
        CounterMetricFamily("slmrank_answered_late", "Admitted requests that ran and were answered after their "
                            "deadline: admission promised them in time (0 when its predictions hold).",
                            value=stats["answered_late"]),
        counter("slmrank_stalled_calls", "Calls cancelled while they waited on their client past a bound, by "
                "reason: receive (the request message was not whole in time), no_message (the stream ended without "
                "one), send (the answer was not taken in time).", "reason", stats.get("stalled", {}).items()),
        counter("slmrank_batches", "Batches run, by outcome.", "outcome",
                [("ok", stats["batches"] - stats["batches_failed"]), ("failed", stats["batches_failed"])]),
        counter("slmrank_heavy_batches", "Of slmrank_batches, those started heavy (they may not take the last free "
                "lane), by why: time (predicted over 50 ms) or ratio (a request over heavy_ratio x the lightest "
                "request of another kind seen in the last second; off by default).", "why",
                [(why, stats.get("heavy_batches", {}).get(why, 0)) for why in ("time", "ratio")]),
    ]
    sizes: dict[int, int] = stats["batch_sizes"]
    counts = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
    for size, n in sizes.items():
        counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += n
    cumulative, running = [], 0
    for bound, n in zip([*map(str, BATCH_SIZE_BUCKETS), "+Inf"], counts):
        running += n
        cumulative.append((bound, running))
    h = HistogramMetricFamily("slmrank_batch_size", "Whole requests per batch.")
    h.add_metric([], cumulative, sum_value=float(sum(s * n for s, n in sizes.items())))
    out.append(h)
    buckets = stats["buckets"]
    out.append(gauge("slmrank_bucket_occupancy", "Mean useful share of a shape bucket: real tokens / bucket tokens "
                     "(Score), real beams / beam rows (BeamSearch), by bucket.", "bucket",
                     [(k, b["occupancy_mean"]) for k, b in sorted(buckets.items())]))
    out.append(counter("slmrank_bucket_batches", "Batches run per shape bucket.", "bucket",
                       [(k, b["batches"]) for k, b in sorted(buckets.items())]))
    model = stats.get("model")
    if model:
        out.append(gauge("slmrank_batch_service_seconds", "Admission's measured time per batch (τ, EWMA).", None,
                         [("", model["tau_s"])]))
        out.append(gauge("slmrank_utilisation", "Executor busy share over the admission window (ρ), counting the "
                         "given priority and above.", "priority", model["rho_by_priority"].items()))
        out.append(gauge("slmrank_admission_calibration", "The factor admission stretches its latency predictions "
                         "by (the worst actual/predicted seen, decaying; 1: its predictions hold).", None,
                         [("", model["calibration"])]))
        out.append(gauge("slmrank_admission_parallelism", "Batches admission counts as running at once.", None,
                         [("", model["parallelism"])]))
        if "error_by_priority" in model:
            out.append(gauge("slmrank_admission_lane_error", "The worst actual/predicted latency seen in a priority "
                             "lane, decaying as the calibration does (which is the worst over all lanes).",
                             "priority", model["error_by_priority"].items()))
    if "queue_work_s" in stats:
        out.append(gauge("slmrank_queue_work_seconds", "Predicted executor seconds of the requests queued, by "
                         "priority lane.", "lane", stats["queue_work_s"].items()))
    if "front_ingress_s" in stats:
        out.append(gauge("slmrank_front_ingress_delay_seconds", "serve --fronts: how far the engine's event loop is "
                         "behind with the requests the fronts forward (the latest one's wait, decaying); past "
                         "admission.front_max_backlog_s the fronts refuse (reason front_backlog).", None,
                         [("", stats["front_ingress_s"])]))
    return out


def render(families: Sequence[Metric]) -> str:
    """Text exposition of metric families (tests; the server renders its whole registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Callback(lambda: families))
    return prometheus_client.generate_latest(registry).decode()


# ---- HTTP, off the event loop --------------------------------------------------------------------------

class MetricsServer:
    """GET /metrics (unless serve_metrics is False) and GET /trace (with a Chrome writer), each
    connection on a daemon thread of its own, at most max_clients at once (one more gets a 503 and
    is closed); each request must arrive whole within timeout_s, and its answer be taken within
    timeout_s. port 0: any free port (see .port after start)."""

    def __init__(self, metrics: ServerMetrics, host: str = "127.0.0.1", port: int = 9464, chrome: Any = None,
                 timeout_s: float = 5.0, trace_refresh_s: float = 1.0, trace_max_share: float = 0.02,
                 serve_metrics: bool = True, max_clients: int = 16) -> None:
        if not 0 < trace_max_share <= 1:
            raise ValueError(f"trace_max_share: must be in (0, 1], got {trace_max_share!r}")
        if max_clients < 1:
            raise ValueError(f"max_clients: must be >= 1, got {max_clients!r}")
        self.max_clients = max_clients
        # answers are rendered one at a time (the /trace cache, the registry's collectors); only
        # reading requests and sending answers, where a slow client spends its time, run side by side
        self._render_lock = threading.Lock()
        if not serve_metrics and chrome is None:
            raise ValueError("a MetricsServer without /metrics needs a Chrome writer for /trace")
        self.metrics, self.host, self.port, self.chrome, self.timeout_s = metrics, host, port, chrome, timeout_s
        self.serve_metrics = serve_metrics
        # GET /trace renders a snapshot at most every trace_refresh_s, and less often when rendering
        # costs more than trace_max_share of this process's time: rendering holds the GIL that the
        # serving loop needs, and what it renders is proportional to the traffic traced (about
        # 12 µs an event on the 2-core CI machine: 4,000 events a second cost ~5% of the GIL with
        # a refresh every second). Polling clients in between share the cached body (Age header).
        self.trace_refresh_s, self.trace_max_share = trace_refresh_s, trace_max_share
        self._trace: tuple[float, bytes] | None = None  # (monotonic time rendered, body)
        self._trace_next = 0.0  # monotonic time from which a GET renders again
        self._httpd: http.server.HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Binds and starts the thread; raises BindError for a taken port or a bad address."""
        try:
            self.metrics.loop = asyncio.get_running_loop()
            self.metrics.loop_thread_id = threading.get_native_id()  # the serving loop's own thread
        except RuntimeError:
            pass  # no loop here: stats are read on the HTTP thread
        handler = type("Handler", (_Handler,), {"route": self._route, "timeout": self.timeout_s})
        try:
            self._httpd = _BoundedThreadingServer((self.host, self.port), handler, self.max_clients)
        except (OSError, OverflowError) as e:
            raise BindError(f"cannot listen on {self.host}:{self.port} (metrics): "
                            f"{getattr(e, 'strerror', None) or e}") from e
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="slmrank-metrics", daemon=True)
        self._thread.start()
        return self.port

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def _route(self, path: str) -> tuple[int, str, bytes, dict[str, str]]:
        with self._render_lock:
            return self._render(path.split("?", 1)[0])

    def _render(self, path: str) -> tuple[int, str, bytes, dict[str, str]]:
        if path == "/metrics" and self.serve_metrics:
            return 200, CONTENT_TYPE, self.metrics.exposition().encode(), {}
        if path == "/trace" and self.chrome is not None:
            now = time.monotonic()
            if self._trace is None or now >= self._trace_next:
                try:  # the writer is the event loop's: only the copy of its references happens there
                    snapshot = self.metrics.call_on_loop(self.chrome.snapshot)
                except TimeoutError:
                    return 503, "text/plain; charset=utf-8", b"the server is too busy to copy its trace; retry\n", {}
                cpu = time.thread_time()
                self._trace = (now, snapshot.dumps(pause=_yield_gil).encode())
                cost = time.thread_time() - cpu
                self._trace_next = now + max(self.trace_refresh_s, cost / self.trace_max_share)
            # Age (RFC 9111): whole seconds since the body was rendered
            return 200, "application/json", self._trace[1], {"Age": str(int(now - self._trace[0]))}
        served = " or ".join(path for path, on in (("/metrics", self.serve_metrics), ("/trace", self.chrome is not None))
                             if on)
        return 404, "text/plain; charset=utf-8", f"not found: try {served}\n".encode(), {}


class _BoundedThreadingServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most max_clients at once: one more is answered 503 from the
    accepting thread (a write to a fresh socket's empty buffer never blocks) and closed."""

    daemon_threads = True
    block_on_close = False  # close() does not wait for a slow client's thread

    def __init__(self, address: tuple[str, int], handler: type, max_clients: int) -> None:
        self.max_clients = max_clients
        self._slots = threading.BoundedSemaphore(max_clients)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            log.debug("%s: %d HTTP clients at once already; answered 503", client_address, self.max_clients)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _DeadlineReader:
    """The handler's rfile: every read waits at most until one deadline for the whole request, so
    a client that sends a header line every few seconds is cut off like one that sends nothing."""

    def __init__(self, raw: Any, sock: socket.socket, timeout_s: float) -> None:
        self._raw, self._sock, self._end = raw, sock, time.monotonic() + timeout_s

    def _arm(self) -> None:
        left = self._end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)

    def readline(self, size: int = -1) -> bytes:
        self._arm()
        return self._raw.readline(size)

    def read(self, size: int = -1) -> bytes:
        self._arm()
        return self._raw.read(size)

    def __getattr__(self, name: str) -> Any:  # close, closed, ...: the buffered reader's own
        return getattr(self._raw, name)


class _Handler(http.server.BaseHTTPRequestHandler):
    """Bad request lines get the standard library's 400, without a traceback; errors while
    answering are one log line and a 500. The request line and headers must arrive within
    `timeout` seconds in all (one request per connection: the answer closes it)."""

    route: Callable[[str], tuple[int, str, bytes, dict[str, str]]]
    protocol_version = "HTTP/1.1"
    server_version = "slmrank-metrics"

    def setup(self) -> None:
        super().setup()
        self.rfile = _DeadlineReader(self.rfile, self.connection, self.timeout)  # type: ignore[assignment]

    def do_GET(self) -> None:
        try:
            status, ctype, body, headers = self.route(self.path)
        except Exception as e:  # noqa: BLE001 -- one line in the log, a 500 to the client
            log.error("GET %s failed: %s: %s", self.path, type(e).__name__, e)
            status, ctype, body, headers = 500, "text/plain; charset=utf-8", b"internal error; see the server log\n", {}
        self._answer(status, ctype, body, headers)

    def _method_not_allowed(self) -> None:
        self._answer(405, "text/plain; charset=utf-8", b"only GET\n")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _method_not_allowed

    def _answer(self, status: int, ctype: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.close_connection = True
        head = b"".join([*self._headers_buffer, b"\r\n"])  # what end_headers() would write
        self._headers_buffer = []
        try:
            _send(self.connection, [head, body], self.timeout)
        except (BrokenPipeError, ConnectionResetError):  # the client went away: nothing to answer, no traceback
            log.debug("%s went away before the answer to %s", self.address_string(), self.path)
        except TimeoutError:
            log.debug("%s took more than %s s to read the answer to %s", self.address_string(), self.timeout, self.path)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the standard library's name
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.address_string(), format % args)


def _send(sock: socket.socket, parts: list[bytes], timeout_s: float) -> None:
    """Writes parts in as few system calls as the client's reading allows (a 3.6 MB /trace: one,
    where a socket with a Python timeout polls before every partial send). Each system call here
    releases and retakes the GIL, and each retaking can stop the serving loop's thread for a
    hand-off; the kernel's send timeout and a deadline bound a client that reads slowly."""
    end = time.monotonic() + timeout_s
    sock.settimeout(None)  # blocking: the kernel waits for room in the buffer, not a poll per chunk
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6)))
    views = [memoryview(p) for p in parts if p]
    while views:
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
            sent = 0
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][sent:]
            if time.monotonic() >= end:
                raise TimeoutError


def _yield_gil() -> None:
    """Between chunks of a /trace rendering: lets the event loop's thread take the GIL now rather
    than after the interpreter's switch interval (5 ms) each time it wakes up."""
    time.sleep(0)
