"""Admission control: bounded priority lanes, fair shares between clients, and refusal of work that
cannot finish in time — decided at once, from the work actually queued ahead.

Every request gets its verdict from verdict.decide (the one function the fronts call too) over
this controller's exact view of the lanes (`outlook`): refused at once when the server is
draining, when its lane is full (requests, or predicted seconds of work), when its client already
has `max_client_work_s` outstanding, or when its predicted completion misses its deadline
(Overloaded: UNAVAILABLE with a retry hint, never above `max_retry_after_s`); a deadline shorter
than the request's own service time on an idle executor, or already passed, can never be met
(DeadlineUnmeetable: DEADLINE_EXCEEDED, no retry). The terms this module prices
(ServiceTimeModel measures the executor, per bucket):

  own      the request's bucket time when it runs alone
  share    its share of a batch: its kind's bucket for n requests / n, n the batch that the
           requests of its kind queued with it would make (1, 2, 4, ...)
  ahead    the shares before it in its own lane; with the shares queued in higher lanes and the
           executor time owed to the batches in flight, its wait
  stretch  a lower lane's wait stretched by the higher lanes' utilisation, 1/(1 − ρ_higher), at
           most burst + 1 (the share a lower lane keeps), times 1 + 1/burst while a lower lane waits
  response response_margin_s or the event loop's measured delay in answering, whichever is larger
  calibration  the worst ratio of actual to predicted latency seen, its excess decaying over
           calibration_decay_s (>= 1): what the model misses, it learns from its own errors
  idle     the bucket's own measured time on an idle host (batches slowed by another process on
           the cores count at the time they would have taken: ServiceTimeModel): only on it is a
           deadline called impossible; on idle lanes (nothing queued or in flight) a request that
           would fit at it is tried, whatever the queueing terms and the calibration say

A request refused for its deadline (or a full lane) is told to retry when it would fit (at least
one run of its own later), and after the requests refused before it: retry appointments one share
of the executor apart (verdict.RetryBook), so that requests refused together do not all return
together. Nothing is clamped into a queueing formula: the queue ahead is known at admission.

Within a lane, clients (a client-id metadata key, else the peer) are served in start-time fair
queuing order by cost, in seconds of predicted executor share: a client's request starts its
virtual time where the client's previous one finished, or where the lane is now, so a light
client's request goes ahead of a heavy client's backlog. A request only goes ahead of queued
requests whose deadline slack covers its share (each queued request keeps its slack, less the
shares that went ahead of it), so admitted work is not made late by later arrivals.

Lanes are served in strict priority (ONLINE, NORMAL, BACKGROUND), except that after `online_burst`
consecutive ONLINE picks while a lower lane waits, a lower lane gets one (likewise NORMAL over
BACKGROUND). Cancelled and expired tickets are dropped before they are taken: they never reach the
executor.

Everything here runs on the event loop's thread; time comes from an injected clock in seconds.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from .cost import RequestCost
from .host import CpuShare
from .service_time import ServiceTimeModel
from .verdict import (PRIORITIES, DeadlineExpired, DeadlineUnmeetable, Outlook, Overloaded, Priority, RefusalReason,
                      RetryBook, RetryHints, decide)

Clock = Callable[[], float]
DropReason = Literal["cancelled", "expired", "drained"]

# A batch grows into a larger bucket only while its time per request stays within this factor of
# the smaller bucket's (larger buckets are cheaper per request on a GPU; not always on a CPU).
GROWTH_TOLERANCE = 1.1


@dataclass(frozen=True)
class AdmissionConfig:
    max_queue_online: int = 128  # queued (not yet batched) requests per lane
    max_queue_normal: int = 256
    max_queue_background: int = 512
    max_lane_work_s: float = 30.0  # predicted executor seconds queued per lane (one request always fits)
    max_client_work_s: float = 0.0  # per client, queued + in flight (one request always fits); 0: no cap
    online_burst: int = 8  # consecutive ONLINE picks while a lower lane waits, before it gets one
    normal_burst: int = 8  # likewise NORMAL over BACKGROUND
    default_service_s: float = 0.010  # batch time assumed before the first measurement
    service_window: int = 32  # measured batch times kept per bucket
    service_quantile: float = 0.9  # a bucket's time is this quantile of its window
    service_ttl_s: float = 60.0  # older measurements give way to interpolation over fresher ones
    outlier_factor: float = 4.0  # a sample above this x the estimate is recorded capped at it
    calibration_decay_s: float = 10.0  # predictions stretched by the worst actual/predicted seen, decaying; 0: off
    max_calibration: float = 2.0  # ... at most this much
    safety_margin: float = 0.1  # predicted wait + service is stretched by this fraction
    response_margin_s: float = 0.002  # unpacking, encoding and sending after the batch
    max_retry_after_s: float = RetryHints.max_s  # every retry hint is at most this
    min_retry_after_s: float = RetryHints.min_s  # ... and at least this
    unavailable_retry_s: float = RetryHints.unavailable_s  # the hint while loading or draining
    utilisation_window_s: float = 2.0  # busy time / wall time over this trailing window
    max_inflight_rpcs: int = 1024  # Ranker RPCs being handled at once; more: UNAVAILABLE at once
    client_id_metadata: str = "x-client-id"  # metadata key naming the client; absent: the peer's address
    # serve --fronts N: the fronts refuse ("backlog") while forwarded requests wait longer than this
    # between a front and the engine's handler (the engine's event loop is behind)
    front_max_backlog_s: float = 0.005
    # ... and refuse ("deadline") what their prediction finishes within this share of the time left
    # before the deadline: their view is a little late, and what they let through the engine should
    # admit (its refusals wait behind its event loop). verdict.py says more
    front_deadline_margin: float = 0.03

    def __post_init__(self) -> None:
        if not self.max_calibration >= 1:
            raise ValueError(f"admission.max_calibration: must be >= 1, got {self.max_calibration!r}")
        for name in ("max_queue_online", "max_queue_normal", "max_queue_background", "online_burst", "normal_burst",
                     "service_window", "max_inflight_rpcs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"admission.{name}: must be an integer >= 1, got {value!r}")
        for name in ("default_service_s", "utilisation_window_s", "max_lane_work_s", "service_ttl_s", "front_max_backlog_s",
                     "max_retry_after_s", "min_retry_after_s", "unavailable_retry_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"admission.{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("safety_margin", "response_margin_s", "max_client_work_s", "calibration_decay_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"admission.{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.front_deadline_margin < 1:
            raise ValueError(f"admission.front_deadline_margin: must be in [0, 1), got {self.front_deadline_margin!r}")
        if not 0 < self.service_quantile <= 1:
            raise ValueError(f"admission.service_quantile: must be in (0, 1], got {self.service_quantile!r}")
        if not self.outlier_factor >= 1:
            raise ValueError(f"admission.outlier_factor: must be >= 1, got {self.outlier_factor!r}")
        if self.min_retry_after_s > self.max_retry_after_s:
            raise ValueError("admission.min_retry_after_s: must be <= max_retry_after_s")
        if not self.client_id_metadata or self.client_id_metadata != self.client_id_metadata.lower():
            raise ValueError("admission.client_id_metadata: a lower-case metadata key, got "
                             f"{self.client_id_metadata!r}")

    @property
    def retry_hints(self) -> RetryHints:
        return RetryHints(self.min_retry_after_s, self.max_retry_after_s, self.unavailable_retry_s)

    def retry_hint_s(self, seconds: float) -> float:
        """A retry hint: seconds, within [min_retry_after_s, max_retry_after_s]."""
        return self.retry_hints.clamp(seconds)

    def max_queue(self, priority: Priority) -> int:
        return {Priority.ONLINE: self.max_queue_online, Priority.NORMAL: self.max_queue_normal,
                Priority.BACKGROUND: self.max_queue_background}[priority]

    def service_model(self, num_lanes: int = 1) -> ServiceTimeModel:
        return ServiceTimeModel(default_s=self.default_service_s, window=self.service_window,
                                quantile=self.service_quantile, ttl_s=self.service_ttl_s,
                                outlier_factor=self.outlier_factor, utilisation_window_s=self.utilisation_window_s,
                                num_lanes=num_lanes, calibration_decay_s=self.calibration_decay_s,
                                max_calibration=self.max_calibration, host=CpuShare())


# ---- tickets ----------------------------------------------------------------------------------------

@dataclass(eq=False)
class Ticket:
    """One queued request. `kind` names its batching group; `cost` its buckets (None: priced as
    one default batch)."""

    payload: Any
    kind: str
    priority: Priority = Priority.NORMAL
    deadline: float | None = None  # absolute, in the clock's seconds
    future: Any = None  # an asyncio.Future the scheduler resolves; a cancelled one drops the ticket
    client: str = ""
    cost: RequestCost | None = None
    enqueued: float = 0.0
    state: Literal["new", "queued", "taken", "dropped", "done"] = "new"
    own_s: float = 0.0  # predicted run time of its bucket alone
    work_s: float = 0.0  # its predicted share of the executor (what it counts in queues and for its client)
    slack_s: float = math.inf  # deadline − predicted finish, less the shares admitted ahead of it since
    tag: float = 0.0  # start-time fair queuing: its virtual start in its lane
    answered_s: float = 0.0  # when its result (or error) was set
    predicted_s: float = 0.0  # admission's latency prediction before calibration
    measured: bool = False  # its bucket's time came from measurements, not the assumed default: only
    # then does its actual latency against the prediction teach the calibration anything
    idle_s: float | None = None  # its bucket's own measured idle time (None: none of its own)

    def is_expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def is_cancelled(self) -> bool:
        return self.future is not None and self.future.done()


class _Lane:
    """One priority's queue, in start-time fair queuing order; running totals for admission."""

    def __init__(self) -> None:
        self.tickets: list[Ticket] = []  # by tag, FIFO among equal tags
        self.tags: list[float] = []  # their tags, for bisect
        self.vtime = 0.0  # the tag of the last ticket taken
        self.finish: dict[str, float] = {}  # client -> virtual finish of its last queued ticket
        self.work_s = 0.0
        self.kinds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.tickets)

    def insert(self, ticket: Ticket, index: int) -> None:
        self.tickets.insert(index, ticket)
        self.tags.insert(index, ticket.tag)
        self.work_s += ticket.work_s
        self.kinds[ticket.kind] = self.kinds.get(ticket.kind, 0) + 1
        self.finish[ticket.client] = max(self.finish.get(ticket.client, 0.0), ticket.tag + ticket.work_s)

    def discard(self, gone: set[int]) -> None:
        """Removes the tickets whose id() is in gone."""
        kept = [t for t in self.tickets if id(t) not in gone]
        for t in self.tickets:
            if id(t) in gone:
                self.work_s -= t.work_s
                self.kinds[t.kind] -= 1
        self.tickets, self.tags = kept, [t.tag for t in kept]
        if not kept:
            self.work_s = 0.0  # no float drift left behind
        queued = {t.client for t in kept}
        for client in [c for c, f in self.finish.items() if c not in queued and f <= self.vtime]:
            del self.finish[client]  # its virtual time is behind the lane's: it starts from the lane's


