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

The gate (gate.py) calls admission's one verdict function (service/sched/verdict.py) over that
snapshot, with every unknown taken at its least. The file's layout is generated from one table per
record (`Layout`): a field's name in the table is the Snapshot / LaneView attribute it holds.
This module imports no torch (fronts start in well under a second).
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...sched.verdict import RetryHints

MAX_FRONTS = 64
NUM_LANES = 3  # Priority ONLINE, NORMAL, BACKGROUND (1..3)
NUM_POINTS = 32  # (tag, cumulative work) samples of a lane's fair-queuing order
NUM_CLIENTS = 16  # clients with the latest virtual finish, per lane
NUM_SHAPES = 32  # request shapes with their service time, most recent

STATE_LOADING, STATE_SERVING, STATE_DRAINING = 0, 1, 2
SENT_KEY = "x-slmrank-front-sent"  # metadata: time.monotonic() when a front forwarded the request
# metadata: the caller's own deadline on time.monotonic(), as the front saw it. The forwarded call's
# gRPC timeout runs a little past it (front.py says why), so the engine takes its deadline from this
DEADLINE_KEY = "x-slmrank-front-deadline"


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



class Layout:
    """A little-endian record generated from (name, struct code[, count]) rows, packed and read by
    name: a row with a count is a fixed array (a tuple read back; shorter values are padded with 0)."""

    def __init__(self, *rows: tuple[str, str] | tuple[str, str, int]) -> None:
        self.rows = tuple((r[0], r[1], r[2] if len(r) > 2 else 0) for r in rows)
        self.names = tuple(name for name, _, _ in self.rows)
        self.struct = struct.Struct("<" + "".join(f"{n}{code}" if n else code for _, code, n in self.rows))
        self.size = self.struct.size

    def offset(self, name: str) -> int:
        at = 0
        for row, code, n in self.rows:
            if row == name:
                return at
            at += struct.calcsize("<" + code) * max(n, 1)
        raise KeyError(name)

    def pack_into(self, buf: Any, offset: int, values: Mapping[str, Any]) -> None:
        flat: list[Any] = []
        for name, _, n in self.rows:
            value = values[name]
            if n:
                items = list(value)[:n]
                flat += items
                flat += [0] * (n - len(items))
            else:
                flat.append(value)
        self.struct.pack_into(buf, offset, *flat)

    def unpack_from(self, buf: Any, offset: int) -> dict[str, Any]:
        values, out, at = self.struct.unpack_from(buf, offset), {}, 0
        for name, _, n in self.rows:
            out[name] = values[at:at + n] if n else values[at]
            at += n or 1
        return out


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
    """What the engine publishes, whole, on every change (fronts.supervisor.FrontPublisher writes
    admission's values in; the defaults are those of an engine still loading)."""

    published_s: float = 0.0
    state: int = STATE_LOADING
    measured: bool = False
    inflight_s: float = 0.0
    inflight_batches: int = 0
    parallelism: float = 1.0
    calibration: float = 1.0
    safety_margin: float = 0.0
    response_margin_s: float = 0.0  # the configured one
    response_s: float = 0.0  # ... or the engine's loop lag, whichever is larger
    min_retry_s: float = RetryHints.min_s
    max_retry_s: float = RetryHints.max_s
    unavailable_retry_s: float = RetryHints.unavailable_s
    max_lane_work_s: float = math.inf
    ingress_s: float = 0.0  # the latest forwarded request's wait from its front to the engine's handler
    ingress_at: float = 0.0  # when it was measured
    max_backlog_s: float = math.inf  # fronts refuse while the engine is this far behind ("backlog")
    deadline_margin: float = 0.0  # the share of the time left a front's prediction leaves spare
    # the serving limits (message_dims reads them from the snapshot itself)
    max_samples: int = 0
    max_score_tokens: int = 0
    max_beam_width: int = 0
    max_new_tokens: int = 0
    max_prompt_tokens: int = 0
    max_token_bytes: int = 1
    lanes: tuple[LaneView, ...] = ()
    # shape key -> (own_s, share_s, idle_s): idle_s its bucket's own measured idle time, 0.0: none
    shapes: dict[int, tuple[float, float, float]] = field(default_factory=dict)


_CODES = {float: "d", int: "q", bool: "?"}
# every scalar Snapshot field, in declaration order
_GLOBAL = Layout(*((f.name, _CODES[type(f.default)]) for f in Snapshot.__dataclass_fields__.values()
                  if type(f.default) in _CODES))
_LANE = Layout(("work_s", "d"), ("length", "q"), ("max_queue", "q"), ("stretch", "d"), ("higher_work_s", "d"),
               ("vtime", "d"), ("num_points", "q"), ("num_clients", "q"), ("point_tags", "d", NUM_POINTS),
               ("point_work", "d", NUM_POINTS), ("client_keys", "q", NUM_CLIENTS),
               ("client_finish", "d", NUM_CLIENTS))
_SHAPES = Layout(("num_shapes", "q"), ("keys", "q", NUM_SHAPES), ("own_s", "d", NUM_SHAPES),
                 ("share_s", "d", NUM_SHAPES), ("idle_s", "d", NUM_SHAPES))
