"""The executor's service time, measured per bucket, and what it is doing now.

bucket_s(bucket)   how long a batch of this bucket holds the executor: a high quantile
                   (`quantile`) of its last `window` measured times. A new sample more than
                   `outlier_factor` x the current estimate (before 3 samples: its family's
                   interpolation) is recorded capped at that (one slow batch does not move the
                   estimate; a real slow-down still does, geometrically).
                   A bucket with no sample younger than `ttl_s` (never run, or not lately: its
                   requests may all have been refused) is interpolated over the logical FLOPs of
                   the buckets measured lately (its family's; else scaled from the other family),
                   so the estimate keeps learning from whatever runs; failing that, its own old
                   samples; failing that, `default_s` (`is_measured` is then False).
in flight          each batch handed over, with its predicted time: the first `num_lanes` are
                   running, the rest wait for a lane.
parallelism        Σ batch run times / wall time the executor was busy (the union of the runs),
                   over the trailing window: 1 with one lane, up to num_lanes when runs overlap.
utilisation(k)     busy time / wall time over the trailing window, counting only the share of
                   each batch that belongs to priority levels 1..k (a batch's time is split
                   between its requests) — metrics, and how much higher lanes delay a lower one.
starved            a batch run while this process got less than `starved_share` of the CPU it
                   wanted (host.CpuShare: another process on the cores) took longer than the
                   executor would on an idle host, by about 1 / share. Its sample counts as its
                   time x share (what it would have taken idle) once a batch runs unstarved again:
                   a host that was starved is not taken as slow for ever; while the host is still
                   starved, it counts as it ran.
bound_s(bucket)    an upper bound on a batch of the bucket on this machine: its own estimate when
                   measured; else over its family's fresh buckets, the chord between two of them,
                   and above the largest one its time x (flops ratio)^2 (on a CPU a bucket's cost
                   grows faster than its FLOPs, about as flops^1.7 for Score on the 2-core CI
                   machine, but not faster than their square); None when the family has none.
idle_s(bucket)     the bucket's own idle service time: the same quantile of its own fresh samples,
                   starved ones at time x share; None when it has no fresh sample of its own (an
                   interpolation is no measurement of it: admission never calls a deadline
                   impossible on one).
refusals           admission notes when it refuses on a prediction (note_refusal). A batch that
                   then runs alone and unstarved in under half its bucket's estimate shows the
                   estimates were learnt on a slower host: every bucket's samples are scaled by
                   that ratio (the prediction that refused is checked against what the host does
                   now, never left to lock the server out).
lag_s              the event loop's delay between a batch's results and its handlers resuming
                   (the same quantile of the last 64): a busy loop makes every answer later.
calibration        the worst actual / predicted latency seen, its excess decaying over
                   calibration_decay_s (>= 1): what the model misses, learnt from its own errors.

Time comes from the caller (seconds, one clock); nothing here reads a clock.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from .cost import BucketInfo

NUM_LEVELS = 3  # priority levels 1 (highest) .. 3
STARVED_SHARE = 0.8  # a batch that got less of the CPU it wanted than this ran starved
REFUSAL_MEMORY_S = 30.0  # a batch this soon after a refusal on a prediction checks the estimates
RECHECK_RATIO = 0.5  # ... and rescales them when it ran in less than this share of its estimate


@dataclass
class _Flight:
    handed_over: float
    predicted_s: float
    host: tuple[float, float] | None = None  # the process's CPU run/wait at hand-over (host.CpuShare)
    alone: bool = False  # nothing else was in flight when it was handed over


@dataclass
class _BusySpan:
    start: float  # [start, end): the executor busy, disjoint from every other span
    end: float
    shares: tuple[float, ...]  # [k]: share of the batch's requests of level k+1 or higher


class ServiceTimeModel:
    def __init__(self, *, default_s: float = 0.010, window: int = 32, quantile: float = 0.9,
                 ttl_s: float = 60.0, outlier_factor: float = 4.0, utilisation_window_s: float = 2.0,
                 num_lanes: int = 1, calibration_decay_s: float = 10.0, max_calibration: float = 2.0,
                 host: Any = None) -> None:
        self.default_s, self.window, self.quantile = default_s, window, quantile
        self.ttl_s, self.outlier_factor = ttl_s, outlier_factor
        self.utilisation_window_s, self.num_lanes = utilisation_window_s, num_lanes
        self._samples: dict[str, deque[float]] = {}  # bucket key -> its last `window` times
        self._shares: dict[str, deque[float]] = {}  # ... and the CPU share each ran at
        self._idle: dict[str, float] = {}  # bucket key -> the quantile of its samples as run idle
        self.host = host  # host.CpuShare or None: nothing is ever counted as starved
        self.host_starved = False  # the latest batch ran starved
        self.last_share = 1.0
        self._refused_at = -math.inf
        self.num_rechecks = 0  # estimates rescaled after a refusal (metrics, tests)
        self._estimate: dict[str, float] = {}  # bucket key -> quantile of its samples
        self._last_seen: dict[str, float] = {}  # bucket key -> when its newest sample came
        self._infos: dict[str, BucketInfo] = {}
        self._interpolated: dict[str, tuple[float, bool]] = {}  # (seconds, measured); cleared whenever a sample arrives
        self._interpolated_at = -math.inf
        self._flights: dict[int, _Flight] = {}  # batch id -> flight, in hand-over order
        self._spans: deque[_BusySpan] = deque()  # within the window, oldest first
        self._busy_s = [0.0] * NUM_LEVELS  # [k]: Σ (end − start) · shares[k] over _spans
        self._runs: deque[tuple[float, float]] = deque()  # (end, run time) within the window
        self._run_sum_s = 0.0
        self._busy_until = -math.inf
        self._lags: deque[float] = deque(maxlen=64)  # answered -> handler resumed, the event loop's delay
        self._lag_s = 0.0
        self.calibration_decay_s, self.max_calibration = calibration_decay_s, max_calibration
        self._peak_error, self._peak_at = 1.0, 0.0  # the worst actual / predicted latency, and when
        self._lane_peaks: dict[int, tuple[float, float]] = {}  # the same, each priority lane's own
        self._now = 0.0  # the latest time seen, for the decay
        self.num_batches = 0
        self.last_run_s = 0.0

    # -- the estimate of a bucket --

    def bucket_s(self, info: BucketInfo, now: float) -> float:
        return self._estimate_of(info, now)[0]

    def bucket_min_s(self, info: BucketInfo, now: float) -> float:
        """The fastest of the bucket's own recent batches (its last `window`, the newest within
        ttl_s): a lower bound on its next one, 0.0 when it has none (nothing known)."""
        samples = self._samples.get(info.key)
        if not samples or self._last_seen.get(info.key, -math.inf) < now - self.ttl_s:
            return 0.0
        return min(samples)

    def bound_s(self, info: BucketInfo, now: float) -> float | None:
        """An upper bound on the bucket's time (module docstring); None: nothing bounds it."""
        if info.key in self._estimate and self._last_seen[info.key] >= now - self.ttl_s:
            return self._estimate[info.key]
        same = sorted((i.flops, y) for i, y in self._fresh(now) if i.family == info.family)
        return _piecewise(same, info.flops, exponent=2.0) if same else None

    def _fresh(self, now: float, exclude: str | None = None) -> list[tuple[BucketInfo, float]]:
        """(bucket, estimate) of every bucket measured within ttl_s, but `exclude`."""
        return [(i, self._estimate[k]) for k, i in self._infos.items()
                if self._last_seen[k] >= now - self.ttl_s and k != exclude]

    def idle_s(self, info: BucketInfo, now: float) -> float | None:
        """The bucket's own idle service time (module docstring); None: no fresh sample of its own."""
        if info.key not in self._idle or self._last_seen[info.key] < now - self.ttl_s:
            return None
        return self._idle[info.key]

    def num_samples(self, key: str) -> int:
        return len(self._samples.get(key, ()))

    def note_refusal(self, now: float) -> None:
        """Admission refused a request on a prediction of this model (its deadline)."""
        self._refused_at = now

    def is_measured(self, info: BucketInfo, now: float) -> bool:
        """Whether bucket_s(info) comes from measurements (its own, or its neighbours' by FLOPs)
        rather than the assumed default_s: a prediction made on the default says nothing about
        how well the model predicts, so it must not feed the calibration."""
        return self._estimate_of(info, now)[1]

    def _estimate_of(self, info: BucketInfo, now: float) -> tuple[float, bool]:
        """(seconds, whether measurements gave them)."""
        key = info.key
        if key in self._estimate and self._last_seen[key] >= now - self.ttl_s:
            return self._estimate[key], True
        if now - self._interpolated_at > 1.0:  # freshness moves with time
            self._interpolated.clear()
            self._interpolated_at = now
        cached = self._interpolated.get(key)
        if cached is None:
            value = self._interpolate(info, now)
            if value is None:
                value = self._estimate.get(key)
            # nothing measured says anything about it: the assumed default
            cached = (self.default_s, False) if value is None else (value, True)
            self._interpolated[key] = cached
        return cached

    def _interpolate(self, info: BucketInfo, now: float, exclude_self: bool = False,
                     across_families: bool = True) -> float | None:
        """Over the fresh buckets of its family, piecewise linear in flops (below the smallest: the
        smallest's time, for small buckets are mostly fixed costs; above the largest: in proportion
        to flops). A family with none: the other family's nearest bucket, in proportion to flops."""
        fresh = self._fresh(now, info.key if exclude_self else None)
        same = sorted((i.flops, y) for i, y in fresh if i.family == info.family)
        if same:
            return _piecewise(same, info.flops)
        if not fresh or info.flops <= 0 or not across_families:
            return None
        nearest, y = min(fresh, key=lambda iy: abs(math.log(max(iy[0].flops, 1.0) / info.flops)))
        return y * info.flops / max(nearest.flops, 1.0)

    # -- batches --

    def batch_started(self, batch_id: int, info: BucketInfo, now: float) -> None:
        self._flights[batch_id] = _Flight(now, self.bucket_s(info, now), self._read_host(), not self._flights)

    def _read_host(self) -> tuple[float, float] | None:
        return None if self.host is None else self.host.read()

    def batch_finished(self, batch_id: int, info: BucketInfo | None, run: tuple[float, float] | None,
                       levels: dict[int, int], service_s: float | None = None) -> None:
        """A batch is back. run: the executor's (start, end) in the caller's clock, None if it failed;
        service_s: what the batch cost from hand-over to results (run + packing), default the run."""
        flight = self._flights.pop(batch_id, None)
        if run is None or info is None:
            return
        start, end = run
        seconds = max((end - start) if service_s is None else service_s, 0.0)
        share = 1.0
        if flight is not None and self.host is not None:
            from .host import share_between
            share = share_between(flight.host, self._read_host(), getattr(self.host, "recent", 1.0))
        alone = flight is not None and flight.alone and not self._flights
        self._recheck(info, seconds, share, alone, end)
        self._record(info, seconds, end, share)
        self._add_busy(start, end, levels)

    def _recheck(self, info: BucketInfo, seconds: float, share: float, alone: bool, now: float) -> None:
        """After a refusal on a prediction: a batch run alone and unstarved far under its bucket's
        estimate rescales every bucket's samples by that ratio (module docstring)."""
        if not alone or share < STARVED_SHARE or now - self._refused_at > REFUSAL_MEMORY_S:
            return
        estimate = self._estimate.get(info.key)
        if estimate is None or self._last_seen[info.key] < now - self.ttl_s:
            estimate = self._interpolate(info, now)
        if not estimate or seconds >= RECHECK_RATIO * estimate:
            return
        ratio = seconds / estimate
        for key, samples in self._samples.items():
            scaled = deque((x * ratio for x in samples), maxlen=self.window)
            self._samples[key] = scaled
            self._update(key)
        self._interpolated.clear()
        self._refused_at = -math.inf  # checked: the estimates are this host's now
        self.num_rechecks += 1

    def _record(self, info: BucketInfo, seconds: float, now: float, share: float = 1.0) -> None:
        key = info.key
        samples = self._samples.setdefault(key, deque(maxlen=self.window))
        shares = self._shares.setdefault(key, deque(maxlen=self.window))
        reference = self._estimate.get(key) if len(samples) >= 3 else self._interpolate(info, now, True, False)
        if reference is not None and seconds > self.outlier_factor * reference:
            seconds = self.outlier_factor * reference
        self._infos[key] = info
        samples.append(seconds)
        shares.append(share)
        self.last_share = share
        starved = share < STARVED_SHARE
        if starved != self.host_starved:  # the host changed: every estimate counts starved samples anew
            self.host_starved = starved
            for k in self._samples:
                if k != key:
                    self._update(k)
        self._update(key)
        self._last_seen[key] = now
        self._interpolated.clear()
        self.num_batches += 1
        self.last_run_s = seconds

    def _update(self, key: str) -> None:
        """A bucket's estimate and idle time from its samples: a starved sample at time x share
        (idle), and likewise in the estimate unless the host is starved now."""
        samples, shares = self._samples[key], self._shares.get(key, ())
        idle = sorted(x * s if s < STARVED_SHARE else x for x, s in itertools.zip_longest(samples, shares,
                                                                                          fillvalue=1.0))
        self._idle[key] = _quantile(idle, self.quantile)
        self._estimate[key] = (_quantile(sorted(samples), self.quantile) if self.host_starved
                               else self._idle[key])

    def _add_busy(self, start: float, end: float, levels: dict[int, int]) -> None:
        self._runs.append((end, end - start))
        self._run_sum_s += end - start
        exclusive_start = min(max(start, self._busy_until), end)
        self._busy_until = max(self._busy_until, end)
        if end > exclusive_start:
            total = max(sum(levels.values()), 1)
            shares = tuple(sum(n for lvl, n in levels.items() if lvl <= k) / total for k in range(1, NUM_LEVELS + 1))
            self._spans.append(span := _BusySpan(exclusive_start, end, shares))
            self._add_span(span, +1)
        self._forget(end)

    def _add_span(self, span: _BusySpan, sign: int) -> None:
        for k, share in enumerate(span.shares):
            self._busy_s[k] = max(self._busy_s[k] + sign * (span.end - span.start) * share, 0.0)

    def _forget(self, now: float) -> None:
        horizon = now - self.utilisation_window_s
        while self._spans and self._spans[0].end <= horizon:
            self._add_span(self._spans.popleft(), -1)
        while self._runs and self._runs[0][0] <= horizon:
            self._run_sum_s = max(self._run_sum_s - self._runs.popleft()[1], 0.0)

    def observe_lag(self, seconds: float) -> None:
        """From a request's results being set to its handler running again: the event loop's delay,
        which every answer pays after its batch."""
        self._lags.append(max(seconds, 0.0))
        self._lag_s = _quantile(sorted(self._lags), self.quantile)

    @property
    def lag_s(self) -> float:
        return self._lag_s

    def observe_prediction(self, predicted_s: float, actual_s: float, now: float, lane: int | None = None) -> None:
        """A request's latency as admission predicted it (uncalibrated) and as it came to be; lane:
        its priority lane (its own error is kept too: lane_error_at)."""
        if predicted_s > 0 and self.calibration_decay_s > 0:
            self._now = max(self._now, now)
            error = min(actual_s / predicted_s, self.max_calibration)
            if error >= self.calibration_at(now):
                self._peak_error, self._peak_at = error, now
            if lane is not None and error >= self.lane_error_at(lane, now):
                self._lane_peaks[lane] = (error, now)

    def _decayed(self, peak: float, at: float, now: float) -> float:
        if peak <= 1.0:
            return 1.0
        return 1.0 + (peak - 1.0) * math.exp(-max(now - at, 0.0) / self.calibration_decay_s)

    def calibration_at(self, now: float) -> float:
        """Predictions are stretched by the worst ratio of actual to predicted latency seen, its
        excess over 1 decaying with time constant calibration_decay_s (1 to max_calibration):
        whatever the model misses (a busy event loop, lanes sharing a CPU, another process taking
        the cores) it learns from its own errors, and keeps in mind for a while."""
        return self._decayed(self._peak_error, self._peak_at, now)

    def lane_error_at(self, lane: int, now: float) -> float:
        """As calibration_at, from one priority lane's requests alone: where the worst errors come
        from (a lower lane's requests are overtaken by higher ones that arrive after them). Not
        used to predict; shown in the metrics."""
        return self._decayed(*self._lane_peaks.get(lane, (1.0, 0.0)), now)

    @property
    def calibration(self) -> float:
        return self.calibration_at(self._now)

    # -- now --

    @property
    def num_inflight(self) -> int:
        return len(self._flights)

    def inflight_remaining_s(self, now: float) -> float:
        """Executor time still owed to the batches handed over: the running ones (the first
        num_lanes) their predicted time less what has passed, the waiting ones all of it. A batch
        running past its prediction is still owed a quarter of it: it is not known to be nearly done."""
        total = 0.0
        for i, flight in enumerate(self._flights.values()):
            elapsed = now - flight.handed_over if i < self.num_lanes else 0.0
            total += max(flight.predicted_s - elapsed, 0.25 * flight.predicted_s)
        return total

    def parallelism(self, now: float) -> float:
        self._forget(now)
        busy = self._busy_s[NUM_LEVELS - 1]
        if busy <= 0 or self.num_lanes == 1:
            return 1.0
        return min(max(self._run_sum_s / busy, 1.0), float(self.num_lanes))

    def utilisation(self, level: int | None, now: float) -> float:
        """ρ over the trailing window; with a level, only the busy time of that level and above."""
        self._forget(now)
        window = self.utilisation_window_s
        k = (level or NUM_LEVELS) - 1
        busy = self._busy_s[k]
        for span in self._spans:  # disjoint and in order: only the first few straddle the horizon
            if span.start >= now - window:
                break
            busy -= (now - window - span.start) * span.shares[k]
        return min(max(busy, 0.0) / window, 1.0)

    def snapshot(self, now: float) -> dict[str, Any]:
        fresh = [v for k, v in self._estimate.items() if self._last_seen[k] >= now - self.ttl_s]
        return {
            "tau_s": _quantile(sorted(fresh), 0.5) if fresh else self.default_s,  # median bucket estimate
            "bucket_s": dict(sorted(self._estimate.items())),
            "last_run_s": self.last_run_s,
            "inflight_batches": self.num_inflight,
            "inflight_remaining_s": self.inflight_remaining_s(now),
            "parallelism": self.parallelism(now),
            "loop_lag_s": self._lag_s,
            "calibration": self.calibration_at(now),
            "rho": self.utilisation(None, now),
            "batches_observed": self.num_batches,
            "cpu_share": self.last_share,  # of the CPU this process wanted, in the latest batch
            "rechecks": self.num_rechecks,
        }


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics of sorted values."""
    pos = q * (len(values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _piecewise(points: list[tuple[float, float]], x: float, exponent: float = 1.0) -> float:
    """Linear between the points (flops, seconds), the first one's below them; above them, the
    last one's times (x / its flops)^exponent."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(xs):
        fx, fy = points[-1]
        return fy * (x / fx) ** exponent if fx > 0 else fy
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
