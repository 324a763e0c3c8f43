"""A front's gate: admission's one verdict (service/sched/verdict.py) over the engine's shared
snapshot, each unknown taken at its least, so that a front refuses only what the engine would:

  own, share   the published service time of the request's shape; a shape not seen lately: 0
  ahead        the work queued at fair-queuing tags up to the client's start (published samples:
               at least that much); a client not published starts at its lane's virtual time
  in flight    the published remaining work, decayed at one second a second per batch since
  client work  not known: no client limit here (the engine keeps it)
  ingress      the engine's measured delay in taking what fronts forward (the "backlog" check)
  in transit   this front's own forwards the snapshot cannot show yet (sent less than the ingress
               delay before it was published): their shares count as work ahead (its lane) or
               above (a higher lane)
  margin       the deadline check leaves the engine's front_deadline_margin of the time left
               spare (verdict.py says why)

Without a margin and with nothing in transit a front refuses only what the engine would
(tests/service/test_fronts.py checks this on random states); with them, what the engine would
refuse at a deadline sooner by the margin, once the forwards in transit are queued.

A refusal is the engine's own exception (Overloaded, DeadlineUnmeetable, NotServing), answered
through the one status mapping (service/serving/status.py). Imports no torch.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from ...sched.shapes import message_dims, shape_key
from ...sched.verdict import DeadlineUnmeetable, Outlook, Overloaded, Priority, RetryBook, RetryHints, decide, \
    lane_of
from ..status import NotServing
from .state import STATE_DRAINING, STATE_SERVING, Snapshot, SnapshotBusy, client_key, ingress_delay_s

def snapshot_outlook(snap: Snapshot, priority: Priority, dims: tuple, deadline: float | None, client: str,
                     now: float, transit_s: tuple[float, float] = (0.0, 0.0)) -> Outlook:
    """A front's view of one request's lane (module docstring). transit_s: the work of its forwards
    in transit (FrontGate.in_transit_s), in the request's lane and in the lanes above it."""
    own_s, share_s, idle_s = snap.shapes.get(shape_key(dims), (0.0, 0.0, 0.0))
    lane = snap.lanes[priority - 1]
    tag = max(lane.vtime, lane.clients.get(client_key(client), 0.0))
    ahead_s = 0.0
    for t, cum in lane.points:  # the last point is the last ticket: past it, the whole lane
        if t > tag:
            break
        ahead_s = cum
    return Outlook(
        now=now, deadline=deadline, priority=priority, own_s=own_s, work_s=share_s,
        is_measured=snap.measured and own_s > 0, lane_length=lane.length, lane_max_queue=lane.max_queue,
        lane_work_s=lane.work_s, max_lane_work_s=snap.max_lane_work_s, ahead_s=ahead_s + transit_s[0],
        higher_work_s=lane.higher_work_s + transit_s[1], deadline_margin=snap.deadline_margin,
        inflight_s=max(snap.inflight_s - snap.inflight_batches * max(now - snap.published_s, 0.0), 0.0),
        parallelism=snap.parallelism, stretch=lane.stretch, calibration=snap.calibration,
        safety_margin=snap.safety_margin, response_margin_s=snap.response_margin_s, response_s=snap.response_s,
        client=client, ingress_s=ingress_delay_s(snap.ingress_s, snap.ingress_at, now),
        max_backlog_s=snap.max_backlog_s, idle_s=idle_s if idle_s > 0 else None,
        is_idle=not snap.inflight_batches and not any(lane.length for lane in snap.lanes))


def hints_of(snap: Snapshot) -> RetryHints:
    return RetryHints(snap.min_retry_s, snap.max_retry_s, snap.unavailable_retry_s)


def refusal_reason(e: Exception) -> str:
    """A refusal's reason, as the fronts count them: an Overloaded's own reason, "impossible",
    or "loading" / "draining"."""
    if isinstance(e, Overloaded):
        return e.reason
    if isinstance(e, DeadlineUnmeetable):
        return "impossible"
    return e.reason if isinstance(e, NotServing) else "internal"


class FrontGate:
    """verdict.decide at a front, on the snapshot `read` returns (module docstring)."""

    def __init__(self, read: Callable[[], Snapshot], num_fronts: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.clock = read, clock
        # each of N fronts sees 1/N of the arrivals: its appointments are N shares apart
        self.retries = RetryBook(spread=num_fronts)
        self._forwards: deque[tuple[float, Priority, float]] = deque()  # (when, lane, share) of what it let through

    def in_transit_s(self, snap: Snapshot, priority: Priority, now: float) -> tuple[float, float]:
        """The shares of this front's forwards that `snap` cannot show yet, in `priority`'s lane and
        in the lanes above it: those let through later than the engine's ingress delay before the
        snapshot was published. Older ones are forgotten (a second at most)."""
        forwards, since = self._forwards, max(snap.published_s - snap.ingress_s, now - 1.0)
        while forwards and forwards[0][0] <= since:  # in the order they were let through
            forwards.popleft()
        same = sum(share_s for _, p, share_s in forwards if p == priority)
        above = sum(share_s for _, p, share_s in forwards if p < priority)
        return same, above

    def check(self, kind: str, msg: Any, deadline: float | None, client: str) -> Exception | None:
        """The refusal to answer with, or None: forward it to the engine. kind: "score" or "beam"."""
        try:
            snap = self.read()
        except SnapshotBusy:
            return None  # the engine's own admission decides
        hints = hints_of(snap)
        if snap.state != STATE_SERVING:
            return NotServing("draining" if snap.state == STATE_DRAINING else "loading", hints.clamp(hints.unavailable_s))
        priority = lane_of(msg.priority)
        dims = message_dims(kind, msg, snap, max(snap.max_token_bytes, 1)) if priority else None
        if dims is None:
            return None  # the engine names the field
        now = self.clock()
        outlook = snapshot_outlook(snap, priority, dims, deadline, client, now, self.in_transit_s(snap, priority, now))
        verdict = decide(outlook)
        if verdict.reason is not None:
            return self.retries.refusal(verdict, outlook, hints)
        self._forwards.append((now, priority, outlook.work_s))
        return None

    def backlog_hint_s(self) -> float:
        """The retry hint of a request refused before the gate (too many RPCs at once at this
        front): the time to work off what the engine has queued and in flight."""
        try:
            snap = self.read()
        except SnapshotBusy:
            hints = hints_of(Snapshot())
            return hints.clamp(hints.unavailable_s)
        queued = sum(lane.work_s for lane in snap.lanes)
        return hints_of(snap).clamp((snap.inflight_s + queued) / max(snap.parallelism, 1e-9))


__all__ = ["FrontGate", "refusal_reason", "snapshot_outlook"]
