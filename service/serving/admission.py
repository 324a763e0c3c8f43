"""Admission control: three bounded priority lanes, and refusal of work that cannot finish in time.

A request is refused at once (Overloaded, which the server maps to UNAVAILABLE with a retry hint)
when its lane is full, when the server is draining, or when its predicted completion misses its
deadline; it is never run late. The prediction is ServiceTimeModel's: the batches queued ahead of
it times the measured batch time, plus Kingman's G/G/1 waiting term (DESIGN.md), with every
quantity measured online.

Lanes are served in strict priority (ONLINE, NORMAL, BACKGROUND), except that after `online_burst`
consecutive picks of ONLINE while a lower lane waits, a lower lane gets one pick (and likewise
NORMAL over BACKGROUND), so the lower lanes keep a share and never starve. Cancelled and expired
tickets are dropped before they are taken: they never reach the executor.

Everything here is synchronous and single-threaded (the event loop's thread); time comes from an
injected clock in seconds, so the policy is tested with a fake one.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Clock = Callable[[], float]
RefusalReason = Literal["queue_full", "deadline", "draining"]
DropReason = Literal["cancelled", "expired", "drained"]


class Priority(enum.IntEnum):
    """Equal to the proto enum (PRIORITY_UNSPECIFIED = 0 is mapped to NORMAL by the server)."""

    ONLINE = 1
    NORMAL = 2
    BACKGROUND = 3


PRIORITIES = tuple(Priority)  # iterating the enum class itself is several times slower


class Overloaded(Exception):
    """A request refused by admission; retry after `retry_after_s` (here or on another replica)."""

    def __init__(self, reason: RefusalReason, retry_after_s: float, detail: str = "") -> None:
        super().__init__(f"overloaded ({reason}): {detail}" if detail else f"overloaded ({reason})")
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue_online: int = 128  # queued (not yet batched) requests per lane
    max_queue_normal: int = 256
    max_queue_background: int = 512
    online_burst: int = 8  # consecutive ONLINE picks while a lower lane waits, before it gets one
    normal_burst: int = 8  # likewise NORMAL over BACKGROUND
    default_service_s: float = 0.010  # batch time assumed before the first measurement
    ewma_alpha: float = 0.2  # weight of the newest sample in the batch-time averages
    cv_alpha: float = 0.05  # weight of the newest sample in the variability (c_a, c_s) estimates
    safety_margin: float = 0.1  # predicted wait + service is stretched by this fraction
    rho_max: float = 0.95  # utilisation is clamped here so Kingman's term stays finite
    utilisation_window_s: float = 2.0  # busy time / wall time over this trailing window

    def __post_init__(self) -> None:
        for name in ("max_queue_online", "max_queue_normal", "max_queue_background", "online_burst", "normal_burst"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"admission.{name}: must be an integer >= 1, got {value!r}")
        for name in ("default_service_s", "utilisation_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"admission.{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("ewma_alpha", "cv_alpha", "rho_max"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"admission.{name}: must be in (0, 1), got {getattr(self, name)!r}")
        if not self.safety_margin >= 0:
            raise ValueError(f"admission.safety_margin: must be >= 0, got {self.safety_margin!r}")

    def max_queue(self, priority: Priority) -> int:
        return {Priority.ONLINE: self.max_queue_online, Priority.NORMAL: self.max_queue_normal,
                Priority.BACKGROUND: self.max_queue_background}[priority]


# ---- the queueing model ---------------------------------------------------------------------------

class _EwStats:
    """Exponentially weighted mean and variance (West, 1979): adapts as the traffic changes."""

    def __init__(self, alpha: float) -> None:
        self.alpha, self.mean, self.var, self.count = alpha, 0.0, 0.0, 0

    def add(self, x: float) -> None:
        self.count += 1
        if self.count == 1:
            self.mean = x
            return
        diff = x - self.mean
        incr = self.alpha * diff
        self.mean += incr
        self.var = (1 - self.alpha) * (self.var + diff * incr)

    def cv2(self, default: float) -> float:
        """Squared coefficient of variation; `default` until there are a few samples."""
        if self.count < 3 or self.mean <= 0:
            return default
        return self.var / (self.mean * self.mean)


@dataclass
class _BusySpan:
    start: float  # [start, end): executor busy, disjoint from every other span
    end: float
    shares: tuple[float, ...]  # [k]: share of the batch's requests of priority k+1 or higher


class ServiceTimeModel:
    """Online measurements of the batch service time and of the load, and the wait they predict.

    τ        the executor's service time per batch as the queue sees it: EWMA of the part of a
             batch's run not overlapped by an earlier batch (with one batch at a time, its whole
             run; with two lanes running at once, the gap between completions, 1/throughput)
    τ_kind   EWMA of a batch's whole run per kind ("score", "beam.n3", ...): a request's own
             service time once its batch starts
    c_a²     squared coefficient of variation of request inter-arrival times (EW mean/variance)
    c_s²     squared coefficient of variation of batch run times (EW mean/variance)
    ρ        executor busy time / wall time over the trailing window; ρ_k counts only the busy
             time of requests of priority k or higher (a batch's time is split by its requests)

    predict_wait_s(B, k) = B·τ + ρ_k/(1−ρ_k) · (c_a² + c_s²)/2 · τ,   ρ_k clamped to rho_max

    The first term is the known backlog (B batches ahead in the queue or in flight); the second is
    Kingman's G/G/1 mean wait, the variability the present queue does not show (arrivals bunching
    up, long batches). Kingman's W already contains an average backlog, so the sum errs towards
    refusing, never towards running late. Strict priority makes lower lanes invisible to a higher
    one, hence ρ_k: a flood of BACKGROUND work does not make ONLINE requests look late. Before
    three samples, c² is taken as 1 (Poisson arrivals, exponential service: M/M/1).
    """

    def __init__(self, config: AdmissionConfig, clock: Clock = time.monotonic) -> None:
        self.config, self.clock = config, clock
        self._run_by_kind: dict[str, float] = {}
        self._tau: float | None = None
        self._batch_requests: float = 1.0  # EWMA of requests per batch
        self._arrivals = _EwStats(config.cv_alpha)  # inter-arrival gaps
        self._service = _EwStats(config.cv_alpha)  # batch run times
        self._last_arrival: float | None = None
        self._busy_until = -math.inf
        self._spans: deque[_BusySpan] = deque()  # within the window, oldest first
        self._busy_s = [0.0] * len(PRIORITIES)  # [k]: Σ (end − start) · shares[k] over _spans
        self.inflight_batches = 0
        self.num_batches = 0

    # -- measurements --

    def observe_arrival(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if self._last_arrival is not None:
            self._arrivals.add(max(now - self._last_arrival, 0.0))
        self._last_arrival = now

    def batch_started(self) -> None:
        self.inflight_batches += 1

    def batch_finished(self, kind: str, run: tuple[float, float] | None, lanes: dict[Priority, int]) -> None:
        """A batch left the executor. run: its (start, end) in the clock's seconds; None if it failed."""
        self.inflight_batches = max(self.inflight_batches - 1, 0)
        if run is None:
            return
        start, end = run
        exclusive_start = min(max(start, self._busy_until), end)
        self._busy_until = max(self._busy_until, end)
        a = self.config.ewma_alpha
        self._run_by_kind[kind] = _ewma(self._run_by_kind.get(kind), end - start, a)
        self._tau = _ewma(self._tau, end - exclusive_start, a)
        num_requests = sum(lanes.values())
        self._batch_requests = _ewma(self._batch_requests if self.num_batches else None, num_requests, a)
        self._service.add(end - start)
        self.num_batches += 1
        if end > exclusive_start:
            total = max(num_requests, 1)
            shares = tuple(sum(n for p, n in lanes.items() if p <= k) / total for k in PRIORITIES)
            self._add_span(_BusySpan(exclusive_start, end, shares), +1)
        self._forget(end)

    def _add_span(self, span: _BusySpan, sign: int) -> None:
        if sign > 0:
            self._spans.append(span)
        for k, share in enumerate(span.shares):
            self._busy_s[k] = max(self._busy_s[k] + sign * (span.end - span.start) * share, 0.0)

    def _forget(self, now: float) -> None:
        horizon = now - self.config.utilisation_window_s
        while self._spans and self._spans[0].end <= horizon:
            self._add_span(self._spans.popleft(), -1)

    # -- estimates --

    @property
    def tau_s(self) -> float:
        return self._tau if self._tau is not None else self.config.default_service_s

    def service_s(self, kind: str) -> float:
        """Predicted run time of a batch of this kind, once it starts."""
        return self._run_by_kind.get(kind, max(self._run_by_kind.values(), default=self.tau_s))

    @property
    def mean_batch_requests(self) -> float:
        return max(self._batch_requests, 1.0)

    @property
    def ca2(self) -> float:
        return self._arrivals.cv2(1.0)

    @property
    def cs2(self) -> float:
        return self._service.cv2(1.0)

    def utilisation(self, priority: Priority | None = None, now: float | None = None) -> float:
        """ρ over the trailing window; with a priority, only the busy time of that lane and above."""
        now = self.clock() if now is None else now
        self._forget(now)
        window = self.config.utilisation_window_s
        k = (priority or Priority.BACKGROUND) - 1
        busy = self._busy_s[k]
        for span in self._spans:  # spans are disjoint and in order: only the first few straddle the horizon
            if span.start >= now - window:
                break
            busy -= (now - window - span.start) * span.shares[k]
        return min(max(busy, 0.0) / window, 1.0)

    def kingman_wait_s(self, priority: Priority | None = None, now: float | None = None) -> float:
        rho = min(self.utilisation(priority, now), self.config.rho_max)
        return rho / (1 - rho) * (self.ca2 + self.cs2) / 2 * self.tau_s

    def predict_wait_s(self, queue_ahead: float, priority: Priority | None = None, now: float | None = None) -> float:
        """Predicted time before a new request's batch starts; queue_ahead in batches."""
        return queue_ahead * self.tau_s + self.kingman_wait_s(priority, now)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        return {
            "tau_s": self.tau_s,
            "run_s_by_kind": dict(self._run_by_kind),
            "mean_batch_requests": self.mean_batch_requests,
            "ca2": self.ca2,
            "cs2": self.cs2,
            "rho": self.utilisation(None, now),
            "rho_by_priority": {p.name: self.utilisation(p, now) for p in Priority},
            "kingman_wait_s": self.kingman_wait_s(None, now),
            "inflight_batches": self.inflight_batches,
            "batches_observed": self.num_batches,
        }


