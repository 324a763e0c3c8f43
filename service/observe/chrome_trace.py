"""A Chrome / Perfetto trace file of the kept requests (chrome://tracing, ui.perfetto.dev).

Three processes: "requests" (each request's whole tree: its stages, its batch's executor phases and
DAG nodes), "executor" (each batch once, on the host: executor queue, H2D, launch, eager nodes,
D2H) and "GPU" (each replayed graph's nodes by device time). Complete events ("ph": "X", ts and dur
in µs from the first event kept); within a process, requests or batches that overlap in time get
separate rows (tids), so every row nests properly. The newest requests are kept up to
`max_events`; older ones are dropped whole.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .records import WALL_OFFSET_NS, SpanRecord

PIDS = {"request": 1, "executor": 2, "gpu": 3}
PROCESS_NAMES = {1: "requests", 2: "executor (host)", 3: "GPU (device time)"}
ROW_NAMES = {1: "request", 2: "batch", 3: "graph"}


@dataclass(eq=False)
class _Group:
    """One request's events, or one batch's on one lane: they share a row (tid), given when the
    group is added and kept while it is, so a group renders the same text every time; that text
    is cached on it (rendering 20,000 events took 200-350 ms of the GIL on a 2-core machine; a
    refresh now renders only the groups added since the last one)."""

    pid: int
    key: tuple[str, int]  # ("request", n) or (lane, batch id)
    start_ns: int
    end_ns: int
    events: list[tuple[str, str, int, int, dict[str, Any]]]  # name, cat, start_ns, end_ns, args
    tid: int = 0
    text: tuple[int, str] | None = None  # (origin_ns it was rendered against, its events' JSON)

    def is_rendered(self, origin_ns: int) -> bool:
        return self.text is not None and self.text[0] == origin_ns

    def render(self, origin_ns: int) -> str:
        if self.is_rendered(origin_ns):
            return self.text[1]  # type: ignore[index]
        events = []
        for name, cat, s, e, args in self.events:
            # ends rounded like starts, so a child never pokes out of its parent
            ts, end_us = round((s - origin_ns) / 1e3, 3), round((e - origin_ns) / 1e3, 3)
            events.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(end_us - ts, 3),
                           "pid": self.pid, "tid": self.tid,
                           "args": {k: v for k, v in args.items() if v is not None}})
        text = json.dumps(events, separators=(",", ":"))[1:-1]
        self.text = (origin_ns, text)
        return text


@dataclass(frozen=True)
class TraceSnapshot:
    """A ChromeTraceWriter's groups at one moment, rendered to the Chrome trace format (ts in µs
    from the writer's origin)."""

    groups: tuple[_Group, ...]
    num_added: int
    origin_ns: int = 0

    def to_json(self) -> dict[str, Any]:
        return json.loads(self.dumps())

    def dumps(self, pause: Callable[[], None] | None = None, chunk: int = 64) -> str:
        """The trace's JSON text. Groups rendered before are reused; with pause, pause() is called
        after each `chunk` events newly rendered: the metrics thread renders while the event loop
        serves, and pause=lambda: time.sleep(0) hands the GIL over to it between chunks."""
        parts: list[str] = []
        fresh = 0
        for g in sorted(self.groups, key=lambda g: (g.start_ns, -g.end_ns)):
            if not g.is_rendered(self.origin_ns):
                fresh += len(g.events)
            parts.append(g.render(self.origin_ns))
            if pause is not None and fresh >= chunk:
                pause()
                fresh = 0
        sep = (",", ":")
        head = json.dumps(self._meta(), separators=sep)[1:-1]
        tail = json.dumps(self._tail(), separators=sep)[1:]
        return '{"traceEvents":[' + ",".join(p for p in (head, *parts) if p) + "]," + tail

    def _meta(self) -> list[dict[str, Any]]:
        rows = {pid: max((g.tid for g in self.groups if g.pid == pid), default=0) for pid in PROCESS_NAMES}
        meta = []
        for pid, name in PROCESS_NAMES.items():
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": row,
                      "args": {"name": f"{ROW_NAMES[pid]} row {row}"}} for row in range(1, rows[pid] + 1)]
        return meta

    def _tail(self) -> dict[str, Any]:
        num_requests = sum(g.pid == PIDS["request"] for g in self.groups)
        return {"displayTimeUnit": "ms",
                "otherData": {"clock": "monotonic", "origin_wall_ns": self.origin_ns + WALL_OFFSET_NS,
                              "requests": num_requests, "requests_dropped": self.num_added - num_requests}}


