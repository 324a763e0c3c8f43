"""The server's own view of a measured window: its /metrics scraped at the window's start and end,
and what grew between the two (stage means, requests per batch, the event loop's CPU)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from typing import Any

SAMPLE = re.compile(r'^(slmrank_request_(?:stage|latency)_seconds_(?:sum|count)|slmrank_node_batches_total|'
                    r'slmrank_event_loop_cpu_seconds_total|slmrank_requests_total|slmrank_dropped_total|slmrank_dropped_in_flight_total|'
                    r'slmrank_answered_late_total|slmrank_refused_total|slmrank_admission_calibration|'
                    r'slmrank_admission_parallelism|slmrank_admission_lane_error|slmrank_front_ingress_delay_seconds|'
                    r'slmrank_queue_depth|slmrank_batches_total|slmrank_heavy_batches_total)'
                    r'(?:\{([^}]*)\})? (\S+)$')


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(series, labels) -> value for the series SAMPLE names (the stage histograms' sums and
    counts, the RPC, refusal and batch counters, admission's gauges)."""
    out: dict[tuple[str, str], float] = {}
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if m := SAMPLE.match(line):
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def window_delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Each scraped series' growth between two scrapes (a series new in `after` grew from 0)."""
    return {k: after[k] - before.get(k, 0.0) for k in after}


def add_deltas(total: dict[tuple[str, str], float], delta: dict[tuple[str, str], float]) -> None:
    """Adds one window's growth (window_delta) into `total`: several windows of one condition as one."""
    for key, value in delta.items():
        total[key] = total.get(key, 0.0) + value


def _stage_means(delta: dict[tuple[str, str], float]) -> Iterator[tuple[str, str, float]]:
    """(kind, stage, mean ms) of each stage histogram series that grew in the window."""
    for (series, labels), total in delta.items():
        if series != "slmrank_request_stage_seconds_sum":
            continue
        kind, stage = re.search(r'kind="([^"]*)"', labels), re.search(r'stage="([^"]*)"', labels)
        count = delta.get(("slmrank_request_stage_seconds_count", labels), 0.0)
        if count and stage:
            yield kind.group(1) if kind else "", stage.group(1), round(total / count * 1e3, 3)


def stage_means_by_kind(delta: dict[tuple[str, str], float]) -> dict[str, dict[str, float]]:
    """Mean ms of each stage of the requests finished in a window, by request kind (the stage
    histograms' kind label: Score, BeamSearch, ...), from the growth of their sums and counts."""
    out: dict[str, dict[str, float]] = {}
    for kind, stage, ms in _stage_means(delta):
        out.setdefault(kind, {})[stage] = ms
    return out


def server_breakdown(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                     requests: int, window_s: float) -> dict[str, Any]:
    """Mean ms of each stage of the requests finished in the window (the server's histograms), the
    batches run (mean whole requests per batch = requests / batches), and the event loop's CPU:
    ms per request and its busy share of the window (near 1: the loop, not the GPU, is the limit);
    the mean of the server's own request latency (its first byte parsed to its response serialized:
    what the client measures beyond it is gRPC's transport both ways and the client)."""
    d = window_delta(before, after)
    stages = {stage: ms for _, stage, ms in _stage_means(d)}
    latency_s = latency_n = 0.0
    for (series, labels), total in d.items():
        if series == "slmrank_request_latency_seconds_sum":
            latency_s, latency_n = latency_s + total, latency_n + d.get(("slmrank_request_latency_seconds_count", labels), 0.0)
    batches = sum(v for (series, _), v in d.items() if series == "slmrank_node_batches_total")
    loop_s = d.get(("slmrank_event_loop_cpu_seconds_total", ""))
    return {"stage_mean_ms": stages, "latency_mean_ms": round(latency_s / latency_n * 1e3, 3) if latency_n else None,
            "batches": int(batches),
            "requests_per_batch": round(requests / batches, 2) if batches else None,
            "loop_cpu_ms_per_request": round(loop_s / requests * 1e3, 3) if loop_s is not None and requests else None,
            "loop_busy": round(loop_s / window_s, 3) if loop_s is not None else None}
