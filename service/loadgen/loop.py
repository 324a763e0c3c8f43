"""The load generator's loops against a Ranker server (docs/benchmarks.md, "Capacity at the SLO").

Closed loop at a level N: N workers, each sending its next request as soon as its last one is
answered (no wait), spread over the connections. Open loop at a rate R: arrivals of a Poisson
process (exponential gaps of mean 1/R from a seeded generator), each sent when it is due whatever
is in flight. Each level: warm-up, then a measured window. QPS = whole RPCs completed OK inside the
window / its length; latency = client send -> response of those; errors counted by status code.

The requests are a Pool: drawn once before the levels and serialized once (building and encoding
a message costs the client more than sending it), then sent as bytes, cycling. The server caches
nothing by content, so a request sent again costs it what it cost the first time.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, TextIO

import grpc
import numpy as np

from ..serving.proto_gen import load as load_stubs
from .server_view import scrape, server_breakdown

PRIORITIES = ("unspecified", "online", "normal", "background")  # the proto enum's order
MAX_OPEN_INFLIGHT = 20000  # open loop: an arrival past this many RPCs in flight is not sent (counted)
MESSAGE_BYTES = 64 << 20
MAX_ERROR_SHARE = 0.001  # a level whose RPCs failed more often than this does not hold the SLO
# latency histogram: 10 buckets a decade from 0.1 ms to 100 s
HIST_EDGES_MS = np.geomspace(0.1, 1e5, 61)


# ---- the requests ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    method: str  # "Score" | "BeamSearch"
    payload: bytes  # the serialized request
    flops: int | None  # logical FLOPs (service/model/flops.py), None where the model's shape is unknown


class Pool:
    """Requests to send, serialized once, cycled in order."""

    def __init__(self, messages: Iterable[Any], cfg: Any = None, priority: str = "unspecified",
                 codes: Mapping[str, int] | None = None) -> None:
        """codes: each catalog's code tokens (ModelInfo's num_codes: the FLOPs of a request normalised over them)."""
        from .workloads import message_flops

        if priority not in PRIORITIES:
            raise ValueError(f"--priority: {priority!r} is not one of {PRIORITIES}")
        entries, shapes = [], []
        for msg in messages:
            msg.priority = PRIORITIES.index(priority)
            score = hasattr(msg, "samples")
            entries.append(Entry("Score" if score else "BeamSearch", msg.SerializeToString(),
                                 message_flops(cfg, msg, codes) if cfg is not None else None))
            shapes.append((score, len(msg.prefix.ids) + sum(len(s.ids) for s in msg.samples) if score
                           else len(msg.prompt.ids), len(msg.samples) if score else msg.beam_width))
        if not entries:
            raise ValueError("a pool of no requests")
        self.entries = entries
        self._shapes = shapes
        self._next = itertools.cycle(entries).__next__

    def next(self) -> Entry:
        return self._next()

    def describe(self) -> dict[str, Any]:
        """What the pool holds: requests per method, and their mean tokens / samples / beam width."""
        out: dict[str, Any] = {"requests": len(self.entries)}
        for score, name, width in ((True, "score", "samples"), (False, "beam", "beam_width")):
            rows = [(t, k) for s, t, k in self._shapes if s == score]
            if rows:
                out[name] = {"requests": len(rows), "mean_tokens": round(float(np.mean([t for t, _ in rows])), 1),
                             f"mean_{width}": round(float(np.mean([k for _, k in rows])), 1)}
        flops = [e.flops for e in self.entries]
        out["mean_flops"] = float(np.mean(flops)) if None not in flops else None
        return out


# ---- connections -------------------------------------------------------------------------------------

def open_channels(target: str, n: int, credentials: grpc.ChannelCredentials | None = None,
                  server_name: str | None = None) -> list[grpc.aio.Channel]:
    """n channels to target, each its own TCP connection (a channel of its own subchannel pool:
    by default gRPC shares one connection among channels of the same arguments)."""
    options = [("grpc.max_receive_message_length", MESSAGE_BYTES), ("grpc.max_send_message_length", MESSAGE_BYTES),
               ("grpc.use_local_subchannel_pool", 1)]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None:
        return [grpc.aio.insecure_channel(target, options=options) for _ in range(n)]
    return [grpc.aio.secure_channel(target, credentials, options=options) for _ in range(n)]


def _callers(channels: list[grpc.aio.Channel]) -> list[dict[str, Any]]:
    """Per channel, the raw calls (bytes in, bytes out: no client-side (de)serialization) by method."""
    service = load_stubs().pb2.DESCRIPTOR.services_by_name["Ranker"].full_name
    return [{m: ch.unary_unary(f"/{service}/{m}") for m in ("Score", "BeamSearch")} for ch in channels]


# ---- one level ---------------------------------------------------------------------------------------

def latency_summary(lat_ms: list[float]) -> dict[str, float]:
    if not lat_ms:
        nan = float("nan")
        return {"mean_ms": nan, "p50_ms": nan, "p90_ms": nan, "p99_ms": nan, "max_ms": nan}
    a = np.asarray(lat_ms)
    p50, p90, p99 = np.percentile(a, (50, 90, 99))
    return {"mean_ms": float(a.mean()), "p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99),
            "max_ms": float(a.max())}


def histogram(lat_ms: list[float]) -> dict[str, list]:
    """Counts of latencies in log-spaced buckets (HIST_EDGES_MS), trimmed to the buckets in use;
    counts[i] holds edges_ms[i] <= latency < edges_ms[i + 1] (the ends catch what is outside)."""
    if not lat_ms:
        return {"edges_ms": [], "counts": []}
    idx = np.clip(np.searchsorted(HIST_EDGES_MS, np.asarray(lat_ms), side="right") - 1, 0, len(HIST_EDGES_MS) - 2)
    counts = np.bincount(idx, minlength=len(HIST_EDGES_MS) - 1)
    lo, hi = int(idx.min()), int(idx.max())
    return {"edges_ms": [round(float(e), 4) for e in HIST_EDGES_MS[lo:hi + 2]],
            "counts": counts[lo:hi + 1].tolist()}


class Window:
    """One level's measured window and what completed in it; also read by the progress line."""

    def __init__(self, label: str, warmup_s: float, measure_s: float) -> None:
        self.label = label
        self.t_begin = time.perf_counter()
        self.t_start, self.t_end = self.t_begin + warmup_s, self.t_begin + warmup_s + measure_s
        self.lat_ms: list[float] = []
        self.lat_by_method: dict[str, list[float]] = {}  # a mix's kinds, each on its own (neither may starve)
        self.errors: Counter[str] = Counter()
        self.sent = self.not_sent = 0
        self.flops = 0
        self.flops_known = True

    def record(self, entry: Entry, sent: float, done: float, code: str) -> None:
        if self.t_start <= done <= self.t_end:  # completed inside the measured window
            if code == "OK":
                self.lat_ms.append((done - sent) * 1e3)
                self.lat_by_method.setdefault(entry.method, []).append(self.lat_ms[-1])
                if entry.flops is None:
                    self.flops_known = False
                else:
                    self.flops += entry.flops
            else:
                self.errors[code] += 1

    def status(self) -> str:
        now = time.perf_counter()
        total = self.t_end - self.t_begin
        phase = "warm-up" if now < self.t_start else "measure" if now <= self.t_end else "draining"
        line = f"{self.label}: {min(now, self.t_end) - self.t_begin:5.1f}/{total:.1f} s {phase:8s} sent {self.sent}"
        if now >= self.t_start and self.lat_ms:
            s = latency_summary(self.lat_ms)
            line += (f"  {len(self.lat_ms) / max(1e-9, min(now, self.t_end) - self.t_start):8.1f} req/s  "
                     f"mean {s['mean_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms")
        errors = sum(self.errors.values())
        return line + (f"  errors {errors}" if errors else "")