def _ewma(old: float | None, x: float, alpha: float) -> float:
    return x if old is None else old + alpha * (x - old)


# ---- tickets and lanes ----------------------------------------------------------------------------

@dataclass(eq=False)
class Ticket:
    """One queued request. `kind` names its batching group and service-time class."""

    payload: Any
    kind: str
    priority: Priority = Priority.NORMAL
    deadline: float | None = None  # absolute, in the clock's seconds
    future: Any = None  # an asyncio.Future the scheduler resolves; a cancelled one drops the ticket
    enqueued: float = 0.0
    state: Literal["new", "queued", "taken", "dropped"] = "new"

    def is_expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def is_cancelled(self) -> bool:
        return self.future is not None and self.future.done()


class AdmissionController:
    """Three bounded FIFO lanes with deadline-aware admission and a starvation-free pick order.

    on_drop(ticket, reason) is called for every ticket dropped while queued ("expired",
    "cancelled" or "drained"), so its owner can answer the waiting caller.
    """

    def __init__(self, config: AdmissionConfig | None = None, model: ServiceTimeModel | None = None,
                 clock: Clock = time.monotonic, on_drop: Callable[[Ticket, DropReason], None] | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.clock = clock
        self.model = model or ServiceTimeModel(self.config, clock)
        self.on_drop = on_drop
        self._lanes: dict[Priority, deque[Ticket]] = {p: deque() for p in PRIORITIES}
        self._max_queue = {p: self.config.max_queue(p) for p in PRIORITIES}
        self._streak: dict[Priority, int] = {p: 0 for p in Priority}  # consecutive picks while a lower lane waited
        self.is_draining = False
        self._admitted = {p: 0 for p in Priority}
        self._refused: dict[str, int] = {"queue_full": 0, "deadline": 0, "draining": 0}
        self._dropped: dict[str, int] = {"expired": 0, "cancelled": 0, "drained": 0}
        self._taken = 0

    # -- admission --

    def admit(self, ticket: Ticket) -> None:
        """Queues the ticket, or raises Overloaded (lane full, draining, or it would finish late)."""
        now = self.clock()
        lane = self._lanes[ticket.priority]
        if self.is_draining:
            self._refuse("draining", 0.0, "the server is draining; send to another replica")
        if len(lane) >= self._max_queue[ticket.priority]:
            retry = len(lane) / self.model.mean_batch_requests * self.model.tau_s
            self._refuse("queue_full", retry, f"{ticket.priority.name} lane holds {len(lane)} requests")
        if ticket.deadline is not None:
            finish = now + self.predict_latency_s(ticket, now)
            if finish > ticket.deadline:
                retry = max(finish - ticket.deadline, self.model.tau_s)
                self._refuse("deadline", retry, f"predicted completion in {finish - now:.4f} s misses the "
                                                f"deadline in {ticket.deadline - now:.4f} s")
        ticket.enqueued, ticket.state = now, "queued"
        lane.append(ticket)
        self._admitted[ticket.priority] += 1
        self.model.observe_arrival(now)

    def predict_latency_s(self, ticket: Ticket, now: float | None = None) -> float:
        """Queue wait + own batch time, stretched by the safety margin."""
        now = self.clock() if now is None else now
        ahead = sum(len(self._lanes[p]) for p in PRIORITIES if p <= ticket.priority)
        batches_ahead = math.ceil(ahead / self.model.mean_batch_requests) + self.model.inflight_batches
        wait = self.model.predict_wait_s(batches_ahead, ticket.priority, now)
        return (wait + self.model.service_s(ticket.kind)) * (1 + self.config.safety_margin)

    def _refuse(self, reason: RefusalReason, retry_after_s: float, detail: str) -> None:
        self._refused[reason] += 1
        raise Overloaded(reason, retry_after_s, detail)

    def start_draining(self) -> None:
        """From now on every admit() is refused ("draining"); queued tickets are still taken."""
        self.is_draining = True

    # -- dropping --

    def remove(self, ticket: Ticket, reason: DropReason) -> bool:
        """Drops a queued ticket: cancelled by its caller, expired, or left over when a drain timed
        out. False if it was not queued (already taken into a batch, or dropped)."""
        if ticket.state != "queued":
            return False
        self._lanes[ticket.priority].remove(ticket)
        self._drop(ticket, reason)
        return True

    def _drop(self, ticket: Ticket, reason: DropReason) -> None:
        ticket.state = "dropped"
        self._dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(ticket, reason)

    def _purge(self, now: float) -> None:
        for p, lane in self._lanes.items():
            dead = [t for t in lane if t.is_cancelled or t.is_expired(now)]
            if dead:
                self._lanes[p] = deque(t for t in lane if not (t.is_cancelled or t.is_expired(now)))
                for t in dead:
                    self._drop(t, "cancelled" if t.is_cancelled else "expired")

    # -- taking --

    def head(self, now: float | None = None) -> Ticket | None:
        """The ticket to serve next (its lane by the priority/share policy, FIFO within the lane);
        cancelled and expired tickets are dropped first. Nothing is removed."""
        self._purge(self.clock() if now is None else now)
        waiting = [p for p in PRIORITIES if self._lanes[p]]
        if not waiting:
            return None
        lane = waiting[-1]
        for p in waiting[:-1]:
            if self._streak[p] < self._burst(p):
                lane = p
                break
        return self._lanes[lane][0]

    def _burst(self, priority: Priority) -> int:
        return self.config.online_burst if priority == Priority.ONLINE else self.config.normal_burst

    def waiting(self) -> Iterator[Ticket]:
        """Every queued ticket, in priority order, FIFO within a lane (for filling a batch)."""
        for p in PRIORITIES:
            yield from self._lanes[p]

    def take(self, tickets: list[Ticket]) -> None:
        """Removes the tickets of a batch; tickets[0] must be head(): its lane counts as the pick."""
        pick = tickets[0].priority
        for p in PRIORITIES:
            lower_waiting = any(self._lanes[q] for q in PRIORITIES if q > p)
            if p == pick:
                self._streak[p] = self._streak[p] + 1 if lower_waiting else 0
            elif p < pick and self._lanes[p]:
                self._streak[p] = 0  # it was passed over: its burst starts again
        for t in tickets:
            if t.state != "queued":
                raise ValueError(f"ticket {t.payload!r} is {t.state}, not queued")
            t.state = "taken"
        for p in {t.priority for t in tickets}:  # one pass per lane, not one deque.remove per ticket
            self._lanes[p] = deque(t for t in self._lanes[p] if t.state == "queued")
        self._taken += len(tickets)

    def take_next(self, now: float | None = None) -> Ticket | None:
        """head() and take() of that one ticket."""
        t = self.head(now)
        if t is not None:
            self.take([t])
        return t

    # -- numbers --

    def depth(self, priority: Priority | None = None) -> int:
        if priority is None:
            return sum(len(lane) for lane in self._lanes.values())
        return len(self._lanes[priority])

    def stats(self) -> dict[str, Any]:
        return {
            "admitted": sum(self._admitted.values()),
            "admitted_by_priority": {p.name: n for p, n in self._admitted.items()},
            "refused": dict(self._refused),
            "expired": self._dropped["expired"],
            "cancelled": self._dropped["cancelled"],
            "drained": self._dropped["drained"],
            "taken": self._taken,
            "queue_depth": {p.name: len(lane) for p, lane in self._lanes.items()},
            "draining": self.is_draining,
            "model": self.model.snapshot(),
        }


__all__ = ["AdmissionConfig", "AdmissionController", "Overloaded", "Priority", "ServiceTimeModel", "Ticket"]
