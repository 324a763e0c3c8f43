"""The batcher: admitted whole requests grouped into the artifact's shape buckets and run on the
executor, several batches in flight. `Scheduler` is the one object the gRPC server uses.

One loop on the event loop: when an in-flight slot is free, the admission policy names the next
request (its priority lane, FIFO within it); every waiting request of the same kind ("score", or
"beam.n<new_tokens>") joins it, in priority order, while some bucket still holds them all. The batch
is released at once when something of its kind was left out (the bucket is full) or the cap is
reached, otherwise when its oldest request has waited `max_wait_s`. Requests are never split.

The C++ runtime runs a batch through `runtime.submit` (its own worker thread, no GIL); any other
runtime runs one batch at a time on one worker thread. Either way `max_inflight` batches may be
handed over at once, so the next batch is packed while the current one runs. Batch execution
times (the executor's start → done, not its queue) feed the admission's ServiceTimeModel.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .admission import AdmissionConfig, AdmissionController, DropReason, Overloaded, Priority, ServiceTimeModel, Ticket
from ..artifact.artifact import Artifact
from ..runtime.batch import (BeamBatch, ScoreBatch, pack_beam, pack_score, pick_beam_bucket, pick_score_bucket, unpack_beam,
                    unpack_score)
from ..artifact.buckets import BeamBucket, ScoreBucket
from ..runtime.engine import validate
from ..runtime.requests import BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult
from ..observe.records import Completed, RequestTimings

Request = ScoreRequest | BeamRequest
Batch = ScoreBatch | BeamBatch


class DeadlineExpired(Exception):
    """The request's deadline passed while it was queued; it was never executed."""


