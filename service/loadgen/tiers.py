"""`slmrank build --traffic LOG`: the bucket tiers that pad a logged traffic least, within a
start-up budget (graphs) and a memory budget (the largest bucket's activations).

Expected padded work, per kind of request ("score", "beam": only one kind shares a batch; a
BeamSearch batch's requests may differ in new_tokens), is what the chooser minimises:

  the kind's valid requests of the log, in arrival order, packed greedily at the concurrency the
  log shows: a batch takes the next request while some bucket holds it (buckets.Fill) and it has
  fewer requests than were in flight of its kind when its first request arrived (itself included:
  the log's arrivals and latencies, traffic.requests_in_flight), else it goes and the next one
  starts: lone requests in a lull, full batches in a burst. Each batch runs in its bucket (Fill's:
  the first in pick_order that holds it), and
      padding = sum over batches of work(bucket) - sum over requests of their real work,
  reported as a share of the real work. Work is logical FLOPs of the linear layers and the LM head
  (attention is left out: a padding row reads no key), with t the FLOPs of one token row through
  the layers' linear maps and h those of one LM-head row; a forward pass of m rows costs at least
  the FLOPs of F = packing.FLOOR_ROWS rows (below that it is bound by reading the weights: ~128 rows of
  bfloat16 on an H100 or H200, whose FLOPs per byte of memory bandwidth are ~200-300):
      Score bucket of T tokens, S samples:  max(T, F)*t + S*h;  a request: its tokens*t + its samples*h
      BeamSearch bucket of R requests, P prompt tokens, max_rows M, n new tokens:
          max(P, F)*t + R*h + max(M, F)*(n - 1)*(t + h)   (prefill, its last rows' head, n - 1 steps)
      a request of p prompt tokens, width B, n new tokens: p*t + h + B*(n - 1)*(t + h)
  So a bucket's prompt tier costs what its prefill costs (beam rows alone, what pick_order ranks
  by, left every batch of a table chosen on them in the widest prompt tier: measured on an H100,
  2026-12-07, 7-10% below the default table), and tiers finer than the floor buy nothing. A
  bucket is added only while it saves at least MIN_GAIN of the log's real work (how many graphs to
  capture: the last few hundred of a budget of ~700 saved ~1% together, and each costs start-up
  time and graph memory). The padding of each request alone (c = 1) is reported beside it, as is
  the default table's; neither is minimised. Both kinds are in FLOPs: one graph budget, one unit.

Budgets: buckets (a CUDA graph each per lane, captured at start-up) <= max_graphs, by default the
default table's count (start-up no slower than the default's); every bucket's activation memory
<= max_activation_bytes, by default the default table's largest (no more memory than the
default's). In bfloat16 (e = 2 bytes), with A = 2h + 2q + 2kv + 3i the live values of one token
row in a layer (residual and normed input, q/k/v, attention output, gate-up and SiLU.up; h hidden,
q = heads x head_dim, kv = kv_heads x head_dim, i intermediate), L layers and V the head's width
(vocabulary, or num_labels of a classification head):
  Score, T tokens, S samples:           e*T*A + S*V*(e + 4)   (logits and their float32 log-softmax)
  BeamSearch, R requests of width B, P prompt tokens, n new tokens:
      e*P*(A + 2*L*kv) + R*B*(e*A + V*(e + 4) + 2*L*n*kv*e)
  (the prefill's rows and the prompt K/V kept for every layer; then R*B rows a step: activations,
  logits, and the beams' suffix K/V).

Search: per kind a frame, the largest default buckets within the memory budget (every candidate
lies inside one of them, so whether a batch fits depends on the frame alone and the batches are
formed once), and candidate tiers from the quantiles of those batches and the default's tiers.
Greedy: add the candidate that saves the most padding until the graph budget is spent or none
saves any. Every kind of the limits keeps a bucket that holds one request of the limits
(BucketTable.fits_one): a request the log never showed is still served.

Only ScoreTiers and BeamTiers know a bucket's fields and the layout of a batch's totals; the rest
asks Fill, holds, work, pick_order and kind_of.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..artifact.buckets import (ANY_STEPS, BeamBucket, Bucket, BucketTable, Fill, ScoreBucket, default_bucket_table,
                                kind_of, pick_order)
from ..artifact.buckets import activation_bytes as bucket_activation_bytes
from ..model.config import ModelConfig, ServingLimits
from ..model.progress import Progress
from ..runtime.batch import dims, kind as request_kind
from ..runtime.requests import BeamRequest, RequestError, ScoreRequest, validate_beam, validate_score
from . import traffic
from .packing import Batches, Request, pack, padding_of, work_of

ACT_BYTES = 2  # bfloat16: what serves on a GPU
# of the batches' totals: candidate tiers of the main dimension (tokens, prompt tokens) and of the others
TIER_QUANTILES = tuple(range(1, 101))
SIDE_QUANTILES = (50, 90, 99, 100)
MIN_GAIN = 2e-4  # a bucket is added only while it saves this share of the log's real work


@dataclass(frozen=True)
class Budget:
    max_graphs: int  # buckets in the table (one CUDA graph each per lane)
    max_activation_bytes: int  # of any one bucket

    def __post_init__(self) -> None:
        if self.max_graphs <= 0 or self.max_activation_bytes <= 0:
            raise ValueError(f"budget {self}: must be > 0")


def _round_up(n: int, to: int) -> int:
    return max(to, -(-n // to) * to)


# ---- per kind: the only code that knows a bucket's fields ----------------------------------------

def _quantiles(values: np.ndarray, to: int, qs: Sequence[int] = SIDE_QUANTILES) -> set[int]:
    if not values.size:
        return set()
    return {_round_up(int(v), to) for v in np.percentile(values, qs, method="inverted_cdf")}


@dataclass(frozen=True)
class ScoreTiers:
    """Score buckets (max_tokens, max_samples, max_requests); a batch's totals (requests, tokens, samples)."""

    cfg: ModelConfig
    limits: ServingLimits

    def activation_bytes(self, b: ScoreBucket) -> int:
        return bucket_activation_bytes(b, self.cfg, ACT_BYTES)

    def largest_request(self, kind: str) -> ScoreRequest:
        n = self.limits.max_samples
        return ScoreRequest(((0,) * (self.limits.max_score_tokens - n + 1),) + ((0,),) * (n - 1))

    def exact(self, fits: Sequence[Bucket]) -> list[Bucket]:
        return []

    def frame(self, default: Sequence[Bucket], max_bytes: int) -> list[Bucket]:
        """The largest default bucket within the budget: it holds every other (the default's tiers grow together)."""
        fits = [b for b in default if self.activation_bytes(b) <= max_bytes]  # type: ignore[arg-type]
        return fits[-1:]

    def candidates(self, totals: np.ndarray, frame: Sequence[Bucket], default: Sequence[Bucket]) -> set[Bucket]:
        """totals: [batches, 3], a row a batch. Token tiers at the batches' token quantiles (64-row
        aligned, as token_tiers), each with sample tiers at the quantiles of the batches it would take
        and room for as many requests as they have; and the default's buckets."""
        top: ScoreBucket = frame[0]  # type: ignore[assignment]
        requests, tokens, samples = totals.T
        out: set[ScoreBucket] = set(default)  # type: ignore[arg-type]
        for t in _quantiles(tokens, 64, TIER_QUANTILES):
            if t > top.max_tokens:
                continue
            under = tokens <= t
            r = min(top.max_requests, max(2, t // 64, int(requests[under].max(initial=0))))
            for s in _quantiles(samples[under], 16):
                out.add(ScoreBucket(t, min(s, top.max_samples), r))
        return {b for b in out if top.holds(b.max_requests, b.max_tokens, b.max_samples)}


@dataclass(frozen=True)
class BeamTiers:
    """BeamSearch buckets (new_tokens, max_requests, max_prompt_tokens, beam_width, max_rows); a
    batch's totals (requests, prompt tokens, widest, packed rows, longest new tokens, steps: see
    BeamBucket.grow). Work (packing.work_of): the module docstring's FLOPs."""

    cfg: ModelConfig
    limits: ServingLimits

    def activation_bytes(self, b: BeamBucket) -> int:
        return bucket_activation_bytes(b, self.cfg, ACT_BYTES)

    def largest_request(self, kind: str) -> BeamRequest:
        return BeamRequest((0,) * self.limits.max_prompt_tokens, self.limits.max_beam_width, self.limits.max_new_tokens)

    @staticmethod
    def _inside(b: BeamBucket, frame: Sequence[Bucket]) -> bool:
        return any(f is not b and f.holds(b.max_requests, b.max_prompt_tokens, b.beam_width, b.max_rows, b.new_tokens,
                                          ANY_STEPS) for f in frame)

    def frame(self, default: Sequence[Bucket], max_bytes: int) -> list[Bucket]:
        """The default buckets within the budget that no other of them holds."""
        fits = [b for b in default if self.activation_bytes(b) <= max_bytes]  # type: ignore[arg-type]
        return [b for b in fits if not self._inside(b, fits)]  # type: ignore[arg-type]

    def exact(self, fits: Sequence[Bucket]) -> list[Bucket]:
        """For each new_tokens n, the first of fits (in pick_order) that holds a request of the
        limits generating n tokens in exactly n steps: a request with a catalog runs only in a
        bucket of its own new_tokens (BucketTable.fits_one)."""
        lim = self.limits
        found = (Fill(tuple(fits)).add(lim.max_prompt_tokens, lim.max_beam_width, n, n)  # dims, steps = n
                 for n in range(1, lim.max_new_tokens + 1))
        return [b for b in found if b is not None]

    def candidates(self, totals: np.ndarray, frame: Sequence[Bucket], default: Sequence[Bucket]) -> set[Bucket]:
        """totals: [batches, 6]. For each longest new_tokens n among the batches, over the batches of
        that n: widest tiers at their quantiles and the default's; for each, packed-row tiers at the
        quantiles of the batches it would take (16-row aligned), as many requests as those have, and
        prompt tiers at their prompts' quantiles (64-aligned)."""
        beams: list[BeamBucket] = [*frame, *default]  # type: ignore[list-item]
        out: set[Bucket] = set(default)
        for n in np.unique(totals[:, 4]).tolist():
            requests, prompts, widest, rows = totals[totals[:, 4] == n, :4].T
            for w in _quantiles(widest, 4, TIER_QUANTILES[4::5]) | {b.beam_width for b in beams}:
                for m in _quantiles(rows[widest <= w], 16, TIER_QUANTILES[4::5]):
                    under = (widest <= w) & (rows <= max(m, w))
                    r = max(1, int(requests[under].max(initial=1)))
                    m = min(max(m, w), r * w)
                    for p in _quantiles(prompts[under], 64, TIER_QUANTILES[4::5]):
                        b = BeamBucket(n, r, p, w, m)
                        if self._inside(b, frame):
                            out.add(b)
        return out


def tiers_of(kind: str, cfg: ModelConfig, limits: ServingLimits) -> ScoreTiers | BeamTiers:
    return ScoreTiers(cfg, limits) if kind == "score" else BeamTiers(cfg, limits)


def activation_bytes(bucket: Bucket, cfg: ModelConfig, limits: ServingLimits) -> int:
    return tiers_of(kind_of(bucket), cfg, limits).activation_bytes(bucket)  # type: ignore[arg-type]


@dataclass
class KindTraffic:
    """One kind's logged requests in arrival order."""

    kind: str
    requests: list[Request]

    @property
    def concurrency(self) -> int:
        """The p50 of the requests in flight as one arrives."""
        return int(np.percentile([r[2] for r in self.requests], 50, method="inverted_cdf"))


def kinds_of_log(log: traffic.TrafficLog, cfg: ModelConfig, limits: ServingLimits) -> dict[str, KindTraffic]:
    """The log's valid requests by kind, each checked against the build's limits (ValueError
    naming the limit and how many requests break it)."""
    out: dict[str, KindTraffic] = {}
    for name, col in log.kinds.items():
        if not col.num_valid:
            continue
        reqs = traffic.logged_requests(name, col)
        validate = validate_score if name == "score" else validate_beam
        shapes: dict[int, tuple[str, tuple[int, int], int] | str] = {}  # id -> (kind, dims, real work), or why not
        bad: dict[str, int] = {}
        for req in reqs:
            shape = shapes.get(id(req))
            if shape is None:
                try:
                    validate(req, cfg, limits, True)  # type: ignore[arg-type]
                    k, d = request_kind(req), dims(req)
                    shape = shapes[id(req)] = (k, d, work_of(k, cfg)[1](d))
                except RequestError as e:
                    shape = shapes[id(req)] = str(e)
            if isinstance(shape, str):
                bad[shape] = bad.get(shape, 0) + 1
        if bad:
            why, count = max(bad.items(), key=lambda kv: kv[1])
            raise ValueError(f"--traffic {log.path}: {sum(bad.values())} {name} requests of the log break this "
                             f"build's limits (most often, {count} times: {why}); build with limits that hold them")
        arrival = np.asarray(col.valid_arrival_s, dtype=np.float64)
        latency = np.asarray(col.valid_latency_ms, dtype=np.float64)
        by_kind: dict[str, list[int]] = {}
        for i in np.argsort(arrival, kind="stable").tolist():
            by_kind.setdefault(shapes[id(reqs[i])][0], []).append(i)  # type: ignore[index]
        for k, idx in sorted(by_kind.items()):
            flight = traffic.requests_in_flight(arrival[idx], latency[idx]).tolist()
            out[k] = KindTraffic(k, [(*shapes[id(reqs[i])][1:], n) for i, n in zip(idx, flight)])  # type: ignore
    return out


# ---- the search ----------------------------------------------------------------------------------

@dataclass
class _Search:
    """One kind's candidates (frame first chosen) against its batches, in pick_order; the work
    (FLOPs) each candidate would save, kept up to date as buckets are taken."""

    buckets: list[Bucket]
    holds: np.ndarray  # [K, D]: bucket k holds batch totals d
    work: np.ndarray  # [K] FLOPs of a batch in bucket k (float64: a log's sums pass int64's range)
    counts: np.ndarray  # [D] batches of these totals
    chosen: np.ndarray = field(init=False)
    runs_in: np.ndarray = field(init=False)  # [D] the bucket each batch runs in (its first chosen holder)
    saved: np.ndarray = field(init=False)  # [K] FLOPs each bucket would save if taken (< 0: it would cost)

    def start(self, frame: Sequence[Bucket]) -> None:
        keys = {b.key for b in frame}
        self.chosen = np.array([b.key in keys for b in self.buckets], dtype=bool)
        first = np.where(self.holds & self.chosen[:, None], np.arange(len(self.buckets))[:, None], len(self.buckets))
        self.runs_in = first.min(axis=0)
        self.saved = self._saved(np.arange(self.counts.size))

    def _saved(self, cols: np.ndarray) -> np.ndarray:
        """[K]: FLOPs each bucket would save on the batches cols, as they run now (a bucket earlier
        in pick order may cost more: a narrower beam tier of a wider prompt tier)."""
        now = self.runs_in[cols]
        earlier = self.holds[:, cols] & (np.arange(len(self.buckets))[:, None] < now[None, :])
        return np.where(earlier, (self.work[now][None, :] - self.work[:, None]) * self.counts[cols][None, :], 0).sum(1)

    def gains(self) -> np.ndarray:
        """FLOPs of padding each bucket would save if taken (0 for those taken)."""
        return np.where(self.chosen, 0.0, self.saved)

    def take(self, k: int) -> None:
        moved = np.flatnonzero(self.holds[k] & (k < self.runs_in))
        self.saved -= self._saved(moved)
        self.runs_in[moved] = k
        self.saved += self._saved(moved)
        self.chosen[k] = True


def holds_matrix(buckets: Sequence[Bucket], totals: Sequence[tuple[int, ...]]) -> np.ndarray:
    """[K, D]: bucket k holds batch totals d (Bucket.holds), a count at a time in numpy: holds is
    reach_of(totals) <= reach in every count, for Score and BeamSearch buckets alike (a 100,000-
    request log asked holds ~70 million times, 35 s of a 95 s choice, one call each)."""
    if not buckets or not totals:
        return np.zeros((len(buckets), len(totals)), dtype=bool)
    reach = np.array([b.reach for b in buckets], dtype=np.int64)  # [K, F]
    need = np.array([buckets[0].reach_of(t) for t in totals], dtype=np.int64)  # [D, F]: one kind, one layout
    out = np.ones((len(buckets), len(totals)), dtype=bool)
    for f in range(reach.shape[1]):
        out &= need[None, :, f] <= reach[:, None, f]
    return out


def _search(frame: list[Bucket], candidates: set[Bucket], batches: Batches, work: Callable[[Any], int]) -> _Search:
    keys = {b.key for b in frame}
    buckets = sorted([*frame, *(b for b in candidates if b.key not in keys)], key=pick_order)
    totals = list(batches)
    holds = holds_matrix(buckets, totals)
    s = _Search(buckets, holds, np.array([work(b) for b in buckets], dtype=np.float64),
                np.array([batches[t].count for t in totals], dtype=np.float64))
    s.start(frame)
    return s


def default_budget(default: BucketTable, cfg: ModelConfig, limits: ServingLimits) -> Budget:
    """The default table's graphs and its largest bucket's activations: never slower to start, never bigger."""
    buckets = (*default.score, *default.beam)
    return Budget(len(buckets), max(activation_bytes(b, cfg, limits) for b in buckets))


def _frame(kind: str, default: Sequence[Bucket], in_log: bool, cfg: ModelConfig, limits: ServingLimits,
           budget: Budget) -> list[Bucket]:
    """The kind's largest buckets within the memory budget (a kind the log lacks: the smallest
    that holds one request of the limits); ValueError when none within it holds one."""
    tiers = tiers_of(kind, cfg, limits)
    largest = dims(tiers.largest_request(kind))
    fits = [b for b in default if tiers.activation_bytes(b) <= budget.max_activation_bytes]  # type: ignore[arg-type]
    frame = tiers.frame(default, budget.max_activation_bytes) if in_log else \
        [b for b in (Fill(tuple(fits)).add(*largest),) if b is not None]
    frame += [b for b in tiers.exact(fits) if b not in frame]
    if Fill(tuple(sorted(frame, key=pick_order))).add(*largest) is None:
        need = min(tiers.activation_bytes(b) for b in default if Fill((b,)).add(*largest) is not None)  # type: ignore
        raise ValueError(f"--max-activation-mib {budget.max_activation_bytes / 2**20:.0f}: no {kind} bucket within it "
                         f"holds one request of the limits (that needs {need / 2**20:.0f} MiB)")
    return frame


def check_limits(log: traffic.TrafficLog, limits: ServingLimits) -> None:
    """The log's server must have run with the build's limits: its traffic was shaped by them."""
    if log.limits is None:
        return
    ours = limits.to_dict()
    diff = {k: v for k, v in log.limits.items() if ours.get(k) != v}
    if diff:
        said = ", ".join(f"{k} {v} (this build: {ours.get(k, 'none')})" for k, v in sorted(diff.items()))
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(diff.items()) if k in ours)
        raise ValueError(f"--traffic {log.path}: the log's server ran with other limits than this build's: {said}; "
                         f"build with the log's limits ({flags}) or with a log of a server of these limits")


def _summary(p: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if k != "buckets"}


def choose_table(log: traffic.TrafficLog, cfg: ModelConfig, limits: ServingLimits, budget: Budget | None = None,
                 quiet: bool = False) -> tuple[BucketTable, dict[str, Any]]:
    """The table that pads the log's requests least (module docstring) and its record for the
    manifest: where it came from, the budgets, and per kind its expected padding, packed (what was
    minimised, per bucket) and alone, beside the default table's."""
    check_limits(log, limits)
    default = default_bucket_table(limits)
    budget = budget or default_budget(default, cfg, limits)
    kinds = kinds_of_log(log, cfg, limits)
    if not kinds:
        raise ValueError(f"--traffic {log.path}: no request of the log has its shape (all were refused or invalid "
                         "before they were decoded)")
    frames = {k: _frame(k, bs, k in kinds, cfg, limits, budget) for k, bs in default.kinds.items()}
    num_frame = sum(map(len, frames.values()))
    if num_frame > budget.max_graphs:
        raise ValueError(f"--max-graphs {budget.max_graphs}: a table needs at least {num_frame} buckets here "
                         f"(one that holds a request of the limits for each of {len(frames)} kinds, and the "
                         "largest of each logged kind)")
    total = sum(len(k.requests) for k in kinds.values())
    with Progress("choose bucket tiers", 2 * total, quiet=quiet) as bar:
        searches = {}
        for k, kt in kinds.items():
            searches[k] = _search_of(kt, frames[k], default.of_kind(k), cfg, limits, budget)
            bar.advance(len(kt.requests), f"{k}: {len(searches[k].holds[0])} batch shapes, "
                                          f"{len(searches[k].buckets)} candidates")
        real = sum(r[1] for kt in kinds.values() for r in kt.requests)
        _greedy(searches, budget.max_graphs - num_frame, MIN_GAIN * real)
        buckets = [b for k, frame in frames.items()
                   for b in ([b for b, c in zip(searches[k].buckets, searches[k].chosen) if c] if k in searches
                             else frame)]
        table = BucketTable(tuple(sorted(b for b in buckets if kind_of(b) == "score")),  # type: ignore[misc]
                            tuple(sorted(b for b in buckets if kind_of(b) != "score")))  # type: ignore[misc]
        table.fits_one(limits)
        report: dict[str, Any] = {}
        for k, kt in kinds.items():
            report[k] = _kind_report(kt, table.of_kind(k), default.of_kind(k), work_of(k, cfg)[0])
            bar.advance(len(kt.requests), k)
    origin = {"source": "traffic log", "log": Path(log.path).name, "log_sha256": log.sha256,
              "log_requests": total, "model": log.model,
              "budget": {"max_graphs": budget.max_graphs, "max_activation_bytes": budget.max_activation_bytes},
              "graphs": len(buckets), "max_activation_bytes": max(activation_bytes(b, cfg, limits) for b in buckets),
              "kinds": report}
    return table, origin


def _search_of(kt: KindTraffic, frame: list[Bucket], default: Sequence[Bucket], cfg: ModelConfig,
               limits: ServingLimits, budget: Budget) -> _Search:
    """The kind's batches (packed in its frame) against its candidates within the memory budget."""
    tiers = tiers_of(kt.kind, cfg, limits)

    def fits(b: Any) -> bool:
        return tiers.activation_bytes(b) <= budget.max_activation_bytes

    batches = pack(frame, kt.requests)
    cands = tiers.candidates(np.array(list(batches), dtype=np.int64), frame, [b for b in default if fits(b)])
    return _search(frame, {b for b in cands if fits(b)}, batches, work_of(kt.kind, cfg)[0])


def _greedy(searches: dict[str, _Search], left: int, least: float) -> None:
    """Adds, one at a time, the candidate of any kind that saves the most, while one saves more
    than least (FLOPs) and the budget lasts."""
    gains = {k: s.gains() for k, s in searches.items()}
    while left > 0 and gains:
        k = max(gains, key=lambda name: gains[name].max(initial=0.0))
        if gains[k].max(initial=0.0) <= max(least, 0.0):
            return
        searches[k].take(int(gains[k].argmax()))
        gains[k] = searches[k].gains()
        left -= 1


def _kind_report(kt: KindTraffic, chosen: Sequence[Bucket], default: Sequence[Bucket],
                 work: Callable[[Any], int]) -> dict[str, Any]:
    """The kind's padding in FLOPs (work: packing.work_of's; the unit is recorded): packed (per
    bucket) and alone, in the chosen table and the default."""
    return {"requests": len(kt.requests), "concurrency": kt.concurrency, "unit": "flops",
            "packed": padding_of(pack(chosen, kt.requests), work),
            "alone": _summary(padding_of(pack(chosen, kt.requests, alone=True), work)),
            "default_packed": _summary(padding_of(pack(default, kt.requests), work)),
            "default_alone": _summary(padding_of(pack(default, kt.requests, alone=True), work))}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def format_choice(origin: dict[str, Any]) -> str:
    """The printed table: per kind each bucket its batches of the log and their padding."""
    b = origin["budget"]
    lines = [f"bucket table from {origin['log']} (sha256 {origin['log_sha256'][:16]}…, {origin['log_requests']:,} "
             f"requests): {origin['graphs']} buckets (budget {b['max_graphs']}), largest "
             f"{origin['max_activation_bytes'] / 2**20:,.0f} MiB of activations (budget "
             f"{b['max_activation_bytes'] / 2**20:,.0f} MiB)"]
    for kind, k in origin["kinds"].items():
        p = k["packed"]
        lines += ["", f"{kind}: {k['requests']:,} requests in arrival order, packed at most as many a batch as "
                      f"were in flight (p50 {k['concurrency']}): {p['batches']:,} batches",
                  f"  {'bucket':<34}{'batches':>10}{'real TFLOP':>14}{'bucket TFLOP':>14}{'padding':>9}"]
        for row in p["buckets"]:
            pad = (row["padded"] - row["real"]) / row["real"] if row["real"] else None
            lines.append(f"  {row['key']:<34}{row['batches']:>10,}{row['real'] / 1e12:>14,.1f}"
                         f"{row['padded'] / 1e12:>14,.1f}{_pct(pad):>9}")
        lines.append(f"  expected padding (FLOPs): packed {_pct(p['padding'])} (default table {_pct(k['default_packed']['padding'])}),"
                     f" each request alone {_pct(k['alone']['padding'])} (default {_pct(k['default_alone']['padding'])})")
    return "\n".join(lines)


def choose_from_log(path: str, cfg: ModelConfig, limits: ServingLimits, budget: Budget | None = None,
                    quiet: bool = False) -> tuple[BucketTable, dict[str, Any]]:
    """choose_table of the log at path; an unreadable or empty log is a ValueError naming it."""
    try:
        log = traffic.read_log(path)
    except OSError as e:
        raise ValueError(f"--traffic {path}: cannot read it ({e.strerror or e})") from None
    return choose_table(log, cfg, limits, budget, quiet)
