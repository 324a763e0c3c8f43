"""Wiring traces into grpc.aio: `TracingInterceptor` goes first in the server's interceptor list
(outside the interceptor that maps exceptions to status codes). It times the request's
deserialization (receive) and the response's serialization (send), binds a RequestTrace to the RPC,
and finishes it with the final status code; then the tracer and the metrics see it. Handlers reach
the trace with `service.observe.records.current_trace()`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc

from ..observe.metrics import ServerMetrics
from ..observe.records import RequestTrace, bind_trace, bound_trace
from ..observe.tracing import RequestTracer


# the access log's `kind` of a method (`slmrank traffic` groups by it)
KINDS = {"Score": "score", "BeamSearch": "beam"}


log = logging.getLogger("slmrank.server")

# A client's deadline reaches the server as a timeout in the request's headers, so the server's
# copy of it ends a little after the client's own: a cancel this close to the server's deadline is
# the client's deadline passing (that client saw DEADLINE_EXCEEDED), not a client that gave up.
DEADLINE_SLACK_S = 0.25


def request_id() -> str:
    """An id for the log record of an unexpected failure, also given to its client (in INTERNAL's
    message), so that one finds the other."""
    return uuid.uuid4().hex[:16]


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def ended_status(context: grpc.aio.ServicerContext) -> str:
    """The status the client saw of an RPC that gRPC ended under its handler (a CancelledError):
    DEADLINE_EXCEEDED when its deadline has (all but) passed, else CANCELLED (the client cancelled)."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


async def end_rpc(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                  trailers: tuple[tuple[str, str], ...] = ()) -> NoReturn:
    """context.abort(code, ...), unless gRPC has ended the RPC already (its deadline passed), or
    ends it while the status is being sent (the deadline, or the client's cancel, racing the abort:
    gRPC's core refuses the send with an ExecuteBatchError, which gRPC would log as a traceback):
    then the handler ends as a cancelled one does, quietly. Raises AbortError or CancelledError."""
    if deadline_passed(context):
        raise asyncio.CancelledError
    try:
        await context.abort(code, message, trailing_metadata=trailers)
    except grpc.aio.AbortError:
        raise
    except grpc.aio.BaseError:  # ExecuteBatchError (the call is over), UsageError (its status went out already)
        raise asyncio.CancelledError from None
    raise AssertionError("context.abort returned")  # (it always raises)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Traces every unary RPC of `service`: receive (deserialization) -> handler -> send
    (serialization), with the final status code; then the tracer and the metrics see it.
    When the inner handler takes raw bytes (it parses them itself), the parse should be timed
    there as `with current_trace().stage("receive"): ...`.

    Put it first in the server's interceptor list, so that it wraps the interceptor that turns
    exceptions into status codes and reads the code from the context. A response that never
    reaches serialization (the client went away) is not counted."""

    def __init__(self, tracer: RequestTracer, metrics: ServerMetrics | None = None,
                 service: str = "slmrank.v1.Ranker", access_log: logging.Logger | None = None) -> None:
        self.tracer, self.metrics, self.prefix = tracer, metrics, f"/{service}/"
        self.access_log = access_log  # one record per finished RPC

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
            bind_trace(trace)  # the same task runs the handler and the serializer
            return message

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            trace = bound_trace()
            if trace is None:
                trace = RequestTrace(kind)
                bind_trace(trace)
            if self.access_log is not None:
                trace.attrs["peer"] = context.peer()
            try:
                return await behavior(request, context)
            except asyncio.CancelledError:  # gRPC ended it (the deadline, the client's cancel), or end_rpc did
                self._finish(trace, ended_status(context))
                raise
            except grpc.aio.AbortError:
                code = context.code()
                self._finish(trace, code.name if isinstance(code, grpc.StatusCode) else "INTERNAL")
                raise
            except Exception as e:  # noqa: BLE001 -- what the inner interceptor did not map: INTERNAL, never UNKNOWN
                rid = request_id()
                log.error("%s failed (request %s)", kind, rid, exc_info=e, extra={"request_id": rid, "method": kind})
                self._finish(trace, "INTERNAL")
                await end_rpc(context, grpc.StatusCode.INTERNAL,
                              f"internal error ({type(e).__name__}); see the server log (request {rid})")

        def send(response: Any) -> bytes:
            start = time.monotonic_ns()
            raw = serialize(response) if serialize else response
            trace = bound_trace()
            if trace is not None and not trace.is_finished:
                end = time.monotonic_ns()
                trace.add_stage("send", start, end)
                trace.attrs["response_bytes"] = len(raw)
                # the trace ends now, but is recorded (spans, metrics, access log: ~0.1-0.6 ms) once gRPC
                # has the bytes: on the next turn of the loop, not between the answer and its caller
                trace.end_ns, trace.status = end, "OK"
                try:
                    asyncio.get_running_loop().call_soon(self._record, trace, "OK")
                except RuntimeError:  # no loop running here (a synchronous caller): at once
                    self._record(trace, "OK")
            return raw

        return grpc.unary_unary_rpc_method_handler(call, request_deserializer=receive, response_serializer=send)

    def _finish(self, trace: RequestTrace, status: str) -> None:
        if trace.is_finished:
            return
        self._record(trace, status)

    def _record(self, trace: RequestTrace, status: str) -> None:
        """Ends the trace (unless its end is set) and records it: kept spans, metrics, access log."""
        self.tracer.finish(trace, status)
        if self.metrics is not None:
            self.metrics.observe(trace)
        if self.access_log is not None:
            latency_ns = trace.latency_ns
            latency_ms = round(latency_ns / 1e6, 3)
            # arrival on the wall clock (epoch seconds, ms): its start on the monotonic clock, moved by
            # the two clocks' offset now
            now_ns, wall_s = time.monotonic_ns(), time.time()
            arrival_s = round(wall_s - (now_ns - trace.end_ns + latency_ns) / 1e9, 3)  # type: ignore[operator]
            shape = {"kind": KINDS[trace.kind]} if trace.kind in KINDS else {}
            # trace_id / span_id: a log collector links the record to the request's spans
            self.access_log.info("%s %s %.3f ms", trace.kind, status, latency_ms,
                                 extra={"method": trace.kind, "code": status, **shape, "arrival_s": arrival_s,
                                        "latency_ms": latency_ms, **trace.attrs, **self.tracer.log_ids(trace)})
