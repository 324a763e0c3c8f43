"""The gRPC server: grpc.aio on uvloop, one event loop per process, created inside it.

Handlers are a few lines each (proto -> request -> Scheduler.submit -> proto; Tokenize and
ModelInfo answer from the codec and the model without the scheduler); exceptions become
status codes in StatusInterceptor and nowhere else. Also served: grpc.health.v1 (NOT_SERVING until
the model is loaded and its graphs captured, and again while draining) and server reflection.

Lifecycle: bind and answer health checks at once; load the model in a worker thread; SERVING.
On SIGTERM/SIGINT: NOT_SERVING, refuse new work (UNAVAILABLE, so clients go to another replica),
finish the requests in flight, exit 0, all within `grace_s` (shorter than Kubernetes' 30 s); a
batch that outlasts the grace does not hold the process (it exits 1). A second signal skips what
is left of the grace.

Observability (service/observe/tracing.py, service/observe/metrics.py): TracingInterceptor, outside StatusInterceptor,
traces every Ranker RPC (receive, decode, tokenize, queue, batch, execute with the executor's
phases and DAG nodes, encode, send) and feeds ServerMetrics; with `metrics_port` set, GET /metrics
(Prometheus) is served on its own port; with `trace_port` set, GET /trace (the Chrome trace of the
kept requests: megabytes of request timings) on another, on the loopback only (TRACE_HOST);
`trace_file` gets the Chrome trace when the server stops.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..sched.admission import AdmissionConfig, Overloaded
from ..sched.verdict import lane_of
from ..artifact.artifact import Artifact
from ..artifact.resolve import resolve_artifact
from ..sched.batcher import BatcherConfig, DeadlineExpired, Scheduler
from ..sched.memory import available_memory_bytes
from .grpc_codec import Codec
from ..observe.metrics import MetricsServer, ServerMetrics
from .proto_gen import load as load_stubs
from ..runtime import factory
from ..runtime.requests import BindError, ExecutionError, RequestError
from ..model.tokenizer import Tokenizer, load_tokenizer
from ..observe.records import current_trace
from ..observe.tracing import RequestTracer, TracingConfig
from .interceptor import TracingInterceptor, deadline_passed, end_rpc, ended_status, request_id
from .admin import ADMIN, AdminServicer, apply_current_catalogs
from .model_info import model_info
from .reflection import enable_reflection
from .stalls import REASONS as STALL_REASONS, StallInterceptor, StallWatch
from .tls import check_tls_settings, server_credentials
from .status import NotServing, connection_options, server_options, status_of
from .wire import invalid_utf8_field
from .fronts.state import DEADLINE_KEY, MAX_FRONTS, SENT_KEY, STATE_DRAINING, STATE_SERVING, client_id
from .fronts.supervisor import FrontOptions, FrontSupervisor

log = logging.getLogger("slmrank.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RANKER = "slmrank.v1.Ranker"
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# GET /trace listens here only: request timings are for whoever runs the process (in a pod:
# `kubectl port-forward` reaches the loopback), never for the network
TRACE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051  # 0: any free port
    grace_s: float = 20.0  # SIGTERM -> exit, at most; Kubernetes kills after 30 s by default
    max_receive_message_bytes: int = 1 << 20  # a Score at its limits is ~10 KiB of ids
    max_send_message_bytes: int = 4 << 20
    admission: AdmissionConfig | None = None
    # the codec has run the engine's validation already: the scheduler need not repeat it
    batcher: BatcherConfig = field(default_factory=lambda: BatcherConfig(validate_requests=False))
    # a second, plaintext listener with grpc.health.v1 only (kubelet probes: pod IP, no TLS); None: none.
    # Its address is no serve setting: it answers SERVING / NOT_SERVING and nothing else, for probes
    # that reach the pod IP, so every address (gRPC's 0.0.0.0 takes IPv6 as well); tests bind 127.0.0.1.
    health_host: str = "0.0.0.0"
    health_port: int | None = None
    # TLS on the API port with a certificate and key (PEM files); mTLS with a client CA as well
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # observability; None: the SLMRANK_TRACE_* / OTEL_EXPORTER_OTLP_* environment, else TracingConfig's default
    metrics_host: str = "127.0.0.1"  # GET /metrics: its own address, off the gRPC event loop
    metrics_port: int | None = None  # (0: any free one); None: not served
    trace_port: int | None = None  # GET /trace on TRACE_HOST (0: any free one); None: not served
    trace_sample_rate: float | None = None
    trace_slow_ms: float | None = None
    trace_max_kept_per_s: float | None = None
    trace_chrome_max_events: int | None = None
    otlp_endpoint: str | None = None  # "": no export, whatever the environment says
    trace_file: str | None = None  # the Chrome trace of the kept requests, written when the server stops
    access_log: bool = False  # one log record per finished RPC (logger slmrank.access)
    # front processes on the public port (SO_REUSEPORT) that refuse what admission would refuse and
    # forward the rest to this process over a Unix socket (fronts.py); 0: this process listens itself
    fronts: int = 0
    # a call waiting on its client longer than this is cancelled (stalls.py): for its whole request
    # message (from its headers), and for its answer to be written (a zero flow-control window, a
    # client that does not read)
    receive_timeout_s: float = 5.0
    send_timeout_s: float = 5.0
    # what one connection may hold (status.connection_options), on every listener: its HTTP/2 set-up
    # finished within this (else it is closed), streams open at once, and connections at once
    handshake_timeout_s: float = 10.0
    max_streams_per_connection: int = 2048
    max_connections: int = 1024
    # Admin.ReplaceCatalog reads catalog files under this directory (admin.py); None: the RPC is off.
    # The runtime then holds room for catalogs catalog_headroom x the artifact's (load_model).
    catalog_dir: str | None = None
    catalog_headroom: float = 1.25

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "health_port", "trace_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name}: {value} is outside [0, 65535]")
        for name in ("grace_s", "receive_timeout_s", "send_timeout_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_streams_per_connection", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_receive_message_bytes", "max_send_message_bytes"):
            if getattr(self, name) < 1024:
                raise ValueError(f"{name}: must be >= 1024, got {getattr(self, name)}")
        if self.catalog_dir is not None and not Path(self.catalog_dir).is_dir():
            raise ValueError(f"catalog_dir: {self.catalog_dir} is not a directory")
        if not self.catalog_headroom >= 1.0:
            raise ValueError(f"catalog_headroom: must be >= 1.0, got {self.catalog_headroom}")
        if not 0 <= self.fronts <= MAX_FRONTS:
            raise ValueError(f"fronts: must be in [0, {MAX_FRONTS}], got {self.fronts}")
        check_tls_settings(self.tls_cert, self.tls_key, self.tls_client_ca)

    def connection_options(self) -> list[tuple[str, Any]]:
        return connection_options(self.handshake_timeout_s, self.max_streams_per_connection, self.max_connections)

    def tracing(self) -> TracingConfig:
        """The environment's tracing settings, these options over them (raises ValueError)."""
        return TracingConfig.from_env(sample_rate=self.trace_sample_rate, slow_ms=self.trace_slow_ms,
                                      max_kept_per_s=self.trace_max_kept_per_s,
                                      chrome_max_events=self.trace_chrome_max_events, otlp_endpoint=self.otlp_endpoint)