class ChromeTraceWriter:
    def __init__(self, max_events: int = 20_000) -> None:
        if max_events < 1:
            raise ValueError(f"max_events: must be >= 1, got {max_events!r}")
        self.max_events = max_events
        self._groups: deque[_Group] = deque()
        self._keys: set[tuple[str, int]] = set()
        self._num_events = 0
        self.num_added = 0  # requests added, kept or since dropped
        self.num_dropped_groups = 0  # dropped to stay within max_events: > 0 once the trace is full
        self._origin_ns: int | None = None  # ts 0: the earliest start of any group added
        self._row_ends: dict[int, list[int]] = {}  # pid -> the end of each row's last group

    def add(self, records: list[SpanRecord]) -> None:
        """One kept request's span tree (records.build_records)."""
        n = self.num_added
        self.num_added += 1
        events = [(r.name, r.category, r.start_ns, r.end_ns,
                   {**r.attrs, "request": n, "parent": records[r.parent].name if r.parent >= 0 else None})
                  for r in records]
        self._push(_Group(PIDS["request"], ("request", n), records[0].start_ns, records[0].end_ns, events))
        for lane in ("executor", "gpu"):
            mine = [r for r in records if r.lane == lane]
            batch_id = mine[0].attrs["batch_id"] if mine else None
            if batch_id is None or (lane, batch_id) in self._keys:
                continue  # another request of the batch drew it already
            start, end = min(r.start_ns for r in mine), max(r.end_ns for r in mine)
            args = {"batch_id": batch_id, "bucket": records[0].attrs.get("bucket")}
            wrapper = (f"batch {batch_id}", "batch", start, end, args)
            self._push(_Group(PIDS[lane], (lane, batch_id), start, end,
                              [wrapper, *((r.name, r.category, r.start_ns, r.end_ns, dict(r.attrs)) for r in mine)]))

    def _push(self, group: _Group) -> None:
        if self._origin_ns is None or group.start_ns < self._origin_ns:
            self._origin_ns = group.start_ns  # earlier than every group: cached texts re-render
        # a row whose last group ended before this one starts: a row's groups never overlap
        ends = self._row_ends.setdefault(group.pid, [])
        row = next((i for i, e in enumerate(ends) if e <= group.start_ns), len(ends))
        ends[row:row + 1] = [group.end_ns]
        group.tid = row + 1
        self._groups.append(group)
        self._keys.add(group.key)
        self._num_events += len(group.events)
        while self._num_events > self.max_events and len(self._groups) > 1:
            old = self._groups.popleft()
            self._keys.discard(old.key)
            self._num_events -= len(old.events)
            self.num_dropped_groups += 1

    @property
    def num_events(self) -> int:
        return self._num_events

    def snapshot(self) -> TraceSnapshot:
        """The kept groups as they are now: a copy of references (groups are never changed once
        added), cheap on the thread that owns the writer; rendering it can happen anywhere."""
        return TraceSnapshot(tuple(self._groups), self.num_added, self._origin_ns or 0)

    def to_json(self) -> dict[str, Any]:
        return self.snapshot().to_json()

    def dumps(self) -> str:
        return self.snapshot().dumps()

    def write(self, path: str | Path) -> int:
        """Writes the file (atomically: a reader never sees half of it); returns the number of events."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        snapshot = self.snapshot()  # rendered once (cached group texts), not rendered, parsed and dumped again
        tmp.write_text(snapshot.dumps(), encoding="utf-8")
        tmp.replace(path)
        return sum(len(g.events) for g in snapshot.groups)
