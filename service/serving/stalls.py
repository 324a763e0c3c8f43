"""Bounds on what a client holds by not taking part in its own RPC: a call that waits on its client
longer than a bound is cancelled.

grpc.aio runs each RPC as two tasks. The *call task*, made when gRPC's core hands a call over, waits
for the call to end in the core; the *handler task*, made by the call task, runs the interceptors,
waits for the request message, runs the handler, and waits until the answer (message and status)
is written. Two of those waits are the client's doing, and gRPC bounds neither (only the client's
own deadline ends them, when it sent one):

  receive   from the call's arrival to its whole request message: a client that opens a stream and
            sends its message slowly or never. A stream that ends without a message is held too:
            grpc.aio then returns without a status, and the call waits in the core until its
            deadline, for ever without one (reason `no_message`).
  send      from the handler's return to the answer's last byte written: a client that grants no
            HTTP/2 flow-control window, or does not read its socket. The answer stays in the server
            until then.

`StallWatch` cancels a call whose wait passes `receive_timeout_s` / `send_timeout_s`, at a sweep a
few times a bound. The handler runs unbounded in between (admission and the deadline bound that).
A request stream (reflection, a front's relay) is not bounded in its receive: it may stay open by
design. A response stream given by an async generator is bounded in each write (the time between
two is its handler's); one written with context.write (the health Watch) in its receive only.

Cancelling: grpc.aio has no call that cancels a server RPC. gRPC's core cancels a call whose last
reference goes before the call ended (its client gets status CANCELLED, then RST_STREAM): so both
tasks are cancelled, and the call goes with its state, by reference counting or at the garbage
collection the sweep runs after cancelling. grpc.aio keeps the state of the latest call it
received until the next one arrives, and that of a first call (of its generic handlers, and of one
registered method) for its whole life: a stalled call that is one of those ends in the core later
(at the next call; for a first call, at its deadline or its connection's end). Who made the handler
task is noted by a task factory on the serving loop (`install_task_creators`). Imports no torch
(the fronts use it).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import time
import weakref
from collections import Counter
from typing import Any, Awaitable, Callable

import grpc

log = logging.getLogger("slmrank.stalls")

RECEIVE, HANDLE, SEND = "receive", "handle", "send"
REASONS = ("receive", "no_message", "send")  # what `StallWatch.cancelled` counts
SWEEPS_PER_BOUND = 4  # a stalled call is cancelled within bound x (1 + 1/SWEEPS_PER_BOUND)
MAX_SWEEP_S = 0.5
MIN_COLLECT_INTERVAL_S = 1.0  # the garbage collection after cancelling, at most this often
FREE_WAIT_S = 60.0  # ... while a cancelled call's task is still there, for at most this long


class _TaskCreators:
    """A task factory that notes, for each task made inside another, the task that made it. Weakly
    both ways: the maker usually holds what it made (a strong reference back would keep both)."""

    def __init__(self, previous: Callable[..., asyncio.Task] | None) -> None:
        self.previous = previous
        self.creators: weakref.WeakKeyDictionary[asyncio.Task, weakref.ref] = weakref.WeakKeyDictionary()

    def __call__(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
        task = self.previous(loop, coro, **kwargs) if self.previous else asyncio.Task(coro, loop=loop, **kwargs)
        creator = asyncio.current_task(loop)
        if creator is not None:
            self.creators[task] = weakref.ref(creator)
        return task


def install_task_creators(loop: asyncio.AbstractEventLoop) -> weakref.WeakKeyDictionary:
    """The loop's map task -> a weak reference to the task that made it, once its factory notes
    them (installed once a loop)."""
    factory = loop.get_task_factory()
    if not isinstance(factory, _TaskCreators):
        factory = _TaskCreators(factory)
        loop.set_task_factory(factory)
    return factory.creators


class _Call:
    __slots__ = ("handler", "call", "phase")

    def __init__(self, handler: asyncio.Task, call: asyncio.Task | None) -> None:
        self.handler, self.call, self.phase = handler, call, RECEIVE


class StallWatch:
    """The calls waiting on their clients, and the sweep that cancels those past their bound
    (module docstring). Runs on the serving loop; `start()` there first."""

    def __init__(self, receive_timeout_s: float, send_timeout_s: float,
                 on_cancel: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("receive_timeout_s", receive_timeout_s), ("send_timeout_s", send_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        self.timeouts = {RECEIVE: receive_timeout_s, SEND: send_timeout_s}
        self.clock, self.on_cancel = clock, on_cancel  # on_cancel(reason): a front counts its own
        # per phase, the calls in it by when they entered it (dicts as ordered sets: one bound per
        # phase, so the oldest entry is the first due)
        self._waiting: dict[str, dict[_Call, float]] = {RECEIVE: {}, SEND: {}}
        self.cancelled: Counter[str] = Counter({r: 0 for r in REASONS})
        self._creators: weakref.WeakKeyDictionary | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sweep_s = min(max(min(self.timeouts.values()) / SWEEPS_PER_BOUND, 0.01), MAX_SWEEP_S)
        self._last_collect = -float("inf")
        self._freeing: list[tuple[weakref.ref, float]] = []  # cancelled call tasks not yet freed, since
        self._uncollected = False  # a call was cancelled since the last garbage collection
        self._warned = False

    def start(self) -> None:
        """On the serving loop, before it takes calls."""
        self._loop = asyncio.get_running_loop()
        self._creators = install_task_creators(self._loop)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def waiting(self) -> dict[str, int]:
        """How many calls wait on their clients now, by phase."""
        return {phase: len(calls) for phase, calls in self._waiting.items()}

    # -- a call's phases (the interceptor) --

    def arrived(self) -> _Call | None:
        """A call arrived (in its handler task, before its message is read): it waits for its message."""
        if self._loop is None:
            return None
        handler = asyncio.current_task()
        if handler is None:
            return None
        creator = self._creators.get(handler)  # type: ignore[union-attr]
        entry = _Call(handler, creator() if creator is not None else None)
        (entry.call or handler).add_done_callback(lambda _: self._forget(entry))
        self._enter(entry, RECEIVE)
        return entry

    def received(self, entry: _Call) -> None:
        """Its request message arrived: the handler runs, unbounded here."""
        if entry.phase == RECEIVE:
            self._enter(entry, HANDLE)

    def answered(self, entry: _Call) -> None:
        """The handler returned (or ended the call with a status), or gave a message of its response
        stream to gRPC: that waits to be written."""
        if entry.phase != SEND:
            self._enter(entry, SEND)

    def written(self, entry: _Call) -> None:
        """A message of its response stream was written: its handler runs on."""
        if entry.phase == SEND:
            self._enter(entry, HANDLE)

    def _enter(self, entry: _Call, phase: str) -> None:
        waiting = self._waiting.get(entry.phase)
        if waiting is not None:
            waiting.pop(entry, None)
        entry.phase = phase
        if phase in self._waiting:
            self._waiting[phase][entry] = self.clock()
            if self._timer is None:
                self._timer = self._loop.call_later(self._sweep_s, self._sweep)  # type: ignore[union-attr]

    def _forget(self, entry: _Call) -> None:
        waiting = self._waiting.get(entry.phase)
        if waiting is not None:
            waiting.pop(entry, None)
        entry.phase = "done"

    # -- the sweep --

    def _sweep(self) -> None:
        self._timer = None
        now = self.clock()
        # a cancelled call ends in the core once its state is freed: by reference counting, or by a
        # garbage collection (its state can be in a reference cycle) once its tasks have unwound (a
        # sweep after the cancel), and again while its call task is still there (grpc.aio holds its
        # latest call's until the next one arrives); at most once a second
        self._freeing = [(ref, since) for ref, since in self._freeing
                         if ref() is not None and now - since < FREE_WAIT_S]
        if (self._uncollected or self._freeing) and now - self._last_collect >= MIN_COLLECT_INTERVAL_S:
            self._last_collect, self._uncollected = now, False
            gc.collect()
        for phase, waiting in self._waiting.items():
            due = now - self.timeouts[phase]
            while waiting:
                entry, since = next(iter(waiting.items()))
                if since > due:
                    break
                self._cancel(entry, phase)
        if any(self._waiting.values()) or self._freeing or self._uncollected:
            self._timer = self._loop.call_later(self._sweep_s, self._sweep)  # type: ignore[union-attr]

    def _cancel(self, entry: _Call, phase: str) -> None:
        reason = "send" if phase == SEND else "no_message" if entry.handler.done() else "receive"
        self._forget(entry)
        self.cancelled[reason] += 1
        if self.on_cancel is not None:
            self.on_cancel(reason)
        log.debug("a call waited on its client for more than %.1f s (%s): cancelled", self.timeouts[phase], reason)
        entry.handler.cancel()
        if entry.call is not None:
            entry.call.cancel()
            self._freeing.append((weakref.ref(entry.call), self.clock()))
            self._uncollected = True
        elif not self._warned:
            self._warned = True
            log.warning("the task running a stalled call's handler has no known creator: its handler is cancelled, "
                        "but the call waits in gRPC's core for its deadline (a grpc.aio change?)")


class StallInterceptor(grpc.aio.ServerInterceptor):
    """Puts every call under `watch` (module docstring); first in a server's interceptor list, so
    that its phases take in the other interceptors' work."""

    def __init__(self, watch: StallWatch) -> None:
        self.watch = watch

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        watch = self.watch
        entry = watch.arrived()
        handler = await continuation(details)
        if entry is None or handler is None:
            return handler  # (no such method: gRPC answers UNIMPLEMENTED at once)
        deserialize, serialize = handler.request_deserializer, handler.response_serializer
        if handler.request_streaming:
            watch.received(entry)  # a request stream may stay open: its messages are not bounded here
            receive = deserialize
        else:
            def receive(raw: bytes) -> Any:
                watch.received(entry)
                return deserialize(raw) if deserialize is not None else raw

        behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if handler.response_streaming and inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    async for message in behavior(request, context):
                        watch.answered(entry)  # gRPC writes it before it asks for the next
                        yield message
                        watch.written(entry)
                finally:
                    watch.answered(entry)  # the status

            wrapped = stream
        elif not handler.response_streaming and inspect.iscoroutinefunction(behavior):
            async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                finally:
                    watch.answered(entry)

            wrapped = call
        else:  # a sync handler (gRPC's thread pool), a response stream written with context.write: receive only
            wrapped = behavior
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}
        return make[handler.request_streaming, handler.response_streaming](
            wrapped, request_deserializer=receive, response_serializer=serialize)


__all__ = ["REASONS", "StallInterceptor", "StallWatch", "install_task_creators"]
