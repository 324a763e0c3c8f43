"""What the engine shares with its front processes (`slmrank serve --fronts N`), and the fronts' gate.

A front process owns the public gRPC port beside the other fronts (SO_REUSEPORT) and forwards
requests to the engine process over a Unix socket. It refuses a Score or BeamSearch itself when
the engine's own admission would refuse it, so that under overload the excess is turned away in
the fronts, in parallel, without queueing behind the engine's event loop (where every answered
request's host work runs). The engine stays authoritative: what a front lets through is admitted
or refused by the engine as before; a front only refuses what the engine would refuse now.

Shared state: one small file in shared memory (`SharedState`), written by the engine's event loop
whenever admission changes (coalesced to once a loop iteration) and read by the fronts under a
sequence lock. It holds what admission's checks need: per priority lane its queued work, its
length and cap, the wait stretch and the work queued in higher lanes, samples of its fair-queuing
order (virtual start tag -> work queued up to it) and the virtual finish of the clients with the
most queued; the executor's remaining in-flight work, parallelism and calibration; the service
time of the request shapes seen lately (a shape's key is computed from the message by both sides
with `message_dims`); the serving limits. Each front has a slot of counters there too (forwarded,
refused by reason, its last arrival), which the engine reads for its metrics and its drain.

The gate (`FrontGate.check`) is admission's check evaluated on that snapshot with every unknown
taken at its least: a shape not seen lately counts no service time of its own, a client not among
those published starts at the lane's virtual time, the in-flight work decays at the fastest rate
it could. So a refusal at a front is one the engine would make too, and anything doubtful goes to
the engine. This module imports no torch (fronts start in well under a second).
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import random
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

# A text of n characters is at least n / (TEXT_SLACK x max_token_bytes) tokens: a character is at
# least one UTF-8 byte, and normalization (NFC) shrinks a text to no fewer than 1/1.5 of its
# characters' bytes (u + two marks -> one 2-byte character); 2 leaves room for other normalizers.
TEXT_SLACK = 2

MAX_FRONTS = 64
NUM_LANES = 3  # Priority ONLINE, NORMAL, BACKGROUND (1..3)
NUM_POINTS = 32  # (tag, cumulative work) samples of a lane's fair-queuing order
NUM_CLIENTS = 16  # clients with the latest virtual finish, per lane
NUM_SHAPES = 32  # request shapes with their service time, most recent

STATE_LOADING, STATE_SERVING, STATE_DRAINING = 0, 1, 2
# proto priority -> lane (PRIORITY_UNSPECIFIED is NORMAL), as the codec maps it
PROTO_LANE = {0: 2, 1: 1, 2: 2, 3: 3}

_SEQ = struct.Struct("<Q")
# published_s, state, measured, inflight_s, inflight_batches, parallelism, calibration, safety_margin,
# response_margin_s (the configured one), response_s (with the loop's lag), min/max retry, unavailable retry,
# max_lane_work_s; the ingress delay (a forwarded request's wait from a front to the engine's handler),
# when it was measured, the most of it fronts let build up; limits: max_samples, max_score_tokens,
# max_beam_width, max_new_tokens, max_prompt_tokens, max_token_bytes
_GLOBAL = struct.Struct("<dqq" + "d" * 14 + "6q")
# work_s, length, max_queue, stretch, higher_work_s, vtime, num_points, num_clients, point tags, point
# cumulative work, client keys, client finish
_LANE = struct.Struct(f"<dqqdddqq{NUM_POINTS}d{NUM_POINTS}d{NUM_CLIENTS}q{NUM_CLIENTS}d")
# num_shapes, keys, own_s, share_s
_SHAPES = struct.Struct(f"<q{NUM_SHAPES}q{NUM_SHAPES}d{NUM_SHAPES}d")
_BODY_AT = _SEQ.size
_LANES_AT = _BODY_AT + _GLOBAL.size
_SHAPES_AT = _LANES_AT + NUM_LANES * _LANE.size
_BODY_END = _SHAPES_AT + _SHAPES.size
# a front's slot: pid, ready, forwarded, refused (deadline, queue_full, unavailable, impossible, backlog), last arrival
_SLOT = struct.Struct("<8qd")
_SLOTS_AT = 16384
SIZE = _SLOTS_AT + MAX_FRONTS * _SLOT.size
assert _BODY_END <= _SLOTS_AT
SLOT_FIELDS = ("pid", "ready", "forwarded", "refused_deadline", "refused_queue_full", "refused_unavailable",
               "refused_impossible", "refused_backlog")
_ARRIVAL_AT = 8 * len(SLOT_FIELDS)


SENT_KEY = "x-slmrank-front-sent"  # metadata: time.monotonic() when a front forwarded the request


def client_id(metadata: Any, peer: str, key: str) -> str:
    """Whose request it is, for fair shares: the `key` metadata value (at most 128 characters), else
    the peer's host (its port changes with every connection)."""
    for k, v in metadata or ():
        if k == key and isinstance(v, str) and v:
            return v[:128]
    if peer.startswith(("ipv4:", "ipv6:")):  # "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234", "unix:/run/x.sock"
        return peer.rsplit(":", 1)[0]
    return peer


