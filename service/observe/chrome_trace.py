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
from typing import Any, Callable, Iterator

from .records import WALL_OFFSET_NS, SpanRecord

PIDS = {"request": 1, "executor": 2, "gpu": 3}
PROCESS_NAMES = {1: "requests", 2: "executor (host)", 3: "GPU (device time)"}
ROW_NAMES = {1: "request", 2: "batch", 3: "graph"}


@dataclass
class _Group:
    """One request's events, or one batch's on one lane: they share a row."""

    pid: int
    key: tuple[str, int]  # ("request", n) or (lane, batch id)
    start_ns: int
    end_ns: int
    events: list[tuple[str, str, int, int, dict[str, Any]]]  # name, cat, start_ns, end_ns, args


@dataclass(frozen=True)
class TraceSnapshot:
    """A ChromeTraceWriter's groups at one moment, rendered to the Chrome trace format."""

    groups: tuple[_Group, ...]
    num_added: int

    def to_json(self) -> dict[str, Any]:
        events = list(self._events())
        return {"traceEvents": self._meta() + events, **self._tail()}

    def dumps(self, pause: Callable[[], None] | None = None, chunk: int = 256) -> str:
        """The JSON of to_json(). With pause, rendered `chunk` events at a time and pause() called
        between chunks: the metrics thread renders while the event loop serves, and one C call of
        json.dumps over 20,000 events holds the GIL for tens of ms (the loop waits for it);
        pause=lambda: time.sleep(0) hands the GIL over after each chunk instead."""
        sep = (",", ":")
        parts: list[str] = []
        buf: list[dict[str, Any]] = []
        for event in self._events():
            buf.append(event)
            if len(buf) >= chunk:
                parts.append(json.dumps(buf, separators=sep)[1:-1])
                buf.clear()
                if pause is not None:
                    pause()
        if buf:
            parts.append(json.dumps(buf, separators=sep)[1:-1])
        head = json.dumps(self._meta(), separators=sep)[1:-1]
        tail = json.dumps(self._tail(), separators=sep)[1:]
        return '{"traceEvents":[' + ",".join(p for p in (head, *parts) if p) + "]," + tail

    def _sorted(self) -> list[_Group]:
        return sorted(self.groups, key=lambda g: (g.start_ns, -g.end_ns))

    def _origin(self) -> int:
        return min(((g.start_ns, -g.end_ns) for g in self.groups), default=(0, 0))[0]

    def _rows(self) -> dict[int, list[int]]:
        """pid -> the end_ns of each row's last group: the layout, in the order groups are drawn."""
        rows: dict[int, list[int]] = {pid: [] for pid in PROCESS_NAMES}
        for g in self._sorted():
            ends = rows[g.pid]
            row = next((i for i, e in enumerate(ends) if e <= g.start_ns), len(ends))
            ends[row:row + 1] = [g.end_ns]
        return rows

    def _events(self) -> Iterator[dict[str, Any]]:
        origin = self._origin()
        rows: dict[int, list[int]] = {pid: [] for pid in PROCESS_NAMES}  # as _rows(), while drawing
        for g in self._sorted():
            ends = rows[g.pid]
            row = next((i for i, e in enumerate(ends) if e <= g.start_ns), len(ends))
            ends[row:row + 1] = [g.end_ns]
            for name, cat, s, e, args in g.events:
                # ends rounded like starts, so a child never pokes out of its parent
                ts, end_us = round((s - origin) / 1e3, 3), round((e - origin) / 1e3, 3)
                yield {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(end_us - ts, 3),
                       "pid": g.pid, "tid": row + 1, "args": {k: v for k, v in args.items() if v is not None}}

    def _meta(self) -> list[dict[str, Any]]:
        rows = self._rows()
        meta = []
        for pid, name in PROCESS_NAMES.items():
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
            meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
            meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": row + 1,
                      "args": {"name": f"{ROW_NAMES[pid]} row {row + 1}"}} for row in range(len(rows[pid]))]
        return meta

    def _tail(self) -> dict[str, Any]:
        num_requests = sum(g.pid == PIDS["request"] for g in self.groups)
        return {"displayTimeUnit": "ms",
                "otherData": {"clock": "monotonic", "origin_wall_ns": self._origin() + WALL_OFFSET_NS,
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
        self._groups.append(group)
        self._keys.add(group.key)
        self._num_events += len(group.events)
        while self._num_events > self.max_events and len(self._groups) > 1:
            old = self._groups.popleft()
            self._keys.discard(old.key)
            self._num_events -= len(old.events)

    @property
    def num_events(self) -> int:
        return self._num_events

    def snapshot(self) -> TraceSnapshot:
        """The kept groups as they are now: a copy of references (groups are never changed once
        added), cheap on the thread that owns the writer; rendering it can happen anywhere."""
        return TraceSnapshot(tuple(self._groups), self.num_added)

    def to_json(self) -> dict[str, Any]:
        return self.snapshot().to_json()

    def dumps(self) -> str:
        return self.snapshot().dumps()

    def write(self, path: str | Path) -> int:
        """Writes the file (atomically: a reader never sees half of it); returns the number of events."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        data = self.to_json()
        tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
        tmp.replace(path)
        return sum(e["ph"] == "X" for e in data["traceEvents"])
