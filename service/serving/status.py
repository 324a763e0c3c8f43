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


def server_options(max_inflight_rpcs: int, max_receive_message_bytes: int, max_send_message_bytes: int,
                   reuse_port: bool = False) -> list[tuple[str, Any]]:
    """A Ranker listener's gRPC options (the engine's and each front's)."""
    return [
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


__all__ = ["PUSHBACK_KEY", "RETRY_KEY", "NotServing", "Status", "server_options", "status_of"]