class Progress:
    """One status line on stderr, rewritten every second on a terminal; a plain line a second otherwise."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 1.0) -> None:
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def show(self, line: str) -> None:
        self.stream.write(f"\r\x1b[K{line}" if self.tty else line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    async def follow(self, window: Window) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.show(window.status())
        finally:
            self.clear()


async def _call(call: Any, entry: Entry, timeout_s: float) -> str:
    try:
        await call(entry.payload, timeout=timeout_s)
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def _measure(window: Window, metrics_url: str | None) -> dict[str, Any]:
    """At the window's start and end: the client's CPU time and the server's /metrics (if given)."""
    await asyncio.sleep(max(0.0, window.t_start - time.perf_counter()))
    cpu0 = time.process_time()
    before = await asyncio.to_thread(scrape, metrics_url) if metrics_url else None
    await asyncio.sleep(max(0.0, window.t_end - time.perf_counter()))
    cpu1 = time.process_time()
    after = await asyncio.to_thread(scrape, metrics_url) if metrics_url else None
    return {"client_cpu": (cpu1 - cpu0) / (window.t_end - window.t_start), "scraped": (before, after)}


def _result(window: Window, measured: dict[str, Any], measure_s: float, warmup_s: float, tail_s: float,
            **extra: Any) -> dict[str, Any]:
    lat = window.lat_ms
    before, after = measured["scraped"]
    server = server_breakdown(before, after, len(lat), measure_s) if before is not None else None
    lat_sorted = sorted(lat)
    return {**extra, "server": server, "completed": len(lat), "qps": len(lat) / measure_s,
            **latency_summary(lat_sorted), "errors": dict(window.errors), "num_errors": sum(window.errors.values()),
            "sent": window.sent, "not_sent": window.not_sent,
            "flops_per_s": window.flops / measure_s if window.flops_known else None,
            "client_cpu": round(measured["client_cpu"], 3), "histogram": histogram(lat_sorted),
            "by_method": {m: {"completed": len(v), "qps": len(v) / measure_s, **latency_summary(v)}
                          for m, v in sorted(window.lat_by_method.items())},
            "warmup_s": warmup_s, "measure_s": measure_s, "tail_s": round(tail_s, 3)}