@functools.lru_cache(maxsize=4096)  # per request at a front, per publish at the engine
def client_key(client: str) -> int:
    """A client id as a signed 64-bit key, the same in every process (str hashes are salted)."""
    return int.from_bytes(hashlib.blake2b(client.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little", signed=True)


def shape_key(dims: tuple) -> int:
    """A request shape's key: tuples of ints hash the same in every process of one Python."""
    return hash(dims)


def message_dims(kind: str, msg: Any, limits: Any, max_token_bytes: int) -> tuple | None:
    """The dimensions of the smallest request the message can become (ids segments at their
    length, a text at the fewest tokens it can become): ("beam", prompt, beam_width, new_tokens)
    or ("score", prefix, (sample lengths...)); None when the message is outside the limits
    (decoding names the field). `limits` has the ServingLimits fields."""
    def fewest(seg: Any) -> int:
        if seg.text:
            return -(-len(seg.text) // (TEXT_SLACK * max_token_bytes))
        return len(seg.ids)

    if kind == "beam":
        if not msg.HasField("prompt") or not (1 <= msg.beam_width <= limits.max_beam_width) \
                or not (1 <= msg.new_tokens <= limits.max_new_tokens):
            return None
        n = fewest(msg.prompt)
        if not 1 <= n <= limits.max_prompt_tokens:
            return None
        return (1, n, msg.beam_width, msg.new_tokens)
    if not 1 <= len(msg.samples) <= limits.max_samples:
        return None
    samples = tuple(max(fewest(s), 1) for s in msg.samples)
    prefix = fewest(msg.prefix) if msg.HasField("prefix") else 0
    if prefix + sum(samples) > limits.max_score_tokens:
        return None
    return (0, prefix, samples)


def request_dims(request: Any) -> tuple:
    """message_dims of an engine request (ScoreRequest / BeamRequest, by duck typing)."""
    if hasattr(request, "prompt_ids"):
        return (1, len(request.prompt_ids), request.beam_width, request.new_tokens)
    return (0, len(request.prefix_ids), tuple(len(s) for s in request.samples))


@dataclass(frozen=True)
class Limits:
    max_samples: int
    max_score_tokens: int
    max_beam_width: int
    max_new_tokens: int
    max_prompt_tokens: int


@dataclass
class LaneView:
    work_s: float = 0.0
    length: int = 0
    max_queue: int = 1
    stretch: float = 1.0
    higher_work_s: float = 0.0
    vtime: float = 0.0
    points: tuple[tuple[float, float], ...] = ()  # (tag, work queued at tags <= it), by tag
    clients: dict[int, float] = field(default_factory=dict)  # client key -> virtual finish


@dataclass
class Snapshot:
    published_s: float = 0.0
    state: int = STATE_LOADING
    measured: bool = False
    inflight_s: float = 0.0
    inflight_batches: int = 0
    parallelism: float = 1.0
    calibration: float = 1.0
    safety_margin: float = 0.1
    response_margin_s: float = 0.002
    response_s: float = 0.002
    min_retry_s: float = 0.005
    max_retry_s: float = 2.0
    unavailable_retry_s: float = 0.5
    max_lane_work_s: float = 30.0
    ingress_s: float = 0.0  # the latest forwarded request's wait from its front to the engine's handler
    ingress_at: float = 0.0  # when it was measured
    max_backlog_s: float = 0.005  # fronts refuse while the engine is this far behind ("backlog")
    limits: Limits | None = None
    max_token_bytes: int = 1
    lanes: tuple[LaneView, ...] = ()
    shapes: dict[int, tuple[float, float]] = field(default_factory=dict)  # shape key -> (own_s, share_s)


def ingress_delay_s(ingress_s: float, ingress_at: float, now: float) -> float:
    """The engine's ingress delay as it stands at `now`: the latest measured (ingress_s, at
    ingress_at), less the time since (nothing measured since: the backlog is being worked off)."""
    return max(ingress_s - max(now - ingress_at, 0.0), 0.0)


class SnapshotBusy(RuntimeError):
    """No consistent snapshot could be read, and none was read before."""


class SharedState:
    """The shared-memory file: the engine's snapshot (one writer: the engine's loop) and one slot
    of counters per front (each written by its front only)."""

    def __init__(self, path: str, create: bool = False) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)
            elif os.fstat(fd).st_size != SIZE:
                raise ValueError(f"{path}: not an slmrank front state file ({os.fstat(fd).st_size} bytes)")
            self.mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._body = bytearray(_BODY_END - _BODY_AT)
        self._seq = _SEQ.unpack_from(self.mm, 0)[0] if not create else 0
        self._read: Snapshot | None = None  # the last snapshot read, and its sequence number
        self._read_seq = -1

    def close(self) -> None:
        self.mm.close()

    # -- the engine's snapshot --

    def write(self, snap: Snapshot) -> None:
        body, lim = self._body, snap.limits or Limits(0, 0, 0, 0, 0)
        _GLOBAL.pack_into(body, 0, snap.published_s, snap.state, int(snap.measured), snap.inflight_s,
                          snap.inflight_batches, snap.parallelism, snap.calibration, snap.safety_margin,
                          snap.response_margin_s, snap.response_s, snap.min_retry_s, snap.max_retry_s,
                          snap.unavailable_retry_s, snap.max_lane_work_s, snap.ingress_s, snap.ingress_at,
                          snap.max_backlog_s, lim.max_samples, lim.max_score_tokens,
                          lim.max_beam_width, lim.max_new_tokens, lim.max_prompt_tokens, snap.max_token_bytes)
        for i in range(NUM_LANES):
            lane = snap.lanes[i] if i < len(snap.lanes) else LaneView()
            points = list(lane.points[:NUM_POINTS])
            clients = list(lane.clients.items())[:NUM_CLIENTS]
            pad_p, pad_c = NUM_POINTS - len(points), NUM_CLIENTS - len(clients)
            _LANE.pack_into(body, _LANES_AT - _BODY_AT + i * _LANE.size, lane.work_s, lane.length, lane.max_queue,
                            lane.stretch, lane.higher_work_s, lane.vtime, len(points), len(clients),
                            *[t for t, _ in points], *[0.0] * pad_p, *[w for _, w in points], *[0.0] * pad_p,
                            *[k for k, _ in clients], *[0] * pad_c, *[f for _, f in clients], *[0.0] * pad_c)
        shapes = list(snap.shapes.items())[-NUM_SHAPES:]
        pad = NUM_SHAPES - len(shapes)
        _SHAPES.pack_into(body, _SHAPES_AT - _BODY_AT, len(shapes), *[k for k, _ in shapes], *[0] * pad,
                          *[v[0] for _, v in shapes], *[0.0] * pad, *[v[1] for _, v in shapes], *[0.0] * pad)
        self._seq += 1  # odd: being written
        _SEQ.pack_into(self.mm, 0, self._seq)
        self.mm[_BODY_AT:_BODY_END] = body
        self._seq += 1
        _SEQ.pack_into(self.mm, 0, self._seq)

    def read(self, patience_s: float = 0.001) -> Snapshot:
        """The latest snapshot (parsed again only when the engine has published since: the caller
        must not change it). A write takes microseconds, but the engine can be descheduled in the
        middle of one: past patience_s of retrying (yielding the CPU) this returns the last
        snapshot read, one publish old; SnapshotBusy if there is none."""
        mm = self.mm
        give_up = None
        while True:
            seq = _SEQ.unpack_from(mm, 0)[0]
            if not seq & 1:
                if seq == self._read_seq and self._read is not None:
                    return self._read
                body = mm[_BODY_AT:_BODY_END]
                if _SEQ.unpack_from(mm, 0)[0] == seq:
                    self._read, self._read_seq = _parse(body), seq
                    return self._read
            now = time.monotonic()
            if give_up is None:
                give_up = now + patience_s
            elif now >= give_up:
                if self._read is not None:
                    return self._read
                raise SnapshotBusy(f"{self.path}: the engine's snapshot is being written (for {patience_s * 1e3:g} ms)")
            os.sched_yield()

    # -- the fronts' slots --

    def slot_add(self, index: int, field: str, n: int = 1) -> None:
        at = _SLOTS_AT + index * _SLOT.size + 8 * SLOT_FIELDS.index(field)
        struct.pack_into("<q", self.mm, at, struct.unpack_from("<q", self.mm, at)[0] + n)

    def slot_set(self, index: int, field: str, value: int) -> None:
        struct.pack_into("<q", self.mm, _SLOTS_AT + index * _SLOT.size + 8 * SLOT_FIELDS.index(field), value)

    def slot_arrival(self, index: int, when: float) -> None:
        struct.pack_into("<d", self.mm, _SLOTS_AT + index * _SLOT.size + _ARRIVAL_AT, when)

    def slot(self, index: int) -> dict[str, float]:
        values = _SLOT.unpack_from(self.mm, _SLOTS_AT + index * _SLOT.size)
        return {**dict(zip(SLOT_FIELDS, values)), "last_arrival_s": values[len(SLOT_FIELDS)]}

    def clear_slot(self, index: int) -> None:
        """A front (re)starting in this slot: its counters so far are kept, its pid and readiness reset."""
        self.slot_set(index, "pid", 0)
        self.slot_set(index, "ready", 0)


def _parse(body: bytes) -> Snapshot:
    g = _GLOBAL.unpack_from(body, 0)
    snap = Snapshot(published_s=g[0], state=g[1], measured=bool(g[2]), inflight_s=g[3], inflight_batches=g[4],
                    parallelism=g[5], calibration=g[6], safety_margin=g[7], response_margin_s=g[8],
                    response_s=g[9], min_retry_s=g[10], max_retry_s=g[11], unavailable_retry_s=g[12],
                    max_lane_work_s=g[13], ingress_s=g[14], ingress_at=g[15], max_backlog_s=g[16],
                    limits=Limits(*g[17:22]), max_token_bytes=g[22])
    lanes = []
    for i in range(NUM_LANES):
        v = _LANE.unpack_from(body, _LANES_AT - _BODY_AT + i * _LANE.size)
        np_, nc = v[6], v[7]
        at = 8
        tags, cum = v[at:at + np_], v[at + NUM_POINTS:at + NUM_POINTS + np_]
        at += 2 * NUM_POINTS
        keys, finish = v[at:at + nc], v[at + NUM_CLIENTS:at + NUM_CLIENTS + nc]
        lanes.append(LaneView(work_s=v[0], length=v[1], max_queue=v[2], stretch=v[3], higher_work_s=v[4],
                              vtime=v[5], points=tuple(zip(tags, cum)), clients=dict(zip(keys, finish))))
    snap.lanes = tuple(lanes)
    s = _SHAPES.unpack_from(body, _SHAPES_AT - _BODY_AT)
    n = s[0]
    snap.shapes = {k: (own, share) for k, own, share in
                   zip(s[1:1 + n], s[1 + NUM_SHAPES:1 + NUM_SHAPES + n], s[1 + 2 * NUM_SHAPES:1 + 2 * NUM_SHAPES + n])}
    return snap


# ---- the gate ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Refusal:
    """A front's refusal: reason "deadline" / "queue_full" / "draining" / "loading" (UNAVAILABLE with
    a retry hint; as the engine would refuse), "backlog" (UNAVAILABLE with a hint: the engine's
    event loop is behind with what the fronts forwarded) or "impossible" (DEADLINE_EXCEEDED: no
    retry can meet the deadline)."""

    reason: str
    retry_after_s: float
    detail: str


class FrontGate:
    """Admission's refusals, evaluated at a front on the engine's snapshot (module docstring)."""

    def __init__(self, read: Callable[[], Snapshot], num_fronts: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.read, self.num_fronts, self.clock = read, max(num_fronts, 1), clock
        self._next_retry = [-math.inf] * (NUM_LANES + 1)
        self._jitter = random.Random()

    def check(self, kind: str, msg: Any, deadline: float | None, client: str) -> Refusal | None:
        """None: forward it to the engine. kind: "score" or "beam"."""
        try:
            snap = self.read()
        except SnapshotBusy:
            return None  # the engine's own admission decides
        now = self.clock()
        if snap.state != STATE_SERVING:
            what = "draining; send to another replica" if snap.state == STATE_DRAINING else "still loading; retry shortly"
            reason = "draining" if snap.state == STATE_DRAINING else "loading"
            return Refusal(reason, self._hint(snap, snap.unavailable_retry_s), f"the server is {what}")
        priority = PROTO_LANE.get(msg.priority)
        dims = message_dims(kind, msg, snap.limits, max(snap.max_token_bytes, 1)) if priority else None
        if dims is None:
            return None  # the engine names the field
        own_s, share_s = snap.shapes.get(shape_key(dims), (0.0, 0.0))
        if deadline is not None:
            left_s = deadline - now
            if left_s <= 0:
                return Refusal("impossible", 0.0, f"the deadline passed {-left_s:.4f} s before the request was admitted")
            need_s = own_s * (1 + snap.safety_margin) + snap.response_margin_s
            if snap.measured and own_s > 0 and left_s < need_s:
                return Refusal("impossible", 0.0, f"the deadline in {left_s:.4f} s is shorter than this request's "
                               f"own service time ({need_s:.4f} s on an idle server); no retry can meet it")
        lane = snap.lanes[priority - 1]
        par = max(snap.parallelism, 1e-9)
        if lane.length >= lane.max_queue:
            return Refusal("queue_full", self._appointment(snap, priority, lane.work_s / lane.length / par, share_s, now),
                           f"lane {priority} holds {lane.length} requests")
        if lane.length and lane.work_s > snap.max_lane_work_s:
            return Refusal("queue_full", self._appointment(snap, priority, (lane.work_s - snap.max_lane_work_s) / par,
                                                           share_s, now),
                           f"lane {priority} holds {lane.work_s:.3f} s of work (at most {snap.max_lane_work_s:g} s)")
        # the engine's event loop behind: forwarded requests wait in its gRPC queue before admission
        # sees them (its lanes look short while the loop drowns). Past max_backlog_s the fronts shed
        # the excess themselves, so that the engine's loop keeps up with what it is sent
        ingress_s = ingress_delay_s(snap.ingress_s, snap.ingress_at, now)
        if ingress_s > snap.max_backlog_s:
            return Refusal("backlog", self._appointment(snap, priority, ingress_s, share_s, now),
                           f"the engine is {ingress_s * 1e3:.1f} ms behind with the requests forwarded to it "
                           f"(at most {snap.max_backlog_s * 1e3:g} ms)")
        if deadline is None:
            return None
        tag = max(lane.vtime, lane.clients.get(client_key(client), 0.0))
        ahead_s = 0.0
        for t, cum in lane.points:  # the work queued at tags <= this client's start, at least (the
            # last point is the last ticket: past it, the whole lane)
            if t > tag:
                break
            ahead_s = cum
        inflight_s = max(snap.inflight_s - snap.inflight_batches * max(now - snap.published_s, 0.0), 0.0)
        wait_s = (inflight_s + lane.higher_work_s + ahead_s) / par * lane.stretch
        predicted = ((wait_s + own_s) * (1 + snap.safety_margin) + snap.response_s) * snap.calibration + ingress_s
        finish = now + predicted
        if finish <= deadline:
            return None
        return Refusal("deadline", self._appointment(snap, priority, max(finish - deadline, own_s), share_s, now),
                       f"predicted completion in {predicted:.4f} s misses the deadline in {deadline - now:.4f} s")

    def backlog_hint_s(self) -> float:
        """The retry hint of a request refused before the gate (too many RPCs at once at this
        front): the time to work off what the engine has queued and in flight."""
        try:
            snap = self.read()
        except SnapshotBusy:
            snap = Snapshot()
            return self._hint(snap, snap.unavailable_retry_s)
        queued = sum(lane.work_s for lane in snap.lanes)
        return self._hint(snap, (snap.inflight_s + queued) / max(snap.parallelism, 1e-9))

    def _hint(self, snap: Snapshot, seconds: float) -> float:
        return min(max(seconds, snap.min_retry_s), snap.max_retry_s)

    def _appointment(self, snap: Snapshot, lane: int, wait_s: float, share_s: float, now: float) -> float:
        """As admission spreads the retries of a lane: one share of the executor apart (this
        front's 1/num_fronts of the arrivals: num_fronts shares apart), randomly past the cap."""
        cap = snap.max_retry_s
        at = max(now + wait_s, self._next_retry[lane])
        self._next_retry[lane] = min(at + share_s * self.num_fronts / max(snap.parallelism, 1e-9), now + cap)
        if at - now >= cap:
            return cap * (1 - 0.25 * self._jitter.random())
        return self._hint(snap, at - now)


__all__ = ["SENT_KEY", "FrontGate", "LaneView", "Limits", "Refusal", "SharedState", "Snapshot", "client_id", "client_key",
           "message_dims",
           "request_dims", "shape_key"]