@dataclass(frozen=True)
class Model:
    artifact: Artifact
    runtime: Any  # PythonRuntime | CppRuntime
    tokenizer: Tokenizer
    spec: str = ""  # what --model said


def load_model(spec: str, runtime: str = "python", device: str = "cpu", dtype: str | None = None,
               quiet: bool = True, capture_graphs: bool = True, kernels: str = "aten", num_lanes: int = 0,
               catalog_headroom: float = 1.0, capture_lanes_at_once: bool = False, beam_graphs: str = "bucket") -> Model:
    """Artifact, runtime with its CUDA graphs captured (CppRuntime on a GPU; with
    capture_graphs=False each bucket's graph is captured by its first batch; capture_lanes_at_once:
    the lanes capture at once, each on its own thread), tokenizer.
    catalog_headroom: the room the runtime holds for replaced catalogs (ServerConfig.catalog_dir).
    beam_graphs: the C++ runtime's BeamSearch graphs (CppRuntime)."""
    artifact = resolve_artifact(spec, quiet=quiet)
    rt = factory.make_runtime(runtime, artifact, device, dtype, kernels, num_lanes=num_lanes,
                              catalog_headroom=catalog_headroom, beam_graphs=beam_graphs)
    if capture_graphs and hasattr(rt, "capture"):
        rt.capture(quiet=quiet, lanes_at_once=capture_lanes_at_once)
    return Model(artifact, rt, load_tokenizer(artifact.tokenizer_dir), spec)


