"""`slmrank trace FILE`: where the time went, from a Chrome trace file of the server's kept requests.

Per request kind: every stage (nested as recorded: tokenize inside decode, the executor's phases
inside execute) and every DAG node category, with mean / p50 / p99 in ms over the requests that
have it and its share of the end-to-end time summed over all requests; "unaccounted" is the part
of end to end that no top-level stage covers (handler code between stages). The last line names
the leaves that took most of the time. Reads the "requests" process only: one tree per request.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .records import node_category

NODES = "DAG nodes"


@dataclass
class _Stat:
    values_ms: list[float] = field(default_factory=list)
    offsets_ms: list[float] = field(default_factory=list)  # start within the request: the display order
    parent: str | None = None

    def add(self, ms: float, offset_ms: float) -> None:
        self.values_ms.append(ms)
        self.offsets_ms.append(offset_ms)


@dataclass
class KindBreakdown:
    kind: str
    end_to_end_ms: list[float] = field(default_factory=list)
    stages: dict[str, _Stat] = field(default_factory=lambda: defaultdict(_Stat))
    nodes: dict[str, _Stat] = field(default_factory=lambda: defaultdict(_Stat))  # by node category
    statuses: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def total_ms(self) -> float:
        return sum(self.end_to_end_ms)

    def share(self, values_ms: list[float]) -> float:
        return sum(values_ms) / self.total_ms if self.total_ms > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)] if ordered else math.nan


def load_events(path: str | Path) -> list[dict[str, Any]]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return events


def breakdown(events: list[dict[str, Any]]) -> dict[str, KindBreakdown]:
    """Per request kind, from the events of the "requests" process (args.request groups them)."""
    by_request: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "request" in e.get("args", {}):
            by_request[e["args"]["request"]].append(e)
    kinds: dict[str, KindBreakdown] = {}
    for evs in by_request.values():
        root = next((e for e in evs if e.get("cat") == "request"), None)
        if root is None:
            continue
        k = kinds.setdefault(root["name"], KindBreakdown(root["name"]))
        k.end_to_end_ms.append(root["dur"] / 1e3)
        k.statuses[root["args"].get("status", "?")] += 1
        stage_ms: dict[str, list[float]] = defaultdict(lambda: [0.0, math.inf])  # name -> [ms, first start]
        node_ms: dict[str, list[float]] = defaultdict(lambda: [0.0, math.inf])
        for e in evs:
            offset = (e["ts"] - root["ts"]) / 1e3
            if e.get("cat") == "stage":
                acc = stage_ms[e["name"]]
                k.stages[e["name"]].parent = e["args"].get("parent")
                acc[0] += e["args"].get("busy_ms", e["dur"] / 1e3)
            elif e.get("cat") == "node":
                acc = node_ms[e["args"].get("category") or node_category(e["name"])]
                k.stages[NODES].parent = e["args"].get("parent")
                stage_ms[NODES][0] += e["dur"] / 1e3
                stage_ms[NODES][1] = min(stage_ms[NODES][1], offset)
                acc[0] += e["dur"] / 1e3
            else:
                continue
            acc[1] = min(acc[1], offset)
        for name, (ms, offset) in stage_ms.items():
            k.stages[name].add(ms, offset)
        for name, (ms, offset) in node_ms.items():
            k.nodes[name].add(ms, offset)
        top = sum(ms for name, (ms, _) in stage_ms.items() if k.stages[name].parent == root["name"])
        k.stages["unaccounted"].parent = root["name"]
        k.stages["unaccounted"].add(max(root["dur"] / 1e3 - top, 0.0), math.inf)
    return kinds


def _row(label: str, values: list[float], share: float) -> str:
    mean = sum(values) / len(values)
    return (f"{label:<28}{len(values):>7}{mean:>10.3f}{percentile(values, 0.5):>10.3f}"
            f"{percentile(values, 0.99):>10.3f}{share:>8.1%}")


def _ordered(stats: dict[str, _Stat]) -> list[str]:
    return sorted(stats, key=lambda n: sum(stats[n].offsets_ms) / len(stats[n].offsets_ms))


def format_kind(k: KindBreakdown) -> str:
    header = f"{'':<28}{'n':>7}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'share':>8}"
    statuses = ", ".join(f"{s} {n}" for s, n in sorted(k.statuses.items()))
    lines = [f"{k.kind}: {len(k.end_to_end_ms)} requests ({statuses})", header,
             _row("end to end", k.end_to_end_ms, 1.0)]
    children: dict[str | None, list[str]] = defaultdict(list)
    for name in _ordered(k.stages):
        children[k.stages[name].parent].append(name)

    def walk(parent: str, depth: int) -> None:
        for name in children.get(parent, []):
            lines.append(_row("  " * depth + name, k.stages[name].values_ms, k.share(k.stages[name].values_ms)))
            walk(name, depth + 1)

    walk(k.kind, 1)
    if k.nodes:
        lines += ["", f"{'DAG node category':<28}{'n':>7}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'share':>8}"]
        for name in sorted(k.nodes, key=lambda n: -sum(k.nodes[n].values_ms)):
            lines.append(_row("  " + name, k.nodes[name].values_ms, k.share(k.nodes[name].values_ms)))
    lines.append("where the time went: " + where_the_time_went(k))
    return "\n".join(lines)


def where_the_time_went(k: KindBreakdown, cover: float = 0.9, most: int = 6) -> str:
    """The largest parts of the end-to-end time until `cover` of it: each stage's own time (less its
    sub-stages), node categories in place of the DAG nodes."""
    own = {name: sum(s.values_ms) for name, s in k.stages.items()}
    for name, s in k.stages.items():
        if s.parent in own:
            own[s.parent] -= sum(s.values_ms)
    if k.nodes:
        del own[NODES]
        own.update({name: sum(s.values_ms) for name, s in k.nodes.items()})
    parts, covered = [], 0.0
    for name, ms in sorted(own.items(), key=lambda kv: -kv[1])[:most]:
        share = ms / k.total_ms if k.total_ms else 0.0
        if covered >= cover or share < 0.005:
            break
        parts.append(f"{name} {share:.0%}")
        covered += share
    return ", ".join(parts) or "nothing measured"


def report(path: str | Path) -> str:
    kinds = breakdown(load_events(path))
    if not kinds:
        return f"{path}: no requests in this trace"
    return "\n\n".join(format_kind(kinds[name]) for name in sorted(kinds))