async def closed_level(channels: list[grpc.aio.Channel], pool: Pool, level: int, warmup_s: float, measure_s: float,
                       rpc_timeout_s: float, metrics_url: str | None = None,
                       progress: Progress | None = None) -> dict[str, Any]:
    """level requests in flight for warmup_s + measure_s; the measured window's result."""
    callers = _callers(channels)
    window = Window(f"level {level}", warmup_s, measure_s)

    async def worker(i: int) -> None:
        methods = callers[i % len(callers)]
        while time.perf_counter() < window.t_end:
            entry = pool.next()
            window.sent += 1
            sent = time.perf_counter()
            code = await _call(methods[entry.method], entry, rpc_timeout_s)
            window.record(entry, sent, time.perf_counter(), code)

    follow = asyncio.create_task(progress.follow(window)) if progress else None
    try:
        *_, measured = await asyncio.gather(*(worker(i) for i in range(level)), _measure(window, metrics_url))
    finally:
        if follow:
            follow.cancel()
    tail_s = time.perf_counter() - window.t_end  # the last requests in flight finishing after the window
    return _result(window, measured, measure_s, warmup_s, tail_s, mode="closed", level=level, rate=None)


def arrivals(rate: float, seed: Any) -> Iterator[float]:
    """The gaps between a Poisson process's arrivals: exponential of mean 1/rate seconds, from a
    generator seeded with seed (the same seed, the same gaps)."""
    rng = np.random.default_rng(seed)
    while True:
        yield from rng.exponential(1.0 / rate, 1024).tolist()


async def open_level(channels: list[grpc.aio.Channel], pool: Pool, rate: float, warmup_s: float, measure_s: float,
                     rpc_timeout_s: float, seed: Any = 7, metrics_url: str | None = None,
                     progress: Progress | None = None) -> dict[str, Any]:
    """Poisson arrivals at rate req/s for warmup_s + measure_s; the measured window's result, with
    how late the client sent what was due (send_lag: a client behind its schedule offers less)."""
    callers = _callers(channels)
    window = Window(f"rate {rate:g}/s", warmup_s, measure_s)
    lags: list[float] = []
    inflight: set[asyncio.Task] = set()

    async def one(methods: dict[str, Any], entry: Entry) -> None:
        sent = time.perf_counter()
        code = await _call(methods[entry.method], entry, rpc_timeout_s)
        window.record(entry, sent, time.perf_counter(), code)

    async def schedule() -> None:
        due = window.t_begin
        for n, gap in enumerate(arrivals(rate, seed)):
            due += gap
            if due >= window.t_end:
                return
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            if due >= window.t_start:
                lags.append((now - due) * 1e3)
            if len(inflight) >= MAX_OPEN_INFLIGHT:
                window.not_sent += 1
                continue
            window.sent += 1
            task = asyncio.create_task(one(callers[n % len(callers)], pool.next()))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

    follow = asyncio.create_task(progress.follow(window)) if progress else None
    try:
        _, measured = await asyncio.gather(schedule(), _measure(window, metrics_url))
        if inflight:
            await asyncio.gather(*inflight)
    finally:
        if follow:
            follow.cancel()
    tail_s = time.perf_counter() - window.t_end
    lag = np.percentile(np.asarray(lags), (50, 99)) if lags else (float("nan"),) * 2
    return _result(window, measured, measure_s, warmup_s, tail_s, mode="open", level=None, rate=rate,
                   send_lag_p50_ms=round(float(lag[0]), 3), send_lag_p99_ms=round(float(lag[1]), 3))