# no batch may run longer than this share of the SIGTERM grace: one running when the drain begins
# leaves the rest of the grace to the requests queued behind it (issue 32, point 6)
BATCH_GRACE_SHARE = 0.5
# on a CPU, the batches in flight together may take this share of the memory the host has left once
# the model is loaded (service/sched/memory.py); on a GPU the graphs' memory is taken at capture
BATCH_MEMORY_SHARE = 0.5


def batch_memory_bytes(runtime: Any, batcher: BatcherConfig | None) -> float:
    """The activation bytes one batch may take: inf on a GPU; on a CPU, BATCH_MEMORY_SHARE of what
    the host has left, shared by the batches that may run at once."""
    if getattr(getattr(runtime, "device", None), "type", "cpu") != "cpu":
        return math.inf
    inflight = (batcher or BatcherConfig()).max_inflight
    return BATCH_MEMORY_SHARE * available_memory_bytes() / max(inflight, 1)
DRAIN_LULL_S = 1.0  # shutdown closes the listener once no Ranker RPC has arrived for this long (or at the grace);
# an idle server (nothing for this long already) stops at once; longer than a loaded client's pauses


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps every exception a Ranker handler raises to a status code, and counts the codes. Also
    the bound on Ranker RPCs being handled at once: one more is refused before its bytes are even
    parsed (UNAVAILABLE, reason rpc_limit, with a retry hint from `busy_hint_s`)."""

    def __init__(self, max_inflight: int = 1024, busy_hint_s: Callable[[], float] = lambda: 0.1) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()  # (method, code name)
        self.max_inflight, self.busy_hint_s = max_inflight, busy_hint_s
        self.inflight = 0
        self.last_arrival_s = -math.inf  # time.monotonic() of the latest Ranker RPC (shutdown waits for a lull)

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not details.method.startswith(f"/{RANKER}/"):
            return handler  # health and reflection are left as they are
        method, behavior = details.method.rsplit("/", 1)[1], handler.unary_unary
        deserialize = handler.request_deserializer

        async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            self.inflight += 1
            self.last_arrival_s = time.monotonic()
            try:  # parsed here, not by grpc: corrupt bytes are the client's error, INVALID_ARGUMENT
                if self.inflight > self.max_inflight:
                    raise Overloaded("rpc_limit", self.busy_hint_s(), f"{self.max_inflight} requests are being "
                                     "handled at once already")
                with current_trace().stage("receive"):
                    request = _parse(deserialize, raw, method)
                response = await behavior(request, context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:  # gRPC ended the RPC: its deadline passed, or the client cancelled
                self.counts[method, ended_status(context)] += 1
                raise
            except Exception as e:  # noqa: BLE001 -- the one place where errors become status codes
                code, message, trailers = status_of(e)
                if code == grpc.StatusCode.INTERNAL:  # logged once, with an id its client is given too
                    rid = request_id()
                    log.error("%s failed (request %s)", method, rid, exc_info=e,
                              extra={"request_id": rid, "method": method})
                    message = f"{message} (request {rid})"
                # the status its client sees: a refusal racing gRPC's own deadline ends quietly (end_rpc)
                self.counts[method, "DEADLINE_EXCEEDED" if deadline_passed(context) else code.name] += 1
                await end_rpc(context, code, message, trailers)
            finally:
                self.inflight -= 1
            if deadline_passed(context):
                # answered as the deadline passed: gRPC is ending (or has ended) the RPC with
                # DEADLINE_EXCEEDED, and sending the answer into it would fail in gRPC's core with a
                # logged traceback; as a cancelled handler, it ends quietly (as the fronts' do)
                self.counts[method, "DEADLINE_EXCEEDED"] += 1
                raise asyncio.CancelledError
            self.counts[method, "OK"] += 1
            return response

        return grpc.unary_unary_rpc_method_handler(call, response_serializer=_passing_bytes(handler.response_serializer))


def _passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes]:
    """The method's serializer, except for a response the handler already wrote as wire bytes
    (Codec.beam_response)."""
    def send(response: Any) -> bytes:
        if type(response) is bytes or serialize is None:
            return response
        return serialize(response)
    return send


def _parse(deserialize: Callable[[bytes], Any], raw: bytes, method: str) -> Any:
    try:
        return deserialize(raw)
    except DecodeError as e:
        descriptor = load_stubs().pb2.DESCRIPTOR.services_by_name["Ranker"].methods_by_name[method].input_type
        bad = invalid_utf8_field(descriptor, raw)
        if bad is not None:
            raise RequestError(*bad) from None
        raise RequestError("request", f"not a valid {method} request message ({e})") from None


# ---- the service ------------------------------------------------------------------------------------

def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The request's deadline on time.monotonic(): gRPC's, or the caller's own as a front forwarded
    it (DEADLINE_KEY) where that is sooner. A front's forwarded call runs a little past its
    caller's deadline, and scheduled by that, an admitted request could run past the deadline its
    caller holds. The stamp only ever shortens a deadline: a caller who sets it itself gains nothing."""
    remaining = context.time_remaining()
    deadline = None if remaining is None else time.monotonic() + remaining
    stamped = _stamp(context, DEADLINE_KEY)
    if stamped is not None and (deadline is None or stamped < deadline):
        return stamped
    return deadline


