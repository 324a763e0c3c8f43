"""Errors -> gRPC status codes, in one place, and the gRPC server options both listeners use: the
engine's server (StatusInterceptor) and the front processes answer with exactly these. Imports no
torch (the fronts use it).

| error                                   | status             | message, trailers                      |
|-----------------------------------------|--------------------|----------------------------------------|
| RequestError (a field is wrong)         | INVALID_ARGUMENT   | names the field                        |
| Overloaded (admission refused it)       | UNAVAILABLE        | reason and detail; the retry hint      |
| NotServing (loading, draining)          | UNAVAILABLE        | the retry hint                         |
| DeadlineExpired / DeadlineUnmeetable    | DEADLINE_EXCEEDED  | why; no retry helps                    |
| ExecutionError (its batch failed)       | INTERNAL           | the executor's message                 |
| anything else                           | INTERNAL           | the exception's type; see the log      |

The retry hint goes in two trailers with the same value in ms: `retry-after-ms` (slmrank's own, read
by clients that pace themselves) and `grpc-retry-pushback-ms`, which gRPC's built-in retry policy
honours (gRFC A6): a client channel with a retryPolicy on UNAVAILABLE waits that long before its
next attempt, without code of its own (docs/operations.md has the service config).
"""

from __future__ import annotations

from typing import Any, Literal

import grpc

from ..runtime.requests import ExecutionError, RequestError
from ..sched.verdict import DeadlineExpired, Overloaded

RETRY_KEY = "retry-after-ms"  # trailing metadata: the retry hint of an UNAVAILABLE answer, in ms
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # the same hint where gRPC's own retries read it (gRFC A6)

Status = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


class NotServing(Exception):
    """The model is still loading, or the server is draining: UNAVAILABLE, retry after retry_after_s
    (elsewhere, when draining)."""

    MESSAGES = {"loading": "the model is still loading; retry shortly",
                "draining": "the server is draining; send to another replica"}

    def __init__(self, reason: Literal["loading", "draining"], retry_after_s: float) -> None:
        super().__init__(self.MESSAGES[reason])
        self.reason = reason
        self.retry_after_s = retry_after_s


def status_of(e: Exception) -> Status:
    if isinstance(e, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e), ()
    if isinstance(e, (Overloaded, NotServing)):
        retry_ms = max(1, round(e.retry_after_s * 1000))
        hint = str(retry_ms)
        return grpc.StatusCode.UNAVAILABLE, f"{e}; retry after {retry_ms} ms", ((RETRY_KEY, hint), (PUSHBACK_KEY, hint))
    if isinstance(e, DeadlineExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or "deadline expired before the request ran", ()
    if isinstance(e, ExecutionError):
        return grpc.StatusCode.INTERNAL, str(e), ()
    return grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}); see the server log", ()


def connection_options(handshake_timeout_s: float, max_streams_per_connection: int,
                       max_connections: int) -> list[tuple[str, Any]]:
    """What one client connection may hold, as gRPC options (every listener: the API port, the
    health port, each front). gRPC's defaults bound little of it: a connection that never finishes
    its HTTP/2 set-up (nothing sent, half a preface, the server's SETTINGS never acknowledged) stays
    a minute (measured with grpcio 1.85), a connection may open any number of streams, and a server
    may hold any number of connections. tests/service/test_client_bounds.py checks that each takes effect."""
    timeout_ms = max(1, round(handshake_timeout_s * 1000))
    return [
        # the connection's set-up (TLS, then the client's HTTP/2 preface and SETTINGS), and any
        # SETTINGS of the server's left unacknowledged: past this, the connection is closed
        ("grpc.server_handshake_timeout_ms", timeout_ms),
        ("grpc.http2.settings_timeout", timeout_ms),
        # streams open at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): one more is
        # reset (REFUSED_STREAM; gRPC's clients wait for a free stream instead). Each answer waiting
        # for its client holds its stream: this also bounds the answers a connection holds
        ("grpc.max_concurrent_streams", max_streams_per_connection),
        # connections at once; one more is closed as soon as it is accepted
        ("grpc.max_allowed_incoming_connections", max_connections)]


def server_options(max_inflight_rpcs: int, max_receive_message_bytes: int, max_send_message_bytes: int,
                   reuse_port: bool = False, connections: list[tuple[str, Any]] | None = None) -> list[tuple[str, Any]]:
    """A Ranker listener's gRPC options (the engine's and each front's); `connections`: its
    connection_options."""
    return list(connections or ()) + [
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        ("grpc.max_send_message_length", max_send_message_bytes),
        # a taken port is an error, not a port silently shared with another process (gRPC's
        # default); the fronts share theirs on purpose (the kernel spreads connections over them)
        ("grpc.so_reuseport", int(reuse_port)),
        # gRPC cancels calls it received but the event loop has not taken yet beyond 1,000 (no status
        # a client can act on, never seen by the metrics): let a burst reach the bound on RPCs at
        # once instead, which answers UNAVAILABLE with a retry hint
        ("grpc.server.max_pending_requests", 8 * max_inflight_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", 32 * max_inflight_rpcs)]


__all__ = ["PUSHBACK_KEY", "RETRY_KEY", "NotServing", "Status", "connection_options", "server_options", "status_of"]