@dataclass(frozen=True)
class BatcherConfig:
    max_wait_s: float = 0.0005  # the oldest request of a not-yet-full batch waits at most this long
    max_inflight: int = 2  # batches handed to the executor at once (running + queued there)
    max_batch_requests: int = 64  # whole requests per batch
    validate_requests: bool = True  # re-validate in submit(); a server that has validated may skip it

    def __post_init__(self) -> None:
        if not self.max_wait_s >= 0:
            raise ValueError(f"batcher.max_wait_s: must be >= 0, got {self.max_wait_s!r}")
        for name in ("max_inflight", "max_batch_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"batcher.{name}: must be an integer >= 1, got {value!r}")


def request_kind(request: Request) -> str:
    """Requests of one kind may share a batch; the kind is also the service-time class."""
    if isinstance(request, ScoreRequest):
        return "score"
    return f"beam.n{request.new_tokens}"


def buckets_by_kind(artifact: Artifact) -> dict[str, tuple[ScoreBucket, ...] | tuple[BeamBucket, ...]]:
    table = artifact.buckets
    beam: dict[str, list[BeamBucket]] = {}
    for b in table.beam:
        beam.setdefault(f"beam.n{b.new_tokens}", []).append(b)
    return {"score": table.score, **{kind: tuple(bs) for kind, bs in beam.items()}}


class _Fill:
    """Running totals of a forming batch, checked against its kind's buckets: O(buckets) per add."""

    def __init__(self, buckets: tuple[Any, ...]) -> None:
        self.buckets = buckets
        self.tokens = self.samples = self.width = 0  # width: the widest beam so far
        self.longest = 0  # Score: the most tokens of one request so far
        self.count = 0

    def add(self, req: Request) -> bool:
        """Adds the request if some bucket still holds the batch with it."""
        if isinstance(req, ScoreRequest):
            longest, samples = max(self.longest, req.num_tokens), self.samples + req.num_samples
            if not any(b.holds(self.count + 1, longest, samples) for b in self.buckets):
                return False
            self.tokens, self.longest, self.samples = self.tokens + req.num_tokens, longest, samples
        else:
            tokens, width = self.tokens + len(req.prompt_ids), max(self.width, req.beam_width)
            if not any(b.max_requests > self.count and b.beam_width >= width and b.max_prompt_tokens >= tokens
                       for b in self.buckets):
                return False
            self.tokens, self.width = tokens, width
        self.count += 1
        return True


@dataclass
class _Plan:
    tickets: list[Ticket]
    is_full: bool  # something of its kind was left out, or the cap was reached: release now

    @property
    def oldest_s(self) -> float:
        return min(t.enqueued for t in self.tickets)


# ---- executors ------------------------------------------------------------------------------------

class _SubmitExecutor:
    """The C++ runtime: runtime.submit(batch) -> future of (outputs, timings), resolved on the loop."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    async def run(self, batch: Batch) -> tuple[list[torch.Tensor], dict[str, Any]]:
        outputs, timings = await self.runtime.submit(batch)
        return list(outputs), timings

    def close(self) -> None:
        pass


class _ThreadExecutor:
    """A synchronous runtime (run_score / run_beam) on one worker thread: one batch at a time.
    Per-node host times come from the runtime's trace hook when it has one."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slmrank-batch")
        self._has_trace = "trace" in inspect.signature(runtime.run_score).parameters

    async def run(self, batch: Batch) -> tuple[list[torch.Tensor], dict[str, Any]]:
        submit_ns = time.monotonic_ns()
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._run, batch, submit_ns)

    def _run(self, batch: Batch, submit_ns: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
        start_ns = time.monotonic_ns()
        nodes: list[tuple[str, float, float]] = []
        last_ns = [start_ns]

        def trace(node: Any, env: Any) -> None:
            now_ns = time.monotonic_ns()
            nodes.append((node.name, (now_ns - last_ns[0]) / 1e6, -1.0))
            last_ns[0] = now_ns

        kw = {"trace": trace} if self._has_trace else {}
        if isinstance(batch, ScoreBatch):
            outputs = [self.runtime.run_score(batch, **kw)]
        else:
            outputs = list(self.runtime.run_beam(batch, **kw))
        done_ns = time.monotonic_ns()
        return outputs, {"submit_ns": submit_ns, "start_ns": start_ns, "h2d_end_ns": start_ns, "launch_ns": start_ns,
                         "d2h_end_ns": done_ns, "done_ns": done_ns, "graph": False, "nodes": nodes}

    def close(self) -> None:
        self._pool.shutdown(wait=False)


# ---- the scheduler --------------------------------------------------------------------------------

class Scheduler:
    """Admission + batching + execution of whole requests. All methods run on one event loop."""

    def __init__(self, artifact: Artifact, runtime: Any, admission: AdmissionConfig | None = None,
                 batcher: BatcherConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.artifact, self.runtime, self.clock = artifact, runtime, clock
        self.config = batcher or BatcherConfig()
        admission = admission or AdmissionConfig()
        self.model = ServiceTimeModel(admission, clock)
        self.admission = AdmissionController(admission, self.model, clock, on_drop=self._on_drop)
        self._executor = _SubmitExecutor(runtime) if hasattr(runtime, "submit") else _ThreadExecutor(runtime)
        self._label_columns = 1 if artifact.config.has_cls_head else artifact.limits.max_labels
        self._buckets = buckets_by_kind(artifact)
        self._wake = asyncio.Event()  # something changed: an arrival, a drop, a batch done
        self._progress = asyncio.Event()  # a batch finished or a ticket left the queue (for drain)
        self._loop_task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()
        self._inflight = 0
        self._num_batches = 0
        self._num_failed_batches = 0
        self._num_executed = 0
        self._batch_sizes: Counter[int] = Counter()
        self._occupancy: dict[str, list[float]] = {}  # bucket key -> [batches, sum of occupancy]

    async def start(self) -> None:
        """Starts the batching loop on the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="slmrank-batcher")

    async def submit(self, request: Request, priority: Priority = Priority.NORMAL,
                     deadline: float | None = None) -> Completed:
        """Runs one whole request. deadline: absolute, in the clock's seconds.

        Raises RequestError (invalid), Overloaded (refused now: queue_full / deadline / draining),
        DeadlineExpired (the deadline passed while queued), ExecutionError (its batch failed).
        Cancelling the awaiting task removes the request if it is still queued; once batched it
        runs and its result is discarded. The deadline bounds the queueing, not a batch's run."""
        if self._loop_task is None or self._loop_task.done():
            raise RuntimeError("the batching loop is not running (start() not called, or closed)")
        if not isinstance(request, (ScoreRequest, BeamRequest)):
            raise RequestError("request", f"must be a ScoreRequest or a BeamRequest, got {type(request).__name__}")
        if self.config.validate_requests:
            validate(self.artifact, request)
        try:
            priority = Priority(priority)
        except ValueError:
            raise RequestError("priority", f"must be one of {[int(p) for p in Priority]}, got {priority!r}") from None
        loop = asyncio.get_running_loop()
        ticket = Ticket(request, request_kind(request), priority, deadline, future=loop.create_future())
        self.admission.admit(ticket)
        timer = None
        if deadline is not None:
            timer = loop.call_later(max(deadline - self.clock(), 0.0), self._expire, ticket)
        self._wake.set()
        try:
            return await ticket.future
        except asyncio.CancelledError:
            self.admission.remove(ticket, "cancelled")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuses new work ("draining") and finishes every queued and in-flight request.

        Returns True when all is done; False after timeout_s, when the requests still queued are
        answered Overloaded("draining") (in-flight batches still complete)."""
        self.admission.start_draining()
        self._wake.set()
        if not self.admission.depth() and not self._inflight:
            return True  # idle already (wait_for with a zero timeout would not even look)
        try:
            await asyncio.wait_for(self._until_idle(), timeout_s)
            return True
        except TimeoutError:
            for ticket in list(self.admission.waiting()):
                self.admission.remove(ticket, "drained")
            return False

    async def close(self) -> None:
        """Stops the batching loop and the worker thread; anything still queued is answered
        Overloaded("draining"). Call drain() first to finish the work."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*self._batch_tasks, return_exceptions=True)
        self._executor.close()

    def stats(self) -> dict[str, Any]:
        buckets = {key: {"batches": int(n), "occupancy_mean": total / n} for key, (n, total) in self._occupancy.items()}
        num = sum(n for n, _ in self._occupancy.values())
        return {
            **self.admission.stats(),
            "batches": self._num_batches,
            "batches_failed": self._num_failed_batches,
            "requests_executed": self._num_executed,
            "batch_sizes": dict(sorted(self._batch_sizes.items())),
            "buckets": buckets,
            "occupancy_mean": sum(total for _, total in self._occupancy.values()) / num if num else 0.0,
            "inflight": self._inflight,
        }

    # -- the batching loop --

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if self._inflight >= self.config.max_inflight:
                    await self._wake.wait()
                    continue
                now = self.clock()
                plan = self._plan(now)
                if plan is None:
                    await self._wake.wait()
                    continue
                release_s = plan.oldest_s + self.config.max_wait_s
                if plan.is_full or now >= release_s or self.admission.is_draining:
                    self._launch(plan, now)
                    continue
                await self._sleep(release_s - now)
        finally:  # stopped (close) or broken: nobody would ever take what is queued
            for ticket in list(self.admission.waiting()):
                self.admission.remove(ticket, "drained")

    async def _sleep(self, delay_s: float) -> None:
        handle = asyncio.get_running_loop().call_later(delay_s, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            handle.cancel()

    def _plan(self, now: float) -> _Plan | None:
        head = self.admission.head(now)
        if head is None:
            return None
        fill = _Fill(self._buckets.get(head.kind, ()))
        if not fill.add(head.payload):  # fits no bucket alone (not validated): it fails in _execute, alone
            return _Plan([head], True)
        tickets, is_full = [head], False
        for t in self.admission.waiting():
            if t is head or t.kind != head.kind:
                continue
            if len(tickets) >= self.config.max_batch_requests:
                is_full = True
                break
            if fill.add(t.payload):
                tickets.append(t)
            else:
                is_full = True  # first fit: a smaller one further back may still join
        return _Plan(tickets, is_full)

    def _launch(self, plan: _Plan, now: float) -> None:
        self.admission.take(plan.tickets)
        self._inflight += 1
        self.model.batch_started()
        self._num_batches += 1
        task = asyncio.get_running_loop().create_task(self._execute(plan.tickets, now, self._num_batches))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _execute(self, tickets: list[Ticket], dequeued_s: float, batch_id: int) -> None:
        reqs = [t.payload for t in tickets]
        kind = tickets[0].kind
        lanes = dict(Counter(t.priority for t in tickets))
        run: tuple[float, float] | None = None
        try:
            batch = self._pack(reqs)
            self._record_batch(batch)
            start_s = self.clock()
            outputs, timings = await self._executor.run(batch)
            end_s = self.clock()
            results = self._unpack(batch, outputs)
            # the executor's own run (not its queue), placed on our clock where the results arrived
            run = (end_s - (timings["done_ns"] - timings["start_ns"]) / 1e9, end_s)
        except Exception as e:  # only this batch's requests see the failure
            self._num_failed_batches += 1
            error = ExecutionError(f"batch of {len(reqs)} request(s) failed: {e}")
            for t in tickets:
                _settle(t.future, error=error)
        else:
            for i, (t, result) in enumerate(zip(tickets, results)):
                _settle(t.future, Completed(result, RequestTimings(
                    t.priority, t.enqueued, dequeued_s, start_s, end_s, batch_id, len(tickets), i,
                    batch.bucket.key, timings)))
        finally:
            self.model.batch_finished(kind, run, lanes)
            self._inflight -= 1
            self._wake.set()
            self._progress.set()

    def _pack(self, reqs: list[Any]) -> Batch:
        if isinstance(reqs[0], ScoreRequest):
            bucket = pick_score_bucket(self.artifact.buckets, reqs)
            if bucket is None:
                raise ExecutionError(f"{len(reqs)} score request(s) fit no bucket")
            return pack_score(reqs, bucket, self._label_columns)
        beam_bucket = pick_beam_bucket(self.artifact.buckets, reqs)
        if beam_bucket is None:
            raise ExecutionError(f"{len(reqs)} beam request(s) fit no bucket")
        return pack_beam(reqs, beam_bucket)

    @staticmethod
    def _unpack(batch: Batch, outputs: list[torch.Tensor]) -> Sequence[ScoreResult | BeamResult]:
        if isinstance(batch, ScoreBatch):
            return unpack_score(batch, outputs[0])
        return unpack_beam(batch, outputs[0], outputs[1])

    def _record_batch(self, batch: Batch) -> None:
        self._num_executed += len(batch.requests)
        self._batch_sizes[len(batch.requests)] += 1
        stats = self._occupancy.setdefault(batch.bucket.key, [0, 0.0])
        stats[0] += 1
        stats[1] += _occupancy(batch)

    # -- queue events --

    def _expire(self, ticket: Ticket) -> None:
        self.admission.remove(ticket, "expired")  # a no-op once batched

    def _on_drop(self, ticket: Ticket, reason: DropReason) -> None:
        if reason == "expired":
            _settle(ticket.future, error=DeadlineExpired(f"deadline passed after {self.clock() - ticket.enqueued:.4f} s "
                                                         "in the queue; the request was not executed"))
        elif reason == "drained":
            _settle(ticket.future, error=Overloaded("draining", 0.0, "the server stopped before running it"))
        else:
            _settle(ticket.future, error=asyncio.CancelledError())
        self._wake.set()
        self._progress.set()

    async def _until_idle(self) -> None:
        while self.admission.depth() or self._inflight:
            self._progress.clear()
            await self._progress.wait()


def _occupancy(batch: Batch) -> float:
    """Useful share of the bucket: real tokens / bucket tokens (Score), real beams / beam rows (BeamSearch)."""
    if isinstance(batch.bucket, ScoreBucket):
        return sum(r.num_tokens for r in batch.requests) / batch.bucket.max_tokens
    bucket: BeamBucket = batch.bucket
    return sum(r.beam_width for r in batch.requests) / (bucket.max_requests * bucket.beam_width)


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