def _stamp(context: grpc.aio.ServicerContext, key: str) -> float | None:
    """A front's time stamp (time.monotonic(), one clock for the host's processes) in the metadata."""
    for k, v in context.invocation_metadata() or ():
        if k == key:
            try:
                t = float(v)
            except (TypeError, ValueError):
                return None
            return t if math.isfinite(t) else None
    return None


def client_of(context: grpc.aio.ServicerContext, key: str) -> str:
    """Whose request it is, for fair shares (front_state.client_id: the `key` metadata, else the peer's host)."""
    return client_id(context.invocation_metadata(), context.peer() or "", key)


@dataclass
class RankerServicer:
    codec: Codec | None = None
    scheduler: Scheduler | None = None
    info: Any = None  # the ModelInfoResponse, once the model is loaded
    is_draining: bool = False
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    front_publisher: Any = None  # serve --fronts: fronts.FrontPublisher (the ingress delay is noted for it)

    def _serving(self) -> tuple[Codec, Scheduler]:
        if self.is_draining:
            raise NotServing("draining", self.unavailable_hint_s)
        if self.codec is None or self.scheduler is None:
            raise NotServing("loading", self.unavailable_hint_s)
        return self.codec, self.scheduler

    @property
    def unavailable_hint_s(self) -> float:
        return self.admission.retry_hint_s(self.admission.unavailable_retry_s)

    def busy_hint_s(self) -> float:
        """The retry hint of an RPC refused for the bound on RPCs at once."""
        if self.scheduler is None:
            return self.unavailable_hint_s
        return self.scheduler.admission.backlog_hint_s()

    async def _handle(self, request: Any, context: grpc.aio.ServicerContext, kind: str) -> Any:
        """decode (validate + tokenize) -> schedule -> encode; kind: "score" or "beam"."""
        trace = current_trace()
        if (lane := lane_of(request.priority)) is not None:
            # the lane the latency metric counts the request in: known from the message, so also a
            # request refused or invalid below lands in its lane (set_request sets the same name)
            trace.attrs["priority"] = lane.name
        codec, scheduler = self._serving()
        if self.front_publisher is not None and (sent_s := _stamp(context, SENT_KEY)) is not None:
            # the hop from the front to this handler, on the request's span (before its start: an attribute)
            trace.set(front_ingress_ms=round(self.front_publisher.note_ingress(sent_s) * 1e3, 3))
        deadline, client = _deadline(context), client_of(context, self.admission.client_id_metadata)
        # admission's gate first, on the message's shape alone: under overload most requests are
        # refused, and a refusal must cost the event loop little (no validation, no tokenization),
        # or refusing alone saturates it and every request waits in gRPC's queue
        shape = codec.shape_of(kind, request)
        if shape is not None:
            scheduler.precheck(*shape, deadline, client)
        with trace.stage("decode"):
            req, priority = getattr(codec, f"{kind}_request")(request)
        trace.set_request(req, priority)
        done = await scheduler.submit(req, priority, deadline, client)
        trace.completed(done)
        # from the batch's end to here: its results unpacked, the answers settled, this task resumed
        answered_ns, now_ns = round(done.timings.batch_end_s * 1e9), time.monotonic_ns()
        if answered_ns <= now_ns:  # (a scheduler on another clock, in tests: no such stage)
            trace.add_stage("answer", answered_ns, now_ns)
        with trace.stage("encode"):
            return getattr(codec, f"{kind}_response")(done.result)

    async def Score(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._handle(request, context, "score")

    async def BeamSearch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._handle(request, context, "beam")

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.info is None:
            raise NotServing("loading", self.unavailable_hint_s)
        return self.info

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        codec, _ = self._serving()
        with current_trace().stage("decode"):
            return codec.tokenize(request)


@dataclass
class RankerServer:
    config: ServerConfig
    loader: Callable[[], Model]  # runs in a worker thread while health says NOT_SERVING
    port: int = 0
    model: Model | None = None
    servicer: RankerServicer = field(default_factory=RankerServicer)
    interceptor: StatusInterceptor = field(default_factory=StatusInterceptor)
    health: health.aio.HealthServicer = field(default_factory=health.aio.HealthServicer)
    span_exporter: Any = None  # an OTel SpanExporter instead of OTLP (tests: InMemorySpanExporter)
    tracer: RequestTracer | None = None  # set by start()
    metrics: ServerMetrics | None = None
    metrics_server: MetricsServer | None = None  # with config.metrics_port; .port is the bound one
    trace_server: MetricsServer | None = None  # with config.trace_port (and a Chrome writer); likewise
    health_port: int | None = None  # the bound health-only port, with config.health_port
    fronts: FrontSupervisor | None = None  # with config.fronts
    stalls: StallWatch | None = None  # set by start(): the calls waiting on their clients (both listeners)
    _server: grpc.aio.Server | None = None
    _health_server: grpc.aio.Server | None = None
    _loading: asyncio.Task | None = None
    _observability_closed: bool = False

    async def start(self) -> int:
        """Binds, answers health checks (NOT_SERVING) and starts loading the model. Returns the port."""
        stubs = load_stubs()
        self.tracer = RequestTracer(self.config.tracing(), exporter=self.span_exporter)
        self.metrics = ServerMetrics()
        self.servicer.admission = self.config.admission or AdmissionConfig()
        self.interceptor.max_inflight = self.servicer.admission.max_inflight_rpcs
        self.interceptor.busy_hint_s = self.servicer.busy_hint_s
        self.stalls = StallWatch(self.config.receive_timeout_s, self.config.send_timeout_s)
        self.stalls.start()
        # StallInterceptor outermost (a call's waits on its client take in the other interceptors'
        # work), then TracingInterceptor: it reads the code StatusInterceptor aborted with
        access_log = logging.getLogger("slmrank.access") if self.config.access_log else None
        interceptors = [StallInterceptor(self.stalls), TracingInterceptor(self.tracer, self.metrics,
                                                                          access_log=access_log), self.interceptor]
        self._server = grpc.aio.server(interceptors=interceptors, options=server_options(
            self.servicer.admission.max_inflight_rpcs, self.config.max_receive_message_bytes,
            self.config.max_send_message_bytes, connections=self.config.connection_options()))
        stubs.pb2_grpc.add_RankerServicer_to_server(self.servicer, self._server)
        stubs.pb2_grpc.add_AdminServicer_to_server(AdminServicer(self, stubs.pb2), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection([RANKER, ADMIN, HEALTH], self._server)
        await self._set_health(NOT_SERVING)
        try:
            await self._listen()
        except BaseException:
            # a start-up mistake (TLS file, taken port): close what was opened, or the grpc.aio servers
            # left behind block whichever thread garbage-collects them later (an embedding process)
            await self._close_listeners()
            raise
        self._loading = asyncio.create_task(self._load())
        return self.port

    async def _listen(self) -> None:
        assert self._server is not None
        credentials = None
        if self.config.tls_cert and self.config.tls_key:
            credentials = server_credentials(self.config.tls_cert, self.config.tls_key, self.config.tls_client_ca)
        cfg = self.config
        if cfg.fronts:  # the fronts own the public port; this process listens on a Unix socket for them
            admission = self.servicer.admission
            self.fronts = FrontSupervisor(cfg.fronts, FrontOptions(
                cfg.host, cfg.port, admission.client_id_metadata, cfg.max_receive_message_bytes,
                cfg.max_send_message_bytes, cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, admission.max_inflight_rpcs,
                cfg.receive_timeout_s, cfg.send_timeout_s, cfg.handshake_timeout_s, cfg.max_streams_per_connection,
                cfg.max_connections))
            _bind(self._server, "unix", 0, None, address=self.fronts.engine_target)
        else:
            self.port = _bind(self._server, cfg.host, cfg.port, credentials)
        if self.config.health_port is not None:
            self._health_server = grpc.aio.server(interceptors=[StallInterceptor(self.stalls)],
                                                  options=[("grpc.so_reuseport", 0),
                                                           *self.config.connection_options()])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = _bind(self._health_server, self.config.health_host, self.config.health_port, None)
            await self._health_server.start()
        if self.config.metrics_port is not None:
            self.metrics_server = MetricsServer(self.metrics, self.config.metrics_host, self.config.metrics_port)
            self.metrics_server.start()  # GET /metrics, on a thread of its own; BindError
        chrome = self.tracer.chrome if self.tracer else None
        if self.config.trace_port is not None and chrome is None:
            log.warning("no /trace on port %s: TracingConfig.chrome_max_events is 0", self.config.trace_port)
        elif self.config.trace_port is not None:
            # a thread of its own: a client reading megabytes of trace never delays a scrape
            self.trace_server = MetricsServer(self.metrics, TRACE_HOST, self.config.trace_port, chrome=chrome,
                                              serve_metrics=False)
            self.trace_server.start()
        await self._server.start()
        if self.fronts is not None:
            self.port = await self.fronts.start()

    async def _close_listeners(self) -> None:
        if self.fronts is not None:
            await self.fronts.stop()
        for server in (self._server, self._health_server):
            if server is not None:
                await server.stop(None)
        if self.stalls is not None:
            self.stalls.stop()
        for http_server in (self.metrics_server, self.trace_server):
            if http_server is not None:
                http_server.close()
        self.metrics_server = self.trace_server = None

    async def _load(self) -> None:
        t0 = time.monotonic()
        self.model = await _in_daemon_thread(self.loader)
        scheduler = Scheduler(self.model.artifact, self.model.runtime, self.config.admission, self.config.batcher,
                              max_batch_s=BATCH_GRACE_SHARE * self.config.grace_s,
                              max_batch_bytes=batch_memory_bytes(self.model.runtime, self.config.batcher))
        await scheduler.start()
        if self.config.catalog_dir is not None:  # DIR/NAME.tsv: the catalog NAME to serve (admin.py)
            await apply_current_catalogs(self.config.catalog_dir, scheduler, self.model.artifact.config.vocab_size)
        if self.metrics is not None:
            stats = scheduler.stats if self.fronts is None else (
                lambda: _with_front_counts(scheduler.stats(), self.fronts))
            self.metrics.stats_source = lambda: {**stats(), "stalled": self.stalled()}
        self.servicer.info = model_info(load_stubs().pb2, self.model.spec, self.model.artifact, self.model.runtime,
                                        scheduler.catalogs)
        if self.metrics is not None:
            self.metrics.set_model(self.servicer.info)
        self.servicer.codec, self.servicer.scheduler = Codec(self.model.artifact, self.model.tokenizer), scheduler
        if self.fronts is not None:
            publisher = self.fronts.publisher
            publisher.attach(scheduler.admission, self.model.artifact.limits, self.servicer.codec.max_token_bytes)
            scheduler.on_precheck = publisher.note_shape
            self.servicer.front_publisher = publisher
            publisher.set_state(STATE_SERVING)
        _freeze_heap()
        await self._set_health(SERVING)
        # the model and its limits: `slmrank traffic` finds the default bucket table of a log's server here
        graphs = getattr(self.model.runtime, "num_graphs", 0)  # the C++ runtime's, every lane's (0: none)
        log.info("model loaded in %.1f s: SERVING%s", time.monotonic() - t0,
                 f" ({graphs} CUDA graphs captured)" if graphs else "",
                 extra={"model": self.model.spec, "limits": self.model.artifact.limits.to_dict(), "graphs": graphs})

    async def wait_ready(self) -> None:
        """Returns once SERVING; raises what the loader raised."""
        assert self._loading is not None, "start() first"
        await asyncio.shield(self._loading)

    async def _set_health(self, status: int) -> None:
        for service in ("", RANKER):
            await self.health.set(service, status)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, refuse new work, finish what is in flight, stop; within grace_s."""
        grace_s = self.config.grace_s if grace_s is None else grace_s
        end = time.monotonic() + grace_s
        margin_s = min(2.0, 0.1 * grace_s)  # for the last answers to go out and the process to exit
        await self.health.enter_graceful_shutdown()
        self.servicer.is_draining = True
        if self.fronts is not None:  # the fronts refuse new work at once ("draining")
            self.fronts.publisher.set_state(STATE_DRAINING)
        if self._loading is not None and not self._loading.done():
            self._loading.cancel()
        try:
            if self.servicer.scheduler is not None:
                is_drained = await self.servicer.scheduler.drain(max(end - margin_s - time.monotonic(), 0.0))
                log.info("drain %s after %.2f s", "complete" if is_drained else "cut short by the grace",
                         grace_s - (end - time.monotonic()))
            # requests still arriving get "draining" (UNAVAILABLE, a hint: another replica) until they
            # stop coming or the grace runs out: one that reached gRPC at the instant its listener
            # closes would be CANCELLED by gRPC itself, with nothing a client can act on
            while (time.monotonic() - self._last_arrival_s() < DRAIN_LULL_S
                   and time.monotonic() < end - margin_s):
                await asyncio.sleep(DRAIN_LULL_S / 4)
        finally:
            if self.fronts is not None:  # they finish relaying the last answers, then this listener closes
                await self.fronts.stop(max(min(end - margin_s / 2 - time.monotonic(), 2.0), 0.1))
            if self._server is not None:  # answers sent, then the listener closes
                await self._server.stop(max(end - margin_s / 2 - time.monotonic(), 0.0))
            if self._health_server is not None:
                await self._health_server.stop(0)
            if self.stalls is not None:
                self.stalls.stop()
            if self.servicer.scheduler is not None:
                await self.servicer.scheduler.close()
            if self.model is not None and hasattr(self.model.runtime, "shutdown"):
                self.model.runtime.shutdown()
            await self._close_observability()

    async def _close_observability(self) -> None:
        """The metrics and trace ports close, the exporter flushes, the Chrome trace file is written (once)."""
        for http_server in (self.metrics_server, self.trace_server):
            if http_server is not None:
                http_server.close()
        if self.tracer is None or self._observability_closed:
            return
        self._observability_closed = True
        self.tracer.shutdown()
        path = self.config.trace_file
        if path is None:
            return
        if self.tracer.chrome is None:
            log.warning("no Chrome trace to write to %s: TracingConfig.chrome_max_events is 0", path)
            return
        try:
            num_events = self.tracer.chrome.write(path)
        except OSError as e:
            log.error("writing the Chrome trace to %s failed: %s", path, e)
            return
        log.info("Chrome trace of %d kept requests (%d events) written to %s", self.tracer.num_kept, num_events, path)

    def _last_arrival_s(self) -> float:
        last = self.interceptor.last_arrival_s
        return last if self.fronts is None else max(last, self.fronts.last_arrival_s())

    def stalled(self) -> dict[str, int]:
        """Calls cancelled while they waited on their clients, by reason (stalls.REASONS), the fronts' included."""
        counts = dict(self.stalls.cancelled) if self.stalls is not None else {r: 0 for r in STALL_REASONS}
        if self.fronts is not None:
            front_counts = self.fronts.counts()
            for reason in counts:
                counts[reason] += front_counts[f"stalled_{reason}"]
        return counts

    def stats(self) -> dict[str, Any]:
        codec, scheduler, tracer = self.servicer.codec, self.servicer.scheduler, self.tracer
        return {
            "stalled": self.stalled(),
            **({"fronts": {**self.fronts.counts(), "restarts": self.fronts.restarts}} if self.fronts else {}),
            "statuses": {f"{m}.{c}": n for (m, c), n in sorted(self.interceptor.counts.items())},
            "tokenize": codec.tokenize_stats.as_dict() if codec else {},
            "scheduler": scheduler.stats() if scheduler else {},
            "tracing": {"finished": tracer.num_finished, "kept": tracer.num_kept,
                        "over_budget": tracer.num_over_budget} if tracer else {},
        }


def _with_front_counts(stats: dict[str, Any], fronts: FrontSupervisor) -> dict[str, Any]:
    """The scheduler's stats with the fronts' refusals among the refusals (reason front_<reason>)."""
    counts = fronts.counts()
    refused = {**stats["refused"], **{f"front_{k[len('refused_'):]}": v for k, v in counts.items()
                                      if k.startswith("refused_")}}
    return {**stats, "refused": refused, "front_forwarded": counts["forwarded"],
            "front_ingress_s": fronts.publisher.ingress_delay_s()}


def _bind(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
          address: str | None = None) -> int:
    address = address or f"{host}:{port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as e:  # grpc: "Failed to bind to address ..."
        raise BindError(f"cannot listen on {address}: the port is in use or the address is not available") from e


def _freeze_heap() -> None:
    """Moves every object alive after loading (the model's Python side, torch, grpc, the tokenizer:
    hundreds of thousands) out of the garbage collector's reach. Python's full collection walks
    them all: on a 2-core machine one took up to 385 ms, stalling the event loop and every request
    on it (a light client's p99 went from 29 to 323-493 ms beside maximal requests). Frozen, a full
    collection walks only what serving allocates; what loading left behind is never freed, which
    is what a long-lived server wants of it anyway."""
    gc.collect()
    gc.freeze()
    log.debug("garbage collector: %d objects frozen after loading", gc.get_freeze_count())


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """asyncio.to_thread, but on a daemon thread: a SIGTERM during a long load exits without waiting for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # noqa: BLE001 -- handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: the server stopped while loading
            pass

    threading.Thread(target=run, name="slmrank-load", daemon=True).start()
    return await future


# ---- the process --------------------------------------------------------------------------------

def serve(config: ServerConfig, loader: Callable[[], Model], announce: Callable[[str], None] = print,
          on_ready: Callable[[RankerServer], None] | None = None) -> int:
    """Runs the server on a uvloop event loop created here, until SIGTERM/SIGINT. Returns the exit code."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve_until_signal(config, loader, announce, on_ready))


class _LoopProfile:
    """SLMRANK_PROFILE_LOOP=FILE: cProfile of the event loop from SERVING until the stop signal,
    written to FILE (pstats format; `python -m pstats FILE`). Every request passes through this one
    thread, so where its CPU goes is where a serving overhead is (debugging; slows the loop)."""

    def __init__(self, path: str) -> None:
        import cProfile

        self.path = path
        # the thread's CPU time, not the wall clock: what saturates the loop, without the time the
        # thread spent descheduled or waiting for the GIL (a busy host would blame whatever ran then)
        self.profile = cProfile.Profile(time.thread_time)
        self.profile.enable()
        log.warning("profiling the event loop into %s until the server stops", path)

    @classmethod
    def from_env(cls) -> "_LoopProfile | None":
        path = os.environ.get("SLMRANK_PROFILE_LOOP")
        return cls(path) if path else None

    def dump(self) -> None:
        self.profile.disable()
        try:
            self.profile.dump_stats(self.path)
        except OSError as e:
            log.error("cannot write the event-loop profile: %s", e)


def _exit_after(grace_s: float) -> None:
    """The grace is a promise: should a batch outlast it, the process exits anyway (code 1)."""
    def force_exit() -> None:
        log.error("the %.0f s grace is over with work still running: exiting now", grace_s)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(grace_s, force_exit)
    timer.daemon = True
    timer.start()


async def _serve_until_signal(config: ServerConfig, loader: Callable[[], Model], announce: Callable[[str], None],
                              on_ready: Callable[[RankerServer], None] | None) -> int:
    loop = asyncio.get_running_loop()
    server = RankerServer(config, loader)
    stop = asyncio.Event()
    shutting_down: list[asyncio.Task] = []

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: draining (grace %.0f s)", sig.name, config.grace_s)
            stop.set()
            _exit_after(config.grace_s)
        elif shutting_down:
            log.warning("%s again: stopping now", sig.name)
            shutting_down[0].cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    port = await server.start()
    fronts = f", through {config.fronts} front processes" if config.fronts else ""
    announce(f"listening on {config.host}:{port}{fronts} (health NOT_SERVING until the model is loaded)")
    if server.health_port is not None:
        announce(f"health (grpc.health.v1, plaintext) on {config.health_host}:{server.health_port}")
    if server.metrics_server is not None:
        announce(f"metrics on http://{config.metrics_host}:{server.metrics_server.port}/metrics")
    if server.trace_server is not None:
        announce(f"Chrome trace of the kept requests on http://{TRACE_HOST}:{server.trace_server.port}/trace "
                 "(read it with `slmrank trace FILE`)")
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if ready.done() and ready.exception() is not None:
        error = ready.exception()
        if isinstance(error, (ValueError, OSError)):  # a start-up mistake (the model, its files): one line
            log.error("cannot load the model: %s", error)
            code = 2
        else:
            log.error("loading the model failed", exc_info=error)
            code = 1
    elif ready.done() and on_ready is not None:
        on_ready(server)
    profile = _LoopProfile.from_env() if code == 0 else None
    if code == 0:
        await stopped
    if profile is not None:
        profile.dump()
    stopped.cancel()
    shutting_down.append(asyncio.ensure_future(server.shutdown()))
    try:
        await shutting_down[0]
    except asyncio.CancelledError:
        await server.shutdown(grace_s=0.001)
        return 1
    log.info("stopped: %s", server.stats()["statuses"])
    return code
