"""One front process of `slmrank serve --fronts N` (state.py says what fronts are for).

    python -m service.serving.fronts.front --engine unix:PATH --state PATH --slot I --fronts N --host H --port P

Started by the engine (FrontSupervisor), never by hand. It listens on the public port beside the
other fronts (SO_REUSEPORT: the kernel spreads connections over them). A Score or BeamSearch is
parsed, checked by the gate on the engine's shared snapshot, and either refused here
(UNAVAILABLE with retry-after-ms, or DEADLINE_EXCEEDED for a deadline no retry can meet; the same
messages the engine gives) or forwarded as its wire bytes to the engine over the Unix socket,
with the caller's deadline and metadata and its client id (the x-client-id metadata, else the
caller's host, so fair shares still see the real client). Everything else (ModelInfo, health,
reflection) is relayed as it is, streams included. The engine's answers and statuses, trailing
metadata included, go back unchanged. No torch here: a front starts in well under a second.

It exits on SIGTERM (closing its listener, finishing what it relays, within --grace-s), and on
its own when the engine process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Any, AsyncIterator

import grpc
from google.protobuf.message import DecodeError

from ...sched.verdict import Overloaded
from ..proto_gen import load as load_stubs
from ..stalls import StallInterceptor, StallWatch
from ..status import connection_options, server_options, status_of
from .gate import FrontGate, refusal_reason
from .state import DEADLINE_KEY, SENT_KEY, SharedState, client_id

log = logging.getLogger("slmrank.front")

RANKER = "slmrank.v1.Ranker"
_REFUSED_FIELD = {"deadline": "refused_deadline", "queue_full": "refused_queue_full", "draining": "refused_unavailable",
                  "loading": "refused_unavailable", "impossible": "refused_impossible", "backlog": "refused_backlog"}
# metadata gRPC sets itself: not relayed
_OWN_KEYS = ("user-agent", "grpc-", ":")


def _relayed(metadata: Any) -> list[tuple[str, Any]]:
    """The caller's metadata, less what gRPC sets itself and the fronts' own stamps (a caller's
    would skew the engine's measure of its backlog, or its deadline)."""
    return [(k, v) for k, v in metadata or () if not k.startswith(_OWN_KEYS) and k not in (SENT_KEY, DEADLINE_KEY)]


class Front:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shared = SharedState(args.state)
        self.slot = args.slot
        self.gate = FrontGate(self.shared.read, args.fronts)
        self.pb2 = load_stubs().pb2
        self.parse = {"Score": self.pb2.ScoreRequest.FromString, "BeamSearch": self.pb2.BeamSearchRequest.FromString}
        self.channel: grpc.aio.Channel | None = None  # made on the serving loop (run)
        self.server: grpc.aio.Server | None = None
        self.inflight = 0  # Score / BeamSearch RPCs being handled here
        self._unary: dict[str, Any] = {}

    async def _ranker(self, raw: bytes, context: grpc.aio.ServicerContext, method: str, kind: str) -> bytes:
        now = time.monotonic()
        self.shared.slot_arrival(self.slot, now)
        if self.inflight >= self.args.max_inflight:  # as the engine's bound (StatusInterceptor): a clear status
            self.shared.slot_add(self.slot, "refused_queue_full")
            code, message, trailers = status_of(Overloaded(
                "rpc_limit", self.gate.backlog_hint_s(), f"{self.args.max_inflight} requests are being handled at "
                "once already"))
            await context.abort(code, message, trailing_metadata=trailers)
        self.inflight += 1
        try:
            return await self._admit_and_forward(raw, context, method, kind, now)
        finally:
            self.inflight -= 1

    async def _admit_and_forward(self, raw: bytes, context: grpc.aio.ServicerContext, method: str, kind: str,
                                 now: float) -> bytes:
        remaining = context.time_remaining()
        metadata = context.invocation_metadata()
        client = client_id(metadata, context.peer() or "", self.args.client_id_metadata)
        try:
            msg = self.parse[method](raw)
        except DecodeError:
            msg = None  # the engine names the field
        if msg is not None:
            refusal = self.gate.check(kind, msg, None if remaining is None else now + remaining, client)
            if refusal is not None:
                self.shared.slot_add(self.slot, _REFUSED_FIELD[refusal_reason(refusal)])
                code, message, trailers = status_of(refusal)
                await context.abort(code, message, trailing_metadata=trailers)
        relayed = _relayed(metadata)
        if not any(k == self.args.client_id_metadata for k, _ in relayed):
            relayed.append((self.args.client_id_metadata, client))
        sent = time.monotonic()
        relayed.append((SENT_KEY, f"{sent:.6f}"))
        if remaining is not None:
            relayed.append((DEADLINE_KEY, f"{now + remaining:.6f}"))
        self.shared.slot_add(self.slot, "forwarded")
        call = self._unary[method]
        try:
            # a little past the caller's deadline: that one ends this handler first (a cancel, passed on
            # to the engine), rather than this call answering into an RPC gRPC has already ended. The
            # engine schedules by the caller's own deadline (DEADLINE_KEY), not by this timeout
            answer = await call(raw, timeout=None if remaining is None else max(remaining - (sent - now), 0.0) + 0.05,
                                metadata=relayed)
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", trailing_metadata=tuple(e.trailing_metadata() or ()))
        if remaining is not None and time.monotonic() >= now + remaining:
            # the answer came as the caller's deadline passed: gRPC is ending (or has ended) the RPC
            # with DEADLINE_EXCEEDED; answering into it would fail in gRPC's core with a logged
            # traceback (seen on the H200, ~1 in 30,000 forwarded). As a cancelled handler, it ends quietly
            raise asyncio.CancelledError
        return answer

    async def _relay(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                     method: str) -> AsyncIterator[bytes]:
        remaining = context.time_remaining()
        call = self.channel.stream_stream(method)(requests, timeout=remaining,
                                                  metadata=_relayed(context.invocation_metadata()))
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "", trailing_metadata=tuple(e.trailing_metadata() or ()))

    def handler(self) -> grpc.GenericRpcHandler:
        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> Any:
                method = details.method
                service, _, name = method.lstrip("/").rpartition("/")
                if service == RANKER and name in ("Score", "BeamSearch"):
                    kind = "score" if name == "Score" else "beam"

                    async def ranker(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                        return await front._ranker(raw, context, name, kind)
                    return grpc.unary_unary_rpc_method_handler(ranker)

                async def relay(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
                    async for response in front._relay(requests, context, method):
                        yield response
                return grpc.stream_stream_rpc_method_handler(relay)

        return Handler()

    async def run(self) -> int:
        a = self.args
        self.channel = grpc.aio.insecure_channel(a.engine, options=[
            ("grpc.max_receive_message_length", a.max_send_message_bytes),
            ("grpc.max_send_message_length", a.max_receive_message_bytes)])
        self._unary = {m: self.channel.unary_unary(f"/{RANKER}/{m}") for m in ("Score", "BeamSearch")}
        # the engine's bounds on what one client holds, here where the clients are
        stalls = StallWatch(a.receive_timeout_s, a.send_timeout_s,
                            on_cancel=lambda reason: self.shared.slot_add(self.slot, f"stalled_{reason}"))
        stalls.start()
        # as the engine's listener: a burst reaches the bound above (UNAVAILABLE with a hint)
        self.server = grpc.aio.server(interceptors=[StallInterceptor(stalls)], options=server_options(
            a.max_inflight, a.max_receive_message_bytes, a.max_send_message_bytes, reuse_port=True,
            connections=connection_options(a.handshake_timeout_s, a.max_streams_per_connection, a.max_connections)))
        self.server.add_generic_rpc_handlers((self.handler(),))
        address = f"{a.host}:{a.port}"
        try:
            if a.tls_cert and a.tls_key:
                from ..tls import server_credentials
                self.server.add_secure_port(address, server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca))
            else:
                self.server.add_insecure_port(address)
        except RuntimeError:
            log.error("front %d: cannot listen on %s", self.slot, address)
            return 2
        await self.server.start()
        self.shared.slot_set(self.slot, "pid", os.getpid())
        self.shared.slot_set(self.slot, "ready", 1)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        parent = os.getppid()
        while not stop.is_set():  # the engine gone (this process re-parented): nothing to relay to
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                if os.getppid() != parent:
                    log.error("front %d: the engine process is gone; exiting", self.slot)
                    break
        self.shared.slot_set(self.slot, "ready", 0)
        await self.server.stop(a.grace_s)
        stalls.stop()
        await self.channel.close()
        self.shared.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.serving.fronts.front", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="the engine's gRPC target (unix:PATH)")
    p.add_argument("--state", required=True, help="the engine's shared state file")
    p.add_argument("--slot", type=int, required=True)
    p.add_argument("--fronts", type=int, default=1, help="how many fronts share the port")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--client-id-metadata", default="x-client-id")
    p.add_argument("--max-receive-message-bytes", type=int, default=1 << 20)
    p.add_argument("--max-send-message-bytes", type=int, default=4 << 20)
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-client-ca")
    p.add_argument("--grace-s", type=float, default=2.0)
    p.add_argument("--max-inflight", type=int, default=1024, help="Score/BeamSearch RPCs handled here at once")
    p.add_argument("--receive-timeout-s", type=float, default=5.0)
    p.add_argument("--send-timeout-s", type=float, default=5.0)
    p.add_argument("--handshake-timeout-s", type=float, default=10.0)
    p.add_argument("--max-streams-per-connection", type=int, default=2048)
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    args = p.parse_args(argv)
    from ...observe.logs import configure_logging
    configure_logging(args.log_level, args.log_format)  # as the engine logs
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(Front(args).run())


if __name__ == "__main__":
    sys.exit(main())
