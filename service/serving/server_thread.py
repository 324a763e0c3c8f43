"""A RankerServer on its own uvloop event loop in a background thread: for embedding the server in
a process that has other work on its main thread (integration tests, notebooks, a benchmark
harness). Production serving runs `slmrank serve`, which owns the process's one loop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .server import RankerServer


class ServerThread:
    """Starts `server` on a new thread's uvloop loop; returns once it is bound (and, with
    wait_ready, once the model is loaded). `stop()` shuts it down (drain with its grace)."""

    def __init__(self, server: RankerServer, wait_ready: bool = False, bind_timeout_s: float = 30) -> None:
        self.server = server
        self._wait_ready = wait_ready
        self._bound = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="grpc-server", daemon=True)
        self.thread.start()
        if not self._bound.wait(bind_timeout_s):
            raise TimeoutError(f"the server did not bind within {bind_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the server failed to start: {self._error}") from self._error
        self.port = server.port
        self.target = f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            await self.server.start()
            if self._wait_ready:
                await self.server.wait_ready()
        except Exception as e:  # reported to the constructor's caller
            self._error = e
            self._bound.set()
            await self.server.shutdown(grace_s=0.1)  # a bound listener must not outlive its loop
            return
        self._bound.set()
        await self._stop.wait()
        await self.server.shutdown()

    def on_loop(self, fn: Callable[[], Any], timeout_s: float = 10) -> Any:
        """Runs fn() on the server's loop (e.g. to read its state) and returns its result."""
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout_s)

    def health(self, service: str = "") -> str:
        with grpc.insecure_channel(self.target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while self.health() != "SERVING":
            if time.monotonic() > end:
                raise TimeoutError(f"{self.target} did not become SERVING within {timeout_s} s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 30) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout_s)