# ---- the controller ---------------------------------------------------------------------------------

class AdmissionController:
    """on_drop(ticket, reason) is called for every ticket dropped while queued ("expired",
    "cancelled" or "drained"), so its owner can answer the waiting caller."""

    def __init__(self, config: AdmissionConfig | None = None, model: ServiceTimeModel | None = None,
                 clock: Clock = time.monotonic, on_drop: Callable[[Ticket, DropReason], None] | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.clock = clock
        self.model = model or self.config.service_model()
        self.on_drop = on_drop
        self.on_change: Callable[[], None] = lambda: None  # after every change of the queues (the fronts' snapshot)
        self._lanes: dict[Priority, _Lane] = {p: _Lane() for p in PRIORITIES}
        self._max_queue = {p: self.config.max_queue(p) for p in PRIORITIES}
        self._streak: dict[Priority, int] = {p: 0 for p in PRIORITIES}  # consecutive picks while a lower lane waited
        self._client_work: dict[str, float] = {}  # queued + in flight
        self._client_count: dict[str, int] = {}
        self.is_draining = False
        self._admitted = {p: 0 for p in PRIORITIES}
        self._refused: dict[str, int] = {"queue_full": 0, "client_limit": 0, "deadline": 0, "draining": 0,
                                         "impossible": 0}
        self._dropped: dict[str, int] = {"expired": 0, "cancelled": 0, "drained": 0}
        self._taken = 0
        self._retries = RetryBook()
        self._hints = self.config.retry_hints

    # -- admission --

    def admit(self, ticket: Ticket, dry_run: bool = False) -> None:
        """Queues the ticket, or raises Overloaded / DeadlineUnmeetable (verdict.decide). dry_run:
        every check and every refusal as admit would make them now, but nothing is queued (the
        server's gate before decoding a request: a refusal there costs the event loop no validation
        or tokenization)."""
        now = self.clock()
        lane = self._lanes[ticket.priority]
        index, tag, outlook = self.price(ticket, now)
        work_s = ticket.work_s
        verdict = decide(outlook)
        ticket.predicted_s = verdict.predicted_s  # also calibrates, deadline or not
        if verdict.reason is not None:
            self._refused[verdict.reason] += 1
            if verdict.reason in ("impossible", "deadline") and outlook.is_measured:
                self.model.note_refusal(now)  # the next batch checks the estimates against the host
            raise self._retries.refusal(verdict, outlook, self._hints)
        if ticket.deadline is not None:
            ticket.slack_s = ticket.deadline - verdict.finish
        if dry_run:
            return
        for t in lane.tickets[index:]:  # they now wait for this one's share too
            t.slack_s -= work_s * (1 + self.config.safety_margin)
        ticket.tag, ticket.enqueued, ticket.state = tag, now, "queued"
        lane.insert(ticket, index)
        self._client_work[ticket.client] = self._client_work.get(ticket.client, 0.0) + work_s
        self._client_count[ticket.client] = self._client_count.get(ticket.client, 0) + 1
        self._admitted[ticket.priority] += 1
        self.on_change()

    def price(self, ticket: Ticket, now: float) -> tuple[int, float, Outlook]:
        """Prices the ticket (own_s, measured, work_s), places it in its lane (index, fair-queuing
        tag) and returns the engine's outlook for it; nothing is queued."""
        ticket.own_s = self._bucket_s(ticket, 1, now)
        ticket.measured = ticket.cost is not None and self.model.is_measured(ticket.cost.packings[0][1], now)
        ticket.idle_s = None if ticket.cost is None else self.model.idle_s(ticket.cost.solo, now)
        ticket.work_s = self._share_s(ticket, now)
        index, tag = self._place(self._lanes[ticket.priority], ticket)
        return index, tag, self.outlook(ticket, index, now)

    def outlook(self, ticket: Ticket, index: int, now: float) -> Outlook:
        """The engine's exact view for a priced ticket (own_s, work_s set) placed at `index` of its lane."""
        cfg, model, p = self.config, self.model, ticket.priority
        lane = self._lanes[p]
        ahead_s = sum(t.work_s for t in lane.tickets[:index]) if index < len(lane) else lane.work_s
        return Outlook(
            now=now, deadline=ticket.deadline, priority=p, own_s=ticket.own_s, work_s=ticket.work_s,
            is_measured=model.num_batches > 0, lane_length=len(lane), lane_max_queue=self._max_queue[p],
            lane_work_s=lane.work_s, max_lane_work_s=cfg.max_lane_work_s, ahead_s=ahead_s,
            higher_work_s=sum(self._lanes[q].work_s for q in PRIORITIES if q < p),
            inflight_s=model.inflight_remaining_s(now), parallelism=model.parallelism(now),
            stretch=self._stretch(p, now), calibration=model.calibration_at(now), safety_margin=cfg.safety_margin,
            response_margin_s=cfg.response_margin_s, response_s=self.response_margin_s(), is_draining=self.is_draining,
            client=ticket.client, client_work_s=self._client_work.get(ticket.client, 0.0),
            max_client_work_s=cfg.max_client_work_s, bucket="" if ticket.cost is None else ticket.cost.solo.key,
            idle_s=ticket.idle_s, is_idle=not model.num_inflight and not any(self._lanes.values()))

    def _place(self, lane: _Lane, ticket: Ticket) -> tuple[int, float]:
        """Start-time fair queuing: the index and tag of a new ticket in its lane. It does not go
        ahead of a queued ticket whose slack would not cover its share."""
        tag = max(lane.vtime, lane.finish.get(ticket.client, 0.0))
        index = bisect.bisect_right(lane.tags, tag)
        if index == len(lane):
            return index, tag
        need_s = ticket.work_s * (1 + self.config.safety_margin)
        for i in range(len(lane) - 1, index - 1, -1):  # the last queued ticket it must not pass
            if lane.tickets[i].slack_s < need_s:
                return i + 1, max(tag, lane.tickets[i].tag)
        return index, tag

    def response_margin_s(self) -> float:
        """Time an answer needs after its batch: unpacking, encoding, sending (the configured
        margin) or the event loop's measured delay, whichever is larger."""
        return max(self.config.response_margin_s, self.model.lag_s)

    def _stretch(self, priority: Priority, now: float) -> float:
        """How much the lanes around it stretch a lane's wait: work arriving in higher lanes
        (utilisation ρ_higher: 1/(1 − ρ), at most what the burst share allows) and the picks a
        waiting lower lane gets."""
        factor = 1.0
        if priority > Priority.ONLINE:
            burst = self._burst(Priority(priority - 1))
            rho = min(self.model.utilisation(priority - 1, now), 1 - 1 / (burst + 1))
            factor /= 1 - rho
        if priority < Priority.BACKGROUND and any(self._lanes[p] for p in PRIORITIES if p > priority):
            factor *= 1 + 1 / self._burst(priority)
        return factor

    def predict_latency_s(self, ticket: Ticket, now: float | None = None) -> float:
        """Admission's prediction for this ticket if it came now, at the end of its lane."""
        now = self.clock() if now is None else now
        priced = Ticket(ticket.payload, ticket.kind, ticket.priority, cost=ticket.cost, client=ticket.client)
        priced.own_s = self._bucket_s(ticket, 1, now)
        v = decide(self.outlook(priced, len(self._lanes[ticket.priority]), now))
        return v.predicted_s * self.model.calibration_at(now)

    # -- costs --

    def _bucket_s(self, ticket: Ticket, n: int, now: float) -> float:
        """The time of the bucket that n requests like this one fill (n = 1, 2, 4, ...)."""
        if ticket.cost is None:
            return self.config.default_service_s
        packings = ticket.cost.packings
        _, info = packings[min(n.bit_length() - 1, len(packings) - 1)]
        return self.model.bucket_s(info, now)

    def _share_s(self, ticket: Ticket, now: float) -> float:
        """Its share of the batch that the requests of its kind queued with it would make: the
        batcher grows a batch while the time per request does not get worse (GROWTH_TOLERANCE)."""
        if ticket.cost is None:
            return self.config.default_service_s
        same = 1 + sum(self._lanes[p].kinds.get(ticket.kind, 0) for p in PRIORITIES if p <= ticket.priority)
        share = ticket.own_s
        for n, info in ticket.cost.packings[1:]:
            if n > same:
                break
            per_request = self.model.bucket_s(info, now) / n
            if per_request > share * GROWTH_TOLERANCE:
                break
            share = per_request
        return share

    def _hint(self, seconds: float) -> float:
        return self._hints.clamp(seconds)

    def unavailable_hint_s(self) -> float:
        """The retry hint of a server that is loading or draining."""
        return self._hint(self.config.unavailable_retry_s)

    def backlog_hint_s(self) -> float:
        """A retry hint for work refused before admission (too many RPCs at once): the time to work
        off what is queued and in flight now."""
        now = self.clock()
        queued = sum(lane.work_s for lane in self._lanes.values())
        return self._hint((self.model.inflight_remaining_s(now) + queued) / self.model.parallelism(now))

    def start_draining(self) -> None:
        """From now on every admit() is refused ("draining"); queued tickets are still taken."""
        self.is_draining = True
        self.on_change()

    # -- dropping --

    def remove(self, ticket: Ticket, reason: DropReason) -> bool:
        """Drops a queued ticket: cancelled by its caller, expired, or left over when a drain timed
        out. False if it was not queued (already taken into a batch, or dropped)."""
        if ticket.state != "queued":
            return False
        self._lanes[ticket.priority].discard({id(ticket)})
        self._drop(ticket, reason)
        return True

    def _drop(self, ticket: Ticket, reason: DropReason) -> None:
        ticket.state = "dropped"
        self._release_client(ticket)
        self._dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(ticket, reason)
        self.on_change()

    def _release_client(self, ticket: Ticket) -> None:
        client = ticket.client
        left = self._client_count.get(client, 0) - 1
        if left <= 0:
            self._client_count.pop(client, None)
            self._client_work.pop(client, None)
        else:
            self._client_count[client] = left
            self._client_work[client] = max(self._client_work[client] - ticket.work_s, 0.0)

    def _purge(self, now: float) -> None:
        for lane in self._lanes.values():
            dead = [t for t in lane.tickets if t.is_cancelled or t.is_expired(now)]
            if dead:
                lane.discard({id(t) for t in dead})
                for t in dead:
                    self._drop(t, "cancelled" if t.is_cancelled else "expired")

    # -- taking --

    def head(self, now: float | None = None) -> Ticket | None:
        """The ticket to serve next (its lane by the priority/share policy, fair queuing order within
        the lane); cancelled and expired tickets are dropped first. Nothing is removed."""
        self._purge(self.clock() if now is None else now)
        waiting = [p for p in PRIORITIES if self._lanes[p]]
        if not waiting:
            return None
        lane = waiting[-1]
        for p in waiting[:-1]:
            if self._streak[p] < self._burst(p):
                lane = p
                break
        return self._lanes[lane].tickets[0]

    def _burst(self, priority: Priority) -> int:
        return self.config.online_burst if priority == Priority.ONLINE else self.config.normal_burst

    def waiting(self) -> Iterator[Ticket]:
        """Every queued ticket, in priority order, fair queuing order within a lane (for filling a batch)."""
        for p in PRIORITIES:
            yield from self._lanes[p].tickets

    def take(self, tickets: list[Ticket]) -> None:
        """Removes the tickets of a batch; tickets[0] is the pick (normally head()): its lane counts
        as the lane served."""
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
        for p in {t.priority for t in tickets}:  # one pass per lane
            lane = self._lanes[p]
            lane.vtime = max(lane.vtime, max(t.tag for t in tickets if t.priority == p))
            lane.discard({id(t) for t in tickets if t.priority == p})
        self._taken += len(tickets)
        self.on_change()

    def finished(self, tickets: list[Ticket]) -> None:
        """The batch of these taken tickets is over: their work no longer counts for their clients."""
        for t in tickets:
            if t.state == "taken":
                t.state = "done"
                self._release_client(t)
        self.on_change()

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

    def lane_views(self, now: float, num_points: int, num_clients: int) -> list[dict[str, Any]]:
        """Per lane (ONLINE first), what a front process needs to repeat admit()'s checks
        (service/serving/fronts/gate.py): queued work and length, the queue cap, the wait stretch, the work
        of the higher lanes, the virtual time, up to num_points samples (tag, work queued at tags up
        to it) of the fair-queuing order ending with the last ticket, and the virtual finish of
        the num_clients clients that finish latest."""
        out, higher_s = [], 0.0
        for p in PRIORITIES:
            lane = self._lanes[p]
            n = len(lane)
            points: list[tuple[float, float]] = []
            if n:
                picks = range(n) if n <= num_points else \
                    sorted({n - 1 - (i * (n - 1)) // (num_points - 1) for i in range(num_points)})
                cum, at = 0.0, 0
                for i in picks:
                    for t in lane.tickets[at:i + 1]:
                        cum += t.work_s
                    at = i + 1
                    points.append((lane.tags[i], cum))
            finish = lane.finish if len(lane.finish) <= num_clients else \
                dict(heapq.nlargest(num_clients, lane.finish.items(), key=lambda kv: kv[1]))
            out.append({"work_s": lane.work_s, "length": n, "max_queue": self._max_queue[p],
                        "stretch": self._stretch(p, now), "higher_work_s": higher_s, "vtime": lane.vtime,
                        "points": points, "finish": finish})
            higher_s += lane.work_s
        return out

    def client_work_s(self, client: str) -> float:
        return self._client_work.get(client, 0.0)

    def stats(self) -> dict[str, Any]:
        now = self.clock()
        model = self.model.snapshot(now)
        model["rho_by_priority"] = {p.name: self.model.utilisation(int(p), now) for p in PRIORITIES}
        model["error_by_priority"] = {p.name: self.model.lane_error_at(int(p), now) for p in PRIORITIES}
        return {
            "admitted": sum(self._admitted.values()),
            "admitted_by_priority": {p.name: n for p, n in self._admitted.items()},
            "refused": dict(self._refused),
            "expired": self._dropped["expired"],
            "cancelled": self._dropped["cancelled"],
            "drained": self._dropped["drained"],
            "taken": self._taken,
            "queue_depth": {p.name: len(lane) for p, lane in self._lanes.items()},
            "queue_work_s": {p.name: lane.work_s for p, lane in self._lanes.items()},
            "clients": len(self._client_count),
            "draining": self.is_draining,
            "model": model,
        }


__all__ = ["GROWTH_TOLERANCE", "AdmissionConfig", "AdmissionController", "DeadlineExpired", "DeadlineUnmeetable",
           "Overloaded", "Priority", "Ticket"]
