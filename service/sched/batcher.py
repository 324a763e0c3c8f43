"""The batcher: admitted whole requests grouped into the artifact's shape buckets and run on the
executor, several batches in flight. `Scheduler` is the one object the gRPC server uses.

One loop on the event loop: when an in-flight slot is free, the admission policy names the next
request (its priority lane; fair-queuing order between clients within it); every waiting request of
the same kind ("score", "beam" of any new_tokens, or a catalog's codes kind) joins it, in priority order, while some bucket still
holds them all and, when that takes a larger bucket, the time per request is no worse and every
member is still answered within its deadline. The batch is released at once when something of its
kind was left out (the bucket is full) or the cap is reached, otherwise when its oldest request
has waited `max_wait_s` (under load, up to `load_wait_share` of its first request's time alone, at
most `load_wait_max_s`, counted from when the batch could first have gone: see
Scheduler._release_s). Requests are never split. No batch grows into a bucket that may run longer
than `max_batch_s` on this machine (ServiceTimeModel.bound_s; the server's: half its SIGTERM grace),
or whose activations (buckets.activation_bytes) exceed `max_batch_bytes` (the server's, on a CPU: a
share of the memory the host has left, service/sched/memory.py),
and while draining none starts that is expected to end after the drain's timeout: its requests are
answered "draining" at once.

A heavy batch may hold at most max_inflight - 1 of the in-flight slots: the last one goes to
lighter work, so a small request is not stuck behind maximal ones (on a GPU, each slot is a lane:
its own stream and graphs); its packing and unpacking (thousands of beam rows) run off the event
loop, where light requests wait. Heavy: predicted to take longer than `heavy_batch_s` and, while
heavy batches run, than 1/HEAVY_GAP of the lightest of them (work far lighter than what holds the
other slots is what the last one is kept for, whatever its own time: on a slow CPU host a small
Score measured over heavy_batch_s and waited behind maximal BeamSearches for 0.1-1 s), or, with
`heavy_ratio` > 0 (off by default: not yet measured on the mixed workloads), holding a request that
alone takes more than heavy_ratio x the lightest request of another kind seen in the last
`light_window_s` (batches of different kinds never share a bucket, so a light Score would wait
behind two batches of far longer BeamSearches, each at most heavy_batch_s). Requests of one kind,
or of kinds alike in cost, never count heavy by the ratio: their batches use every slot.

The C++ runtime runs a batch through `runtime.submit` (its lanes, no GIL); any other runtime runs
on `max_inflight` worker threads. Batch times (packing + the executor's start → done, not its
queue + unpacking) feed the admission's ServiceTimeModel, per bucket.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from .admission import (GROWTH_TOLERANCE, AdmissionConfig, AdmissionController, DeadlineExpired, DropReason,
                        Overloaded, Priority, Ticket)
from .cost import CostTable, RequestCost, request_kind
from ..artifact.artifact import Artifact
from ..runtime.batch import BeamBatch, ScoreBatch, dims, pack_beam, pack_score, pick_bucket, unpack_beam, unpack_score
from ..artifact.buckets import Fill, activation_bytes
from ..artifact.catalog import Catalog, forest_size, trie_forest
from ..runtime.engine import validate
from ..runtime.requests import BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult
from ..runtime.timings import BatchTimings, NodeTimer
from ..observe.records import Completed, RequestTimings


class CatalogReplaceError(ValueError):
    """A catalog replacement refused before anything changed. reason: "name", "file" (the new
    catalog does not fit the old one's place), "room", "busy" or "runtime"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# forming a batch, the requests of its kind that did not join it (no bucket holds them beside it, or
# the larger bucket would be slower per request or late) looked at before it is closed: one further
# back may still join, but the search is bounded (the queue is not)
MAX_MISSES = 32

# while heavy batches run, a batch or request counts heavy only above 1/HEAVY_GAP of the lightest of
# them, whatever heavy_batch_s says: the last slot is kept for work far lighter than what holds the
# others (a small Score that a slow CPU host measured at 25 ms, beside 0.7 s of maximal BeamSearches,
# is that work; a second maximal BeamSearch is not)
HEAVY_GAP = 4.0

Request = ScoreRequest | BeamRequest
Batch = ScoreBatch | BeamBatch


@dataclass(frozen=True)
class BatcherConfig:
    max_wait_s: float = 0.0005  # the oldest request of a not-yet-full batch waits at most this long
    max_inflight: int = 2  # batches handed to the executor at once (running + queued there)
    max_batch_requests: int = 64  # whole requests per batch
    validate_requests: bool = True  # re-validate in submit(); a server that has validated may skip it
    # a batch predicted to take longer holds at most max_inflight - 1 of the in-flight slots (one
    # stays for lighter work; a synchronous runtime gets one worker thread per slot)
    heavy_batch_s: float = 0.05
    # a request whose time alone is more than this many times the lightest request of another kind
    # seen in the last light_window_s makes its batch heavy too (0: only heavy_batch_s does). Off:
    # at 4, W1's light callers beside W5's gained on an H100 (p50 -15%) but not on the H200, and its
    # cost to the mixes' capacity (beams kept off the last lane beside Scores) is not measured yet
    heavy_ratio: float = 0.0
    light_window_s: float = 1.0
    load_wait_share: float = 0.15  # when requests of a kind arrive at least one per time one takes alone, a batch not yet full waits up to this share of that time for more to join (0: never)
    load_wait_max_s: float = 0.004  # the most a batch waits for that reason (seconds)
    # such a wait ends once the batch holds the requests of its kind expected in the server now
    # (Little's law: arrival rate x (time in the server + this, a caller's time outside it between
    # an answer and its next request: gRPC both ways, ~2 ms measured on the H200)), less those in flight
    load_wait_outside_s: float = 0.002

    def __post_init__(self) -> None:
        for name in ("max_wait_s", "heavy_batch_s", "heavy_ratio", "light_window_s", "load_wait_share", "load_wait_max_s",
                     "load_wait_outside_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"batcher.{name}: must be >= 0, got {getattr(self, name)!r}")
        for name in ("max_inflight", "max_batch_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"batcher.{name}: must be an integer >= 1, got {value!r}")


class _Fill(Fill):
    """buckets.Fill (the one answer to "which bucket holds these requests") over whole requests, and
    the most requests a bucket of the kind holds."""

    __slots__ = ("most",)

    def __init__(self, buckets: tuple[Any, ...]) -> None:
        super().__init__(buckets)
        self.most = self.reach[0][0] if buckets else 0  # no bucket holds more requests (reach: requests first)

    def fit_request(self, req: Request) -> Any:
        """The bucket the batch would run in with req added; None if no bucket holds it."""
        return self.fit(*dims(req))

    def add_request(self, req: Request) -> None:
        self.add(*dims(req))


class ArrivalRates:
    """Requests a second per kind, exponentially weighted (time constant tau_s): each arrival adds
    1 / tau_s, the sum decays as exp(-dt / tau_s); a steady rate r reads r."""

    def __init__(self, tau_s: float = 0.5) -> None:
        self.tau_s = tau_s
        self._state: dict[str, tuple[float, float]] = {}  # kind -> (rate, at)

    def add(self, kind: str, now: float) -> None:
        self._state[kind] = (self.rate(kind, now) + 1.0 / self.tau_s, now)

    def rate(self, kind: str, now: float) -> float:
        rate, at = self._state.get(kind, (0.0, now))
        return rate * math.exp(-max(now - at, 0.0) / self.tau_s)


class RecentSolos:
    """Per kind, its lightest request lately: the solo bucket (the bucket a request runs in alone)
    of the fewest FLOPs among its requests seen in the last window_s. O(1) per request: once that
    bucket has not been seen for window_s, the kind's next request's bucket takes its place (so a
    kind's lightest may be over-stated until a lighter request comes again, never under-stated)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._min: dict[str, tuple[Any, float]] = {}  # kind -> (its lightest solo bucket's info, last seen)

    def add(self, kind: str, info: Any, now: float) -> None:
        cur = self._min.get(kind)
        if cur is None or info.flops <= cur[0].flops or now - cur[1] > self.window_s:
            self._min[kind] = (info, now)

    def __len__(self) -> int:  # kinds seen (some perhaps no longer within the window)
        return len(self._min)

    def lightest(self, bucket_s: Callable[[Any], float], now: float) -> dict[str, float]:
        """kind -> bucket_s of its lightest request seen within the window (older kinds forgotten)."""
        for kind in [k for k, (_, at) in self._min.items() if now - at > self.window_s]:
            del self._min[kind]
        return {kind: bucket_s(info) for kind, (info, _) in self._min.items()}


class Residence:
    """Seconds a request of a kind spends in the server (submit to answer), exponentially weighted
    over answered requests (weight alpha each); None before the first answer."""

    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self._mean: dict[str, float] = {}

    def add(self, kind: str, seconds: float) -> None:
        mean = self._mean.get(kind)
        self._mean[kind] = seconds if mean is None else mean + self.alpha * (seconds - mean)

    def mean(self, kind: str) -> float | None:
        return self._mean.get(kind)


@dataclass
class _Plan:
    tickets: list[Ticket]
    is_full: bool  # something of its kind was left out, or the cap was reached: release now
    bucket: Any = None  # the bucket it runs in (None: it fits none, and fails alone)

    @property
    def oldest_s(self) -> float:
        return min(t.enqueued for t in self.tickets)


class _Flight:
    """A batch handed to the executor: its control (to stop it), when it went, its bucket, and
    which of its members are gone (cancelled or expired)."""

    __slots__ = ("tickets", "control", "started_s", "bucket", "gone")

    def __init__(self, tickets: list[Ticket], control: Any, started_s: float, bucket: Any) -> None:
        self.tickets, self.control, self.started_s, self.bucket = tickets, control, started_s, bucket
        self.gone: set[int] = set()


# ---- executors ------------------------------------------------------------------------------------

class BatchCancelled(RuntimeError):
    """A batch stopped between two nodes (or before it started): every request in it was cancelled
    or had expired."""


class _Control:
    """What the Scheduler tells one running batch (a runtime without a control of its own):
    cancel() stops it at its next node boundary; heavy: it pauses there for light batches."""

    __slots__ = ("heavy", "cancelled")

    def __init__(self, heavy: bool = False) -> None:
        self.heavy = heavy
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _SubmitExecutor:
    """The C++ runtime on a GPU: runtime.submit(batch, control) -> future of (outputs, BatchTimings),
    resolved on the loop. Its lanes (num_lanes) run that many batches at once; a cancelled control
    stops a batch before it starts (a graph per bucket runs whole), before its next decode step (a
    family's graph with conditional steps: `--beam-graphs conditional`), or between nodes where it
    runs eagerly."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.num_lanes = max(int(getattr(runtime, "num_lanes", 1)), 1)

    def make_control(self, is_heavy: bool) -> Any:
        return self.runtime.control(is_heavy) if hasattr(self.runtime, "control") else _Control(is_heavy)

    def cancel(self, control: Any) -> None:
        control.cancel()

    async def run(self, batch: Batch, is_heavy: bool = False,
                  control: Any = None) -> tuple[list[torch.Tensor], BatchTimings]:
        if control is not None and control.cancelled:
            raise BatchCancelled("cancelled before it was handed over")
        kw = {} if control is None or isinstance(control, _Control) else {"control": control}
        outputs, timings = await self.runtime.submit(batch, **kw)
        return list(outputs), timings

    def close(self) -> None:
        pass


class _LightFirst:
    """Between two DAG nodes, a heavy batch waits while a light batch runs: on a CPU two batches at
    once share the cores, so a light batch beside a heavy one would run at half speed; this way
    it overlaps at most the one heavy node already running. (A CUDA graph cannot pause: on a GPU
    the lanes are the only way past a heavy batch.)"""

    def __init__(self) -> None:
        self._light = 0
        self._cond = threading.Condition()

    def enter_light(self) -> None:
        with self._cond:
            self._light += 1

    def exit_light(self) -> None:
        with self._cond:
            self._light -= 1
            self._cond.notify_all()

    def pause_heavy(self, control: Any = None) -> int:
        """Blocks while a light batch runs (and the control is not cancelled); returns the
        nanoseconds it paused."""
        with self._cond:
            if not self._light:
                return 0
            t0 = time.monotonic_ns()
            self._cond.wait_for(lambda: self._light == 0 or (control is not None and control.cancelled))
            return time.monotonic_ns() - t0

    def wake(self) -> None:
        """A paused batch looks at its control again (it was cancelled)."""
        with self._cond:
            self._cond.notify_all()


HEAVY_NICE = 19  # the CPU priority of the threads that run heavy batches on a CPU (Linux nice, per thread)


def lower_thread_priority(nice: int = HEAVY_NICE) -> bool:
    """Lowers the calling thread's CPU priority (Linux: nice is per thread; threads it creates
    later, such as its OpenMP team, inherit it). False where the OS cannot (then nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (AttributeError, OSError):
        return False


class _ThreadExecutor:
    """A synchronous runtime on worker threads, like the C++ runtime's lanes on a GPU: a light batch
    need not wait behind a heavy one. It serves the Python runtime (run_score / run_beam with a
    trace hook called between nodes) and the C++ runtime on a CPU (run_batch with a RunControl of
    its own: the same pause and cancellation, between nodes inside the executor, without the GIL).
    On a CPU the two batches share the cores, so

    - a heavy batch pauses between its nodes while a light one runs (_LightFirst), and
    - heavy batches run on threads of their own at the lowest CPU priority (nice HEAVY_NICE, which
      their OpenMP threads inherit): the node a heavy batch is in when a light one arrives, and
      its threads' spin-waits, take CPU from the light batch, the event loop and gRPC's threads
      only when those leave it idle. On this repository's 2-core CI machine a light client's p99
      beside maximal requests was 2.1-2.4x its p99 alone at nice 0, 1.5-2.0x at 5 and 10, and
      1.5x at 19 (tests/service/test_overload.py, runs interleaved).

    Per-node host times come from the runtime's trace hook when it has one (the hook is also where
    a heavy batch pauses): a BatchTimings timed on the host, its pauses in paused_ns. A cancelled
    control (every request of the batch cancelled or expired) stops the batch at its next node
    boundary: BatchCancelled (the C++ executor's RunCancelled)."""

    def __init__(self, runtime: Any, num_lanes: int = 1) -> None:
        self.runtime = runtime
        self.num_lanes = num_lanes
        self._pool = ThreadPoolExecutor(max_workers=num_lanes, thread_name_prefix="slmrank-batch")
        on_cpu = getattr(getattr(runtime, "device", None), "type", "cpu") == "cpu"
        # heavy batches hold at most num_lanes - 1 slots (the Scheduler's rule), at least one
        self._heavy_pool = ThreadPoolExecutor(max_workers=max(num_lanes - 1, 1), thread_name_prefix="slmrank-heavy",
                                              initializer=lower_thread_priority if on_cpu else None)
        self._native = hasattr(runtime, "run_batch") and hasattr(runtime, "control")  # the C++ runtime
        self._has_trace = not self._native and "trace" in inspect.signature(runtime.run_score).parameters
        self._gate = _LightFirst()

    def make_control(self, is_heavy: bool) -> Any:
        return self.runtime.control(is_heavy) if self._native else _Control(is_heavy)

    def cancel(self, control: Any) -> None:
        control.cancel()
        self._gate.wake()

    async def run(self, batch: Batch, is_heavy: bool = False,
                  control: Any = None) -> tuple[list[torch.Tensor], BatchTimings]:
        submit_ns = time.monotonic_ns()
        pool = self._heavy_pool if is_heavy else self._pool
        control = control if control is not None else self.make_control(is_heavy)
        return await asyncio.get_running_loop().run_in_executor(pool, self._run, batch, submit_ns, is_heavy, control)

    def _run(self, batch: Batch, submit_ns: int, is_heavy: bool,
             control: Any) -> tuple[list[torch.Tensor], BatchTimings]:
        if control.cancelled:
            raise BatchCancelled("cancelled before it started")
        if self._native:  # the executor pauses and stops the batch between its nodes itself
            outputs, timings = self.runtime.run_batch(batch, control)
            return outputs, replace(timings, submit_ns=submit_ns)
        timer = NodeTimer(submit_ns)

        def trace(node: Any, env: Any) -> None:
            timer.lap(node.name)
            if is_heavy:
                timer.skip(self._gate.pause_heavy(control))
            if control.cancelled:
                raise BatchCancelled(f"cancelled after node {node.name}")

        kw = {"trace": trace} if self._has_trace else {}
        if not is_heavy:
            self._gate.enter_light()
        try:
            if isinstance(batch, ScoreBatch):
                outputs = [self.runtime.run_score(batch, **kw)]
            else:
                outputs = list(self.runtime.run_beam(batch, **kw))
        finally:
            if not is_heavy:
                self._gate.exit_light()
        return outputs, timer.timings()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._heavy_pool.shutdown(wait=False)


# ---- the scheduler --------------------------------------------------------------------------------

class Scheduler:
    """Admission + batching + execution of whole requests. All methods run on one event loop."""

    def __init__(self, artifact: Artifact, runtime: Any, admission: AdmissionConfig | None = None,
                 batcher: BatcherConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 max_batch_s: float = math.inf, max_batch_bytes: float = math.inf) -> None:
        """max_batch_s: no batch grows into a bucket whose time on this machine may be longer
        (ServiceTimeModel.bound_s; the server's: a share of its SIGTERM grace). max_batch_bytes: nor
        into one whose activations in the runtime's dtype may take more (a request alone still runs
        in its own smallest bucket)."""
        self.artifact, self.runtime, self.clock = artifact, runtime, clock
        self.max_batch_s = max_batch_s
        self.max_batch_bytes = max_batch_bytes
        self._act_elem = getattr(getattr(runtime, "dtype", None), "itemsize", 4)
        # the ATen path's dense attention (what a CPU runs) holds scores for every pair of rows
        self._dense = getattr(runtime, "kernels", "aten") == "aten"
        self._drain_end_s = math.inf  # drain(timeout_s): no batch starts that may end after it
        self.config = batcher or BatcherConfig()
        admission = admission or AdmissionConfig()
        # the C++ runtime's lanes on a GPU; on a CPU (its lanes would share the cores without pausing
        # for each other), worker threads as for any synchronous runtime
        on_cpu = getattr(getattr(runtime, "device", None), "type", "cpu") == "cpu"
        self._executor: _SubmitExecutor | _ThreadExecutor = (
            _SubmitExecutor(runtime) if hasattr(runtime, "submit") and not (on_cpu and hasattr(runtime, "run_batch"))
            else _ThreadExecutor(runtime, self.config.max_inflight))
        self.model = admission.service_model(self._executor.num_lanes)
        self.admission = AdmissionController(admission, self.model, clock, on_drop=self._on_drop)
        self.costs = CostTable(artifact, self.config.max_batch_requests)
        # (request, own_s, share_s, idle_s)
        self.on_precheck: Callable[[Request, float, float, float | None], None] | None = None
        self._label_columns = artifact.label_columns
        self._wake = asyncio.Event()  # something changed: an arrival, a drop, a batch done
        self._progress = asyncio.Event()  # a batch finished or a ticket left the queue (for drain)
        self._loop_task: asyncio.Task | None = None
        self._batch_tasks: set[asyncio.Task] = set()
        self._inflight = 0
        self._heavy_s: list[float] = []  # the predicted time of each heavy batch in flight, at its start
        # when the executor last had a free slot again after all were taken: a batch's load wait
        # counts from when it could first have gone, not from its members' arrival (behind a busy
        # executor it would otherwise be spent before the batch could go, and the callers of the
        # batch just answered, about to come back, could never join the next one)
        self._slot_freed_s = -math.inf
        self._num_batches = 0
        self._num_failed_batches = 0
        self._heavy_batches: Counter[str] = Counter()  # why ("time", "ratio") -> heavy batches started
        self._num_executed = 0
        self._num_answered_late = 0  # admitted, run, and answered after the deadline
        self._batch_sizes: Counter[int] = Counter()
        self._occupancy: dict[str, list[float]] = {}  # bucket key -> [batches, sum of occupancy]
        self._arrivals = ArrivalRates()
        self._residence = Residence()
        self._recent = RecentSolos(self.config.light_window_s)
        self._inflight_by_kind: Counter[str] = Counter()  # requests in batches handed to the executor
        self._flights: dict[int, _Flight] = {}  # id(ticket) -> its batch, while handed to the executor
        self._dropped_in_flight: Counter[str] = Counter()  # "expired", "cancelled": members of running batches
        self._num_cancelled_batches = 0  # stopped between nodes: none of their requests was left
        # the catalogs constrained beams run with now (replace_catalog swaps one): a batch packs and
        # unpacks with those of its start; while a replacement writes the forest, no batch with a
        # constrained request starts, and it writes only once none is in flight
        self.catalogs: tuple[Catalog, ...] = artifact.catalogs
        self._constrained_inflight = 0
        self._catalogs_paused = False
        self._replacing: str | None = None  # the catalog being replaced: one replacement at a time
        self.catalog_replacements = 0

    async def start(self) -> None:
        """Starts the batching loop on the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="slmrank-batcher")

    async def submit(self, request: Request, priority: Priority = Priority.NORMAL,
                     deadline: float | None = None, client: str = "") -> Completed:
        """Runs one whole request. deadline: absolute, in the clock's seconds; client: whose
        request it is, for fair shares and the per-client cap.

        Raises RequestError (invalid), Overloaded (refused now: queue_full / client_limit /
        deadline / draining), DeadlineUnmeetable (no request could meet the deadline),
        DeadlineExpired (the deadline passed while queued), ExecutionError (its batch failed).
        Cancelling the awaiting task removes the request if it is still queued; once batched, its
        batch stops at the next node boundary when no member is left (cancelled or expired), else its
        result is discarded. A batched request that can no longer finish by its deadline, or is
        still running at it, gets DeadlineExpired then: it is never answered late."""
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
        ticket = Ticket(request, request_kind(request), priority, deadline, future=loop.create_future(),
                        client=client, cost=self._cost(request))
        self._arrivals.add(ticket.kind, self.clock())
        if ticket.cost is not None:
            self._recent.add(ticket.kind, ticket.cost.solo, self.clock())
        self.admission.admit(ticket)
        timer = None
        if deadline is not None:
            # dropped unexecuted once it could no longer finish in time even if it ran now, alone,
            # as fast as its bucket ever ran lately: run later, it would only be answered late, on
            # GPU time that others could use
            timer = loop.call_later(max(deadline - self._fastest_s(ticket) - self.clock(), 0.0), self._expire, ticket)
        self._wake.set()
        try:
            done = await ticket.future
            self.model.observe_lag(self.clock() - ticket.answered_s)
            return done
        except asyncio.CancelledError:
            if not self.admission.remove(ticket, "cancelled"):
                self._leave(ticket, "cancelled")
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def precheck(self, request: Request, priority: Priority = Priority.NORMAL, deadline: float | None = None,
                 client: str = "") -> None:
        """Raises what submit() would raise now for a request of this shape (Overloaded,
        DeadlineUnmeetable) without queueing anything; the request need not be validated (a shape
        no bucket holds is not checked). A request no larger than the real one (fewer tokens) gives
        a refusal the real one would get too."""
        cost = self._cost(request)
        if cost is None:
            return
        ticket = Ticket(request, request_kind(request), Priority(priority), deadline, client=client, cost=cost)
        try:
            self.admission.admit(ticket, dry_run=True)
        finally:
            if self.on_precheck is not None:  # the fronts learn this shape's price, refused or not
                self.on_precheck(request, ticket.own_s, ticket.work_s, ticket.idle_s)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuses new work ("draining") and finishes every queued and in-flight request.

        Returns True when all is done; False after timeout_s, when the requests still queued are
        answered Overloaded("draining") (in-flight batches still complete). No batch starts that may
        not end within timeout_s: its requests are answered Overloaded("draining") at once."""
        self.admission.start_draining()
        self._drain_end_s = math.inf if timeout_s is None else self.clock() + timeout_s
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
        admitted = self.admission.stats()
        return {
            **admitted,
            # dropped once admitted: in the queue (admission's count) or in a running batch
            "expired": admitted["expired"] + self._dropped_in_flight["expired"],
            "cancelled": admitted["cancelled"] + self._dropped_in_flight["cancelled"],
            "expired_in_flight": self._dropped_in_flight["expired"],
            "cancelled_in_flight": self._dropped_in_flight["cancelled"],
            "batches_cancelled": self._num_cancelled_batches,
            "batches": self._num_batches,
            "batches_failed": self._num_failed_batches,
            "heavy_batches": dict(self._heavy_batches),
            "requests_executed": self._num_executed,
            "answered_late": self._num_answered_late,
            "batch_sizes": dict(sorted(self._batch_sizes.items())),
            "buckets": buckets,
            "occupancy_mean": sum(total for _, total in self._occupancy.values()) / num if num else 0.0,
            "inflight": self._inflight,
        }

    # -- catalogs --

    async def replace_catalog(self, catalog: Catalog) -> Catalog:
        """Swaps the artifact's catalog of the same name for this one (read_catalog) while serving;
        returns the one it replaced. Batches that started before the swap finish with the old one,
        every batch after it runs with the new one: no request sees a mix. The forest on the device
        is overwritten in place (no second copy of it, and CUDA graphs keep its addresses): the
        new forest is built first, off the event loop; then batches with constrained requests stop
        starting (others go on), those in flight finish, the forest is written (a copy to the
        device), and they start again. One replacement at a time.

        CatalogReplaceError: no catalog of that name, another code length (queued requests were
        validated against the old one), no room in the forest (the runtime's catalog_headroom), a
        replacement already in progress, or a runtime that cannot replace catalogs."""
        index = next((i for i, c in enumerate(self.catalogs) if c.name == catalog.name), None)
        if index is None:
            raise CatalogReplaceError("name", f"no catalog {catalog.name!r} here (the artifact has "
                                      f"{', '.join(repr(c.name) for c in self.catalogs) or 'none'})")
        old = self.catalogs[index]
        if catalog.code_length != old.code_length:
            raise CatalogReplaceError("file", f"its items have {catalog.code_length} tokens, catalog {old.name!r} "
                                      f"{old.code_length}: a replacement keeps the code length (requests name it "
                                      "in new_tokens)")
        write = getattr(self.runtime, "write_catalog_forest", None)
        capacity = getattr(self.runtime, "catalog_capacity", None)
        if write is None or capacity is None:
            raise CatalogReplaceError("runtime", f"the {getattr(self.runtime, 'name', 'runtime')} runtime cannot "
                                      "replace catalogs")
        if self._replacing is not None:
            raise CatalogReplaceError("busy", f"catalog {self._replacing!r} is being replaced; one at a time")
        catalogs = self.catalogs[:index] + (catalog,) + self.catalogs[index + 1:]
        if not capacity.holds(size := forest_size(catalogs)):
            raise CatalogReplaceError("room", f"catalog {catalog.name!r} of {catalog.num_items:,} items makes the "
                                      f"catalogs need {size}; the server holds room for {capacity} (serve "
                                      "--catalog-headroom sets it)")
        self._replacing = catalog.name
        try:
            host = torch.device("cpu")  # the new forest built while constrained batches still run
            forest = await asyncio.to_thread(trie_forest, catalogs, host, capacity)
            self._catalogs_paused = True
            while self._constrained_inflight:
                self._progress.clear()
                await self._progress.wait()
            try:
                await asyncio.to_thread(write, forest)
            except BaseException:  # not one constrained batch may run on a forest half written
                await asyncio.to_thread(write, trie_forest(self.catalogs, host, capacity))
                raise
            self.catalogs = catalogs
            self.catalog_replacements += 1
        finally:
            self._catalogs_paused = False
            self._replacing = None
            self._wake.set()
        return old

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
                release_s = self._release_s(plan, now)
                if self.admission.is_draining and not self._ends_by_drain(plan, now):
                    for ticket in plan.tickets:  # another replica can answer it in time; this one cannot
                        self.admission.remove(ticket, "drained")
                    continue
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
        can_go_heavy = len(self._heavy_s) < max(self.config.max_inflight - 1, 1)
        limits = self._heavy_limits(now)
        if (not can_go_heavy and self._is_heavy(head, now, limits)) or self._held_for_catalogs(head):
            # the last free slot is kept for lighter work: the first queued request light on its own
            # (and, while a catalog is replaced, not constrained)
            head = next((t for t in self.admission.waiting()
                         if (can_go_heavy or not self._is_heavy(t, now, limits)) and not self._held_for_catalogs(t)),
                        None)
            if head is None:
                return None
        fill = _Fill(self.artifact.buckets.of_kind(head.kind))
        bucket = fill.fit_request(head.payload)
        if bucket is None:  # fits no bucket alone (not validated): it fails in _execute, alone
            return _Plan([head], True)
        fill.add_request(head.payload)
        tickets, is_full = [head], False
        deadline = math.inf if head.deadline is None else head.deadline  # the batch's most urgent
        misses = 0
        # the same kind's waiting requests this batch may look at (at most as many as can join, and
        # the misses): a larger bucket is judged by what it will hold, not by one more request alone
        most = min(self.config.max_batch_requests, fill.most)
        pool = list(itertools.islice((t for t in self.admission.waiting() if t is not head and t.kind == head.kind),
                                     most - 1 + MAX_MISSES))
        for i, t in enumerate(pool):
            if len(tickets) >= self.config.max_batch_requests or fill.count >= fill.most:
                is_full = True  # the cap, or as many requests as the largest bucket holds
                break
            if misses >= MAX_MISSES:  # planning stays O(batch), not O(queue), under overload
                break
            if self._held_for_catalogs(t) or (not can_go_heavy and self._is_heavy(t, now, limits)):
                misses += 1
                continue
            bucket = fill.fit_request(t.payload)
            if bucket is None:
                is_full = True  # first fit: a smaller one further back may still join
                misses += 1
                continue
            tighter = deadline if t.deadline is None else min(deadline, t.deadline)
            if bucket is not fill.bucket:  # a larger bucket: no slower per request, in time for all, light if need be
                # per request as the queue would fill it: a bucket of 4 taken for a 3rd request is
                # judged with the 4th that waits behind it (one request at a time, the step from 2
                # to 4 slots looks 1.33x slower per request and a batch would never grow past 2)
                holds = min(bucket.max_requests, self.config.max_batch_requests, fill.count + len(pool) - i)
                batch_s = self._bucket_s(bucket, now)
                if (batch_s / holds > self._bucket_s(fill.bucket, now) / fill.count * GROWTH_TOLERANCE
                        or (not can_go_heavy and batch_s > self._heavy_bar())
                        or now + self._finish_s(batch_s) > tighter or self._may_outlast_cap(bucket, now)
                        or self._outgrows_memory(bucket)):
                    is_full = True
                    misses += 1
                    continue
            fill.add_request(t.payload)
            tickets.append(t)
            deadline = tighter
        # full also when the last one to join was the last one waiting: nothing to wait max_wait_s for
        is_full = is_full or len(tickets) >= self.config.max_batch_requests or fill.count >= fill.most
        return _Plan(tickets, is_full, fill.bucket)

    def _release_s(self, plan: _Plan, now: float) -> float:
        """When a batch not yet full goes, at the latest, for lack of more requests: once its oldest
        member has waited max_wait_s; when requests of its kind arrive at least one per time its
        first request takes alone (a batch of one), up to load_wait_share of that time (capped at
        load_wait_max_s) after it could first have gone (its oldest member's arrival, or the moment
        a slot of a busy executor freed: the callers just answered are about to come back, and a
        wait spent in the queue behind the executor could not have gathered them). A second batch
        pays a batch's whole fixed cost again (a BeamSearch batch of one costs several times the
        step to two), so under such load a short wait that lets the next arrival join is worth more
        than it costs; at lighter load it would be waited in vain. Nor once the batch already holds the requests expected in the server (Little's law:
        those a closed loop of callers sends back together are all there, and the rest are in
        flight), nor so late that a member would miss its deadline."""
        release = plan.oldest_s + self.config.max_wait_s
        head = plan.tickets[0]
        if plan.bucket is None or head.cost is None or self.config.load_wait_share <= 0:
            return release
        solo_s = self._solo_s(head, now)
        if self._arrivals.rate(head.kind, now) * solo_s < 1.0:
            return release
        if self._expected_company(plan, now) < 0.5:
            return release
        wait = min(self.config.load_wait_max_s, self.config.load_wait_share * solo_s)
        ready_s = max(plan.oldest_s, self._slot_freed_s)  # when the batch could first have gone
        return max(min(ready_s + wait, self._latest_start_s(plan, now)), release)

    def _expected_company(self, plan: _Plan, now: float) -> float:
        """How many more requests of the plan's kind are expected to join it: those expected in
        the server (arrival rate x (time in it + a caller's time outside it)) less those already in
        the plan or in flight. inf before any of its kind was answered."""
        kind = plan.tickets[0].kind
        residence = self._residence.mean(kind)
        if residence is None:
            return math.inf
        in_server = self._arrivals.rate(kind, now) * (residence + self.config.load_wait_outside_s)
        return in_server - len(plan.tickets) - self._inflight_by_kind[kind]

    def _latest_start_s(self, plan: _Plan, now: float) -> float:
        """The latest a batch that waits for more may start and still answer every member in time:
        before the last moment by a tenth of the batch (1 ms at least), so that re-formed late it
        still holds them. inf without deadlines."""
        deadlines = [t.deadline for t in plan.tickets if t.deadline is not None]
        if not deadlines:
            return math.inf
        finish_s = self._finish_s(self._bucket_s(plan.bucket, now))
        return min(deadlines) - finish_s - max(0.1 * finish_s, 1e-3)

    def _bucket_s(self, bucket: Any, now: float) -> float:
        return self.model.bucket_s(self.costs.info(bucket), now)

    def _held_for_catalogs(self, ticket: Ticket) -> bool:
        """Whether the request waits for a catalog replacement to finish writing the forest."""
        return self._catalogs_paused and bool(getattr(ticket.payload, "catalog", ""))

    def _ends_by_drain(self, plan: _Plan, now: float) -> bool:
        """Whether the batch is expected to end before the drain's timeout: by its estimate, as its
        requests were admitted (max_batch_s bounded its growth; a bound extrapolated far from what was
        measured, 20x the FLOPs for the first large request after small ones, would refuse work the
        grace has room for)."""
        if plan.bucket is None or math.isinf(self._drain_end_s):
            return True
        return now + self._bucket_s(plan.bucket, now) <= self._drain_end_s

    def _may_outlast_cap(self, bucket: Any, now: float) -> bool:
        """Whether a batch of the bucket may run longer than max_batch_s on this machine (a drain
        must outlast none); a family not measured at all yet is not bounded (its first batch is)."""
        if math.isinf(self.max_batch_s):  # a Scheduler made without a cap: nothing to look up
            return False
        bound_s = self.model.bound_s(self.costs.info(bucket), now)
        return bound_s is not None and bound_s > self.max_batch_s

    def _outgrows_memory(self, bucket: Any) -> bool:
        return (not math.isinf(self.max_batch_bytes)
                and activation_bytes(bucket, self.artifact.config, self._act_elem, dense_attention=self._dense)
                > self.max_batch_bytes)

    def _solo_s(self, ticket: Ticket, now: float) -> float:
        """A request's batch time alone (its smallest bucket)."""
        return self.model.bucket_s(ticket.cost.solo, now)

    def _finish_s(self, batch_s: float) -> float:
        """From a batch's start to its answers, as admission predicts it."""
        return ((batch_s * (1 + self.admission.config.safety_margin) + self.admission.response_margin_s())
                * self.model.calibration_at(self.clock()))

    def _fastest_s(self, ticket: Ticket) -> float:
        """The fastest its own bucket ran lately (0.0: not known): less than that before its
        deadline, a queued request can no longer be answered in time."""
        return 0.0 if ticket.cost is None else self.model.bucket_min_s(ticket.cost.solo, self.clock())

    def _heavy_floor(self) -> float:
        """1/HEAVY_GAP of the lightest heavy batch in flight (0.0: none): nothing under it counts heavy."""
        return min(self._heavy_s, default=0.0) / HEAVY_GAP

    def _heavy_bar(self) -> float:
        """The time above which a batch counts heavy now: heavy_batch_s, or _heavy_floor if more."""
        return max(self.config.heavy_batch_s, self._heavy_floor())

    def _heavy_limits(self, now: float) -> dict[str, float]:
        """Per kind seen lately, the time alone above which its request counts heavy: heavy_ratio x
        the lightest request of another kind seen in the last light_window_s, when that is less than
        heavy_batch_s, and never under 1/HEAVY_GAP of the lightest heavy batch in flight (a kind
        not here: _heavy_bar). Empty while only one kind is seen."""
        cfg = self.config
        lightest = self._recent.lightest(lambda info: self.model.bucket_s(info, now), now) \
            if cfg.heavy_ratio > 0 and len(self._recent) > 1 else {}
        if len(lightest) < 2:
            return {}
        floor = self._heavy_floor()
        return {kind: max(floor, min(cfg.heavy_batch_s, cfg.heavy_ratio * min(s for k, s in lightest.items()
                                                                                  if k != kind)))
                for kind in lightest}

    def _heavy_why(self, plan: _Plan, now: float) -> str:
        """Why a batch about to start is heavy (it may not take the last free slot): "time"
        (predicted over _heavy_bar), "ratio" (a member over its kind's _heavy_limits); "": light."""
        if plan.bucket is None:
            return ""
        if self._bucket_s(plan.bucket, now) > self._heavy_bar():
            return "time"
        limits = self._heavy_limits(now)
        return "ratio" if limits and any(self._is_heavy(t, now, limits) for t in plan.tickets) else ""

    def _is_heavy(self, ticket: Ticket, now: float, limits: dict[str, float]) -> bool:
        """Whether the request alone outlasts its kind's limit (_heavy_limits(now))."""
        return ticket.cost is not None and self._solo_s(ticket, now) > limits.get(ticket.kind, self._heavy_bar())

    def _cost(self, request: Request) -> RequestCost | None:
        try:
            return self.costs.of(request)
        except ValueError:  # fits no bucket (not validated): priced by default, it fails alone
            return None

    def _launch(self, plan: _Plan, now: float) -> None:
        self.admission.take(plan.tickets)
        self._inflight += 1
        self._num_batches += 1
        batch_id = self._num_batches
        why = self._heavy_why(plan, now)
        is_heavy = bool(why)
        heavy_s = self._bucket_s(plan.bucket, now) if is_heavy else 0.0  # (a heavy plan has a bucket)
        if is_heavy:
            self._heavy_s.append(heavy_s)
            self._heavy_batches[why] += 1
        self._inflight_by_kind[plan.tickets[0].kind] += len(plan.tickets)
        constrained = any(getattr(t.payload, "catalog", "") for t in plan.tickets)
        self._constrained_inflight += constrained
        if plan.bucket is not None:
            self.model.batch_started(batch_id, self.costs.info(plan.bucket), now)
        flight = _Flight(plan.tickets, self._executor.make_control(is_heavy), now, plan.bucket)
        for t in plan.tickets:
            self._flights[id(t)] = flight
        task = asyncio.get_running_loop().create_task(self._execute(plan.tickets, now, batch_id, is_heavy, plan.bucket,
                                                                    flight, constrained, heavy_s))
        self._batch_tasks.add(task)
        task.add_done_callback(self._batch_tasks.discard)

    async def _execute(self, tickets: list[Ticket], dequeued_s: float, batch_id: int, is_heavy: bool,
                       bucket: Any = None, flight: _Flight | None = None, constrained: bool = False,
                       heavy_s: float = 0.0) -> None:
        control = None if flight is None else flight.control
        reqs = [t.payload for t in tickets]
        levels = dict(Counter(int(t.priority) for t in tickets))
        run: tuple[float, float] | None = None
        batch: Batch | None = None
        service_s = 0.0
        try:
            packed_from = self.clock()
            # a heavy batch's host work (thousands of beam rows) off the event loop, where light requests wait
            batch = await asyncio.to_thread(self._pack, reqs, bucket) if is_heavy else self._pack(reqs, bucket)
            if control is not None and control.cancelled:  # every member left while it was packed
                raise BatchCancelled("cancelled before it started")
            self._record_batch(batch)
            start_s = self.clock()
            outputs, timings = await self._executor.run(batch, is_heavy, control)
            end_s = self.clock()
            results = (await asyncio.to_thread(self._unpack, batch, outputs) if is_heavy
                       else self._unpack(batch, outputs))
            # the executor's own run (not its queue, nor pauses for lighter batches), on our clock
            run_s = timings.run_ns / 1e9
            run = (end_s - run_s, end_s)
            # what the batch held a slot for: packing, the run, the loop taking the results, unpacking
            service_s = (self.clock() - packed_from - timings.queue_ns / 1e9 - timings.paused_ns / 1e9)
        except Exception as e:  # only this batch's requests see the failure
            if control is not None and control.cancelled:  # stopped: each member already has its answer
                self._num_cancelled_batches += 1
            else:
                self._num_failed_batches += 1
                error = ExecutionError(f"batch of {len(reqs)} request(s) failed: {e}")
                for t in tickets:
                    _settle(t.future, error=error)
        else:
            answered_s = self.clock()
            for i, (t, result) in enumerate(zip(tickets, results)):
                t.answered_s = answered_s
                self._residence.add(t.kind, answered_s - t.enqueued)
                if t.predicted_s and t.measured:  # whether or not its caller is still there to hear it
                    self.model.observe_prediction(t.predicted_s, answered_s + self.model.lag_s - t.enqueued, answered_s,
                                                  int(t.priority))
                if t.deadline is not None and answered_s > t.deadline:  # done after the deadline timer could
                    self._leave(t, "expired")  # act (the loop was busy): not answered late either
                    continue
                _settle(t.future, Completed(result, RequestTimings(
                    t.priority, t.enqueued, dequeued_s, start_s, end_s, batch_id, len(tickets), i,
                    batch.bucket.key, timings)))
        finally:
            for t in tickets:
                self._flights.pop(id(t), None)
            if is_heavy:
                self._heavy_s.remove(heavy_s)
            self._constrained_inflight -= constrained
            self._inflight_by_kind[tickets[0].kind] -= len(tickets)
            if self._inflight == self.config.max_inflight:
                self._slot_freed_s = self.clock()
            self._inflight -= 1
            self._wake.set()
            self._progress.set()
            self.admission.finished(tickets)
            self.model.batch_finished(batch_id, None if batch is None else self.costs.info(batch.bucket), run,
                                      levels, service_s)

    def _pack(self, reqs: list[Any], bucket: Any = None) -> Batch:
        """bucket: the one the plan formed the batch in (buckets.Fill, as the runtime picks it), or
        None to pick it here; packing checks that the requests fit it."""
        bucket = bucket or pick_bucket(self.artifact.buckets, reqs)
        if bucket is None:
            raise ExecutionError(f"{len(reqs)} {request_kind(reqs[0])} request(s) fit no bucket")
        if isinstance(reqs[0], ScoreRequest):
            return pack_score(reqs, bucket, self._label_columns)
        return pack_beam(reqs, bucket, self.catalogs)

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
        if self.admission.remove(ticket, "expired"):
            return
        flight = self._flights.get(id(ticket))
        if flight is None or ticket.future.done() or ticket.deadline is None:
            return
        # batched: it can no longer finish in time if its batch started too late to end by the
        # deadline even as fast as its bucket ran lately; else look again at the deadline itself
        now = self.clock()
        fastest_s = 0.0 if flight.bucket is None else self.model.bucket_min_s(self.costs.info(flight.bucket), now)
        if now < ticket.deadline and flight.started_s + fastest_s <= ticket.deadline:
            asyncio.get_running_loop().call_later(ticket.deadline - now, self._expire, ticket)
            return
        self._leave(ticket, "expired")

    def _leave(self, ticket: Ticket, reason: DropReason) -> None:
        """A member of a batch handed to the executor is gone: cancelled by its caller (its future
        is), or expired (answered DeadlineExpired here). Once no member is left, the batch stops
        at its next node boundary."""
        flight = self._flights.get(id(ticket))
        if flight is None or id(ticket) in flight.gone:
            return
        if reason == "expired" and not ticket.future.done():
            now = self.clock()
            _settle(ticket.future, error=DeadlineExpired(
                f"its batch could not finish by the deadline ({(ticket.deadline or now) - now:.4f} s left, "
                f"{now - flight.started_s:.4f} s into the run); the answer was not sent"))
        elif not ticket.future.done():
            return  # still awaited: not gone
        flight.gone.add(id(ticket))
        self._dropped_in_flight[reason] += 1
        if len(flight.gone) == len(flight.tickets) and not flight.control.cancelled:
            self._executor.cancel(flight.control)

    def _on_drop(self, ticket: Ticket, reason: DropReason) -> None:
        if reason == "expired":
            now = self.clock()
            waited_s = now - ticket.enqueued
            fastest_s = self._fastest_s(ticket)
            if ticket.predicted_s:  # it would have taken longer still: the least of its error
                self.model.observe_prediction(ticket.predicted_s, waited_s + fastest_s, now, int(ticket.priority))
            left_s = (ticket.deadline or now) - now
            why = (f"could no longer finish by its deadline ({left_s:.4f} s left; its own run took at least "
                   f"{fastest_s:.4f} s lately)" if left_s > 0 else "deadline passed")
            _settle(ticket.future, error=DeadlineExpired(f"{why} after {waited_s:.4f} s in the queue; the request "
                                                         "was not executed"))
        elif reason == "drained":
            _settle(ticket.future, error=Overloaded("draining", self.admission.unavailable_hint_s(),
                                                    "the server stopped before running it"))
        else:
            _settle(ticket.future, error=asyncio.CancelledError())
        self._wake.set()
        self._progress.set()

    async def _until_idle(self) -> None:
        while self.admission.depth() or self._inflight:
            self._progress.clear()
            await self._progress.wait()


def _occupancy(batch: Batch) -> float:
    """Useful share of the bucket: real tokens / bucket tokens (Score), real beams / packed beam rows (BeamSearch)."""
    return sum(dims(r)[0] if isinstance(r, ScoreRequest) else r.beam_width for r in batch.requests) / batch.bucket.rows


def _settle(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
