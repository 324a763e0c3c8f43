"""ops/bench/h2call.py against a real grpc.aio server: the answers a grpc client gets (status, message,
trailers, body), deadlines, and messages larger than HTTP/2's default windows both ways, many
calls on one connection."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import grpc
import pytest

from ops.bench import h2call


class _Handlers(grpc.GenericRpcHandler):
    def service(self, details: grpc.HandlerCallDetails) -> Any:
        async def echo(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.send_initial_metadata((("x-seen", dict(context.invocation_metadata()).get("x-who", "")),))
            return raw[::-1]

        async def big(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return bytes(range(256)) * (int(raw) // 256)

        async def refuse(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded (100% busy): refused; retry after 5 ms",
                                trailing_metadata=(("retry-after-ms", "5"),))

        async def slow(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            await asyncio.sleep(1.0)
            return b"late"

        handlers = {"/t/Echo": echo, "/t/Big": big, "/t/Refuse": refuse, "/t/Slow": slow}
        if details.method in handlers:
            return grpc.unary_unary_rpc_method_handler(handlers[details.method])
        return None


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    ready, box = threading.Event(), {}

    def run() -> None:
        async def serve() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_Handlers(),))
            box["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            box["stop"] = asyncio.Event()
            box["loop"] = asyncio.get_running_loop()
            ready.set()
            await box["stop"].wait()
            await server.stop(0)
        asyncio.run(serve())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    yield box["port"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    t.join(10)


def test_answers_as_a_grpc_client_gets_them(port: int) -> None:
    with h2call.H2Caller("127.0.0.1", port) as c:
        ok = c.call("/t/Echo", b"abc\x00def", timeout_s=5.0, metadata=(("x-who", "quiet"),))
        assert (ok.status, ok.body, ok.trailers.get("x-seen")) == (0, b"fed\x00cba", "quiet")
        refused = c.call("/t/Refuse", b"x", timeout_s=5.0)
        assert refused.status == grpc.StatusCode.UNAVAILABLE.value[0]
        assert refused.message == "overloaded (100% busy): refused; retry after 5 ms"
        assert refused.trailers["retry-after-ms"] == "5" and refused.body is None
        late = c.call("/t/Slow", b"", timeout_s=0.05)
        assert late.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert 0.04 < late.latency_s < 0.9
        missing = c.call("/t/Nope", b"")
        assert missing.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
        assert c.call("/t/Echo", b"", timeout_s=5.0).body == b""  # an empty message, after all the rest


def test_messages_past_the_default_windows_both_ways_many_calls_on_one_connection(port: int) -> None:
    """300 KB requests (the server's 64 KB windows: sent as its WINDOW_UPDATEs come) and 200 KB
    answers (ours: given back as read), 40 calls in a row on one connection: each one intact."""
    request = bytes(range(251)) * 1200
    with h2call.H2Caller("127.0.0.1", port) as c:
        for i in range(20):
            assert c.call("/t/Echo", request + bytes([i]), timeout_s=10.0).body == bytes([i]) + request[::-1]
            n = 200_000 + 256 * i
            assert c.call("/t/Big", str(n).encode(), timeout_s=10.0).body == bytes(range(256)) * (n // 256)


def test_the_timeout_header_fits_its_eight_digits() -> None:
    """The gRPC spec's TimeoutValue is at most 8 digits (grpc's own server takes more; others need not)."""
    assert h2call.grpc_timeout(0.08) == "80000u"
    assert h2call.grpc_timeout(1e-9) == "1u"
    assert h2call.grpc_timeout(99.0) == "99000000u"
    assert h2call.grpc_timeout(1000.0) == "1000000m"  # 10^9 µs: too many digits
    assert h2call.grpc_timeout(10 ** 6) == "1000000S"