# ---- the sweep and its capacity ----------------------------------------------------------------------

def within_slo(row: dict[str, Any], slo_mean_ms: float, slo_p99_ms: float, max_error_share: float) -> bool:
    """A level holds the SLO: RPCs completed, mean < slo_mean_ms, P99 < slo_p99_ms (NaN never
    holds), and at most max_error_share of its finished RPCs failed."""
    done = row["completed"] + row["num_errors"]
    return bool(row["completed"] and row["mean_ms"] < slo_mean_ms and row["p99_ms"] < slo_p99_ms
                and row["num_errors"] <= max_error_share * done)


def capacity(levels: list[dict[str, Any]], slo_mean_ms: float = 20.0, slo_p99_ms: float = 80.0,
             max_error_share: float = MAX_ERROR_SHARE) -> dict[str, Any] | None:
    """The capacity at the SLO: the highest QPS of a level that holds it (within_slo), or None."""
    ok = [r for r in levels if within_slo(r, slo_mean_ms, slo_p99_ms, max_error_share)]
    if not ok:
        return None
    best = max(ok, key=lambda r: r["qps"])
    return {"qps": best["qps"], "level": best["level"], "rate": best.get("rate"), "mean_ms": best["mean_ms"],
            "p99_ms": best["p99_ms"], "flops_per_s": best.get("flops_per_s")}


def refine_level(rows: list[dict[str, Any]], holds: Callable[[dict[str, Any]], bool]) -> int | None:
    """The next level sweep's refine measures: halfway between the highest measured level that holds
    and the lowest one above it that does not (0 if none held); None when every level held, or no
    whole level lies between the two."""
    held = max((r["level"] for r in rows if holds(r)), default=0)
    over = min((r["level"] for r in rows if r["level"] > held and not holds(r)), default=None)
    if over is None or over - held < 2:
        return None
    return (held + over) // 2


async def sweep(target: str, pool: Pool, *, levels: list[int] | None = None, rates: list[float] | None = None,
                warmup_s: float = 2.0, measure_s: float = 10.0, rpc_timeout_s: float = 60.0, connections: int = 1,
                stop_above_ms: float = 2000.0, seed: int = 7, metrics_url: str | None = None,
                credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
                progress: Progress | None = None,
                on_level: Callable[[dict[str, Any]], None] | None = None, refine: int = 0,
                holds: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
    """The levels (closed loop) or the rates (open loop), in order, over `connections` connections
    kept for the whole sweep. Once a level's mean latency exceeds stop_above_ms, the higher ones
    are skipped (bounded in time: past it the loop only measures a queue). on_level(row) after each.

    refine (closed loop, with holds: a row holds the SLO): up to that many more levels, each halfway
    between the highest level that held and the lowest above it that did not (0 below the first
    level), while a whole level lies between them: the capacity to the level, not to the list's
    octave (levels 4, 8, 16 with 4 holding and 8 not: 6, then 5 or 7). The rows come back in level
    order."""
    if (levels is None) == (rates is None):
        raise ValueError("sweep: levels (closed loop) or rates (open loop), one of the two")
    if refine and (levels is None or holds is None):
        raise ValueError("sweep: refine needs levels (closed loop) and holds")
    loads: list[Any] = list(levels if levels is not None else rates)  # type: ignore[arg-type]
    channels = open_channels(target, connections, credentials, server_name)
    rows: list[dict[str, Any]] = []
    skipped: list[Any] = []

    async def measure(i: int, load: Any) -> None:
        if levels is not None:
            row = await closed_level(channels, pool, load, warmup_s, measure_s, rpc_timeout_s, metrics_url, progress)
        else:
            row = await open_level(channels, pool, load, warmup_s, measure_s, rpc_timeout_s, (seed, i), metrics_url,
                                   progress)
        rows.append(row)
        if on_level:
            on_level(row)

    try:
        for i, load in enumerate(loads):
            if rows and rows[-1]["mean_ms"] > stop_above_ms:
                skipped.append(load)
                continue
            await measure(i, load)
        for _ in range(refine):
            level = refine_level(rows, holds)  # type: ignore[arg-type]
            if level is None:
                break
            await measure(len(rows), level)
        if refine:
            rows.sort(key=lambda r: r["level"])
    finally:
        for ch in channels:
            await ch.close()
    return {"levels": rows, "skipped_levels": skipped}