# a front's slot: written by its front only (counters), read by the engine
SLOT_FIELDS = ("pid", "ready", "forwarded", "refused_deadline", "refused_queue_full", "refused_unavailable",
               "refused_impossible", "refused_backlog", "stalled_receive", "stalled_no_message", "stalled_send")
_SLOT = Layout(*((name, "q") for name in SLOT_FIELDS), ("last_arrival_s", "d"))

_SEQ = struct.Struct("<Q")  # the sequence lock: odd while the engine writes
_BODY_AT = _SEQ.size
_LANES_AT = _BODY_AT + _GLOBAL.size
_SHAPES_AT = _LANES_AT + NUM_LANES * _LANE.size
_BODY_END = _SHAPES_AT + _SHAPES.size
_SLOTS_AT = 16384
SIZE = _SLOTS_AT + MAX_FRONTS * _SLOT.size
assert _BODY_END <= _SLOTS_AT


def ingress_delay_s(ingress_s: float, ingress_at: float, now: float) -> float:
    """The engine's ingress delay as it stands at `now`: the latest measured (ingress_s, at
    ingress_at), less the time since (nothing measured since: the backlog is being worked off)."""
    return max(ingress_s - max(now - ingress_at, 0.0), 0.0)


def _lane_row(lane: LaneView) -> dict[str, Any]:
    points = lane.points[:NUM_POINTS]
    clients = list(lane.clients.items())[:NUM_CLIENTS]
    return {**vars(lane), "num_points": len(points), "num_clients": len(clients),
            "point_tags": [t for t, _ in points], "point_work": [w for _, w in points],
            "client_keys": [k for k, _ in clients], "client_finish": [f for _, f in clients]}


def _lane_of(row: dict[str, Any]) -> LaneView:
    np_, nc = row["num_points"], row["num_clients"]
    return LaneView(work_s=row["work_s"], length=row["length"], max_queue=row["max_queue"], stretch=row["stretch"],
                    higher_work_s=row["higher_work_s"], vtime=row["vtime"],
                    points=tuple(zip(row["point_tags"][:np_], row["point_work"][:np_])),
                    clients=dict(zip(row["client_keys"][:nc], row["client_finish"][:nc])))


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
        body = self._body
        _GLOBAL.pack_into(body, 0, vars(snap))
        for i in range(NUM_LANES):
            lane = snap.lanes[i] if i < len(snap.lanes) else LaneView()
            _LANE.pack_into(body, _LANES_AT - _BODY_AT + i * _LANE.size, _lane_row(lane))
        shapes = list(snap.shapes.items())[-NUM_SHAPES:]
        _SHAPES.pack_into(body, _SHAPES_AT - _BODY_AT, {
            "num_shapes": len(shapes), "keys": [k for k, _ in shapes], "own_s": [v[0] for _, v in shapes],
            "share_s": [v[1] for _, v in shapes], "idle_s": [v[2] for _, v in shapes]})
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

    def _slot_at(self, index: int, name: str) -> int:
        return _SLOTS_AT + index * _SLOT.size + _SLOT.offset(name)

    def slot_add(self, index: int, name: str, n: int = 1) -> None:
        at = self._slot_at(index, name)
        struct.pack_into("<q", self.mm, at, struct.unpack_from("<q", self.mm, at)[0] + n)

    def slot_set(self, index: int, name: str, value: int) -> None:
        struct.pack_into("<q", self.mm, self._slot_at(index, name), value)

    def slot_arrival(self, index: int, when: float) -> None:
        struct.pack_into("<d", self.mm, self._slot_at(index, "last_arrival_s"), when)

    def slot(self, index: int) -> dict[str, float]:
        return _SLOT.unpack_from(self.mm, _SLOTS_AT + index * _SLOT.size)

    def clear_slot(self, index: int) -> None:
        """A front (re)starting in this slot: its counters so far are kept, its pid and readiness reset."""
        self.slot_set(index, "pid", 0)
        self.slot_set(index, "ready", 0)


def _parse(body: bytes) -> Snapshot:
    g = _GLOBAL.unpack_from(body, 0)
    g["measured"] = bool(g["measured"])
    snap = Snapshot(**g)
    snap.lanes = tuple(_lane_of(_LANE.unpack_from(body, _LANES_AT - _BODY_AT + i * _LANE.size))
                       for i in range(NUM_LANES))
    sh = _SHAPES.unpack_from(body, _SHAPES_AT - _BODY_AT)
    n = sh["num_shapes"]
    snap.shapes = {k: (own, share, idle) for k, own, share, idle in zip(sh["keys"][:n], sh["own_s"][:n],
                                                                      sh["share_s"][:n], sh["idle_s"][:n])}
    return snap


__all__ = ["DEADLINE_KEY", "MAX_FRONTS", "NUM_CLIENTS", "NUM_LANES", "NUM_POINTS", "NUM_SHAPES", "SENT_KEY", "SIZE",
           "SLOT_FIELDS", "STATE_DRAINING", "STATE_LOADING", "STATE_SERVING", "LaneView", "Layout", "SharedState", "Snapshot",
           "SnapshotBusy", "client_id", "client_key", "ingress_delay_s"]
