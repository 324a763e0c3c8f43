"""The bucket table: the bounded static shapes a batch of whole requests is padded to.

Every batch runs in the smallest bucket that holds it; the C++ runtime captures one CUDA graph
per bucket. Padding is masked and never changes a result.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from ..model.config import ConfigError, ModelConfig, ServingLimits


ANY_STEPS = 1 << 30  # a BeamSearch batch's steps totals while no request with a catalog fixes them (BeamBucket)


@dataclass(frozen=True, order=True)
class ScoreBucket:
    """A Score batch's static shape: up to max_tokens rows, packed back to back with its requests
    (each one's prefix, then its samples; padding after the last), up to max_samples samples (the
    LM-head rows) and up to max_requests requests. The segment attention keeps each sample to its
    own rows and its request's prefix, so a request costs its own tokens, not a block's."""

    max_tokens: int  # rows: the packed tokens of all requests, then padding
    max_samples: int  # samples of all requests, i.e. LM-head rows
    max_requests: int = 1

    ZERO: ClassVar[tuple[int, ...]] = (0, 0, 0)  # the totals of an empty batch (Fill)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.max_samples <= 0 or self.max_requests <= 0:
            raise ConfigError(f"score bucket {self}: sizes must be > 0")

    @property
    def key(self) -> str:
        return f"score.t{self.max_tokens}.s{self.max_samples}.r{self.max_requests}"

    def holds(self, num_requests: int, tokens: int, num_samples: int) -> bool:
        """tokens: the packed tokens of all the requests (prefixes and samples)."""
        return num_requests <= self.max_requests and tokens <= self.max_tokens and num_samples <= self.max_samples

    @property
    def reach(self) -> tuple[int, ...]:
        """holds(*totals) implies reach_of(totals) <= reach, each count (Fill's bound on later buckets)."""
        return self.max_requests, self.max_tokens, self.max_samples

    @staticmethod
    def reach_of(totals: tuple[int, ...]) -> tuple[int, ...]:
        return totals

    @staticmethod
    def least_work(totals: tuple[int, ...]) -> int:
        """No bucket of less work holds these totals: its rows are at least their tokens."""
        return totals[1]

    @staticmethod
    def grow(totals: tuple[int, ...], tokens: int, samples: int) -> tuple[int, int, int]:
        """(requests, tokens, samples) of a batch with one more request of these dims."""
        return totals[0] + 1, totals[1] + tokens, totals[2] + samples

    @property
    def rows(self) -> int:
        """The padded work of a batch in this bucket: its token rows."""
        return self.max_tokens

    @property
    def work(self) -> int:
        """As rows (pick_order and the traffic tables compare buckets by their work)."""
        return self.max_tokens


@dataclass(frozen=True, order=True)
class BeamBucket:
    """A BeamSearch batch's static shape. The decode steps run over max_rows packed beam rows: each
    request's own width of rows, back to back, padding after the last (a padding row reads no key
    of any prompt and is never selected). The cheap bookkeeping (beam scores [R, B], sequences
    [R, B, n]) stays rectangular: beam_width B bounds one request's width, and a request narrower
    than B keeps its extra ranks dead (-inf) there; they are no rows of the forward."""

    new_tokens: int  # decode steps: the most any request of the batch generates (one that generates fewer is
    # answered at its own step, beam_hold; a request with a catalog only in a bucket of its own new_tokens)
    max_requests: int
    max_prompt_tokens: int  # packed prompts of all requests
    beam_width: int  # the widest request (the bookkeeping's ranks, the candidates a row keeps)
    max_rows: int  # packed beam rows: the sum of the requests' widths

    ZERO: ClassVar[tuple[int, ...]] = (0, 0, 0, 0, 0, ANY_STEPS)

    def __post_init__(self) -> None:
        if min(self.new_tokens, self.max_requests, self.max_prompt_tokens, self.beam_width, self.max_rows) <= 0:
            raise ConfigError(f"beam bucket {self}: sizes must be > 0")
        if not self.beam_width <= self.max_rows <= self.max_requests * self.beam_width:
            raise ConfigError(f"beam bucket {self}: max_rows must lie in [beam_width, max_requests x beam_width]")

    def holds(self, num_requests: int, prompt_tokens: int, widest: int, rows: int, longest: int,
              steps: int) -> bool:
        """prompt_tokens: the packed prompts of all the requests; widest: their widest beam; rows:
        the sum of their widths; longest: their most new tokens; steps: the most steps the bucket
        may run (a request with a catalog: exactly its new tokens, its trie ends there), ANY_STEPS
        where none has a catalog."""
        return (num_requests <= self.max_requests and prompt_tokens <= self.max_prompt_tokens
                and widest <= self.beam_width and rows <= self.max_rows
                and longest <= self.new_tokens <= steps)

    @property
    def reach(self) -> tuple[int, ...]:
        """holds(*totals) implies reach_of(totals) <= reach, each count (Fill's bound on later buckets)."""
        return (self.max_requests, self.max_prompt_tokens, self.beam_width, self.max_rows, self.new_tokens,
                -self.new_tokens)

    @staticmethod
    def reach_of(totals: tuple[int, ...]) -> tuple[int, ...]:
        return totals[0], totals[1], totals[2], totals[3], totals[4], -totals[5]

    @staticmethod
    def least_work(totals: tuple[int, ...]) -> int:
        """No bucket of less work holds these totals: its rows x steps are at least their rows x longest."""
        return totals[3] * totals[4]

    @staticmethod
    def grow(totals: tuple[int, ...], prompt_tokens: int, width: int, new_tokens: int,
             steps: int) -> tuple[int, int, int, int, int, int]:
        """(requests, prompt tokens, widest, rows, longest, steps) of a batch with one more request
        of these dims (batch.dims: steps is new_tokens for a request with a catalog, else ANY_STEPS)."""
        return (totals[0] + 1, totals[1] + prompt_tokens, max(totals[2], width), totals[3] + width,
                max(totals[4], new_tokens), min(totals[5], steps))

    @property
    def rows(self) -> int:
        """A batch's packed beam rows a decode step."""
        return self.max_rows

    @property
    def work(self) -> int:
        """The padded work of a batch in this bucket: its packed beam rows times its decode steps."""
        return self.max_rows * self.new_tokens

    @property
    def key(self) -> str:
        return (f"beam.n{self.new_tokens}.rows{self.max_rows}.r{self.max_requests}"
                f".p{self.max_prompt_tokens}.b{self.beam_width}")


@dataclass(frozen=True, order=True)
class CodesBucket(BeamBucket):
    """A beam bucket's shape for requests of one catalog normalised over its code tokens
    (BeamRequest.normalization "codes"): the LM head and the beam step over those tokens only. Not
    in the manifest: BucketTable derives one from each beam bucket of the catalog's code length."""

    catalog: str = ""

    @property
    def key(self) -> str:
        return f"{super().key}.codes-{self.catalog}"


Bucket = ScoreBucket | BeamBucket


def codes_kind(new_tokens: int, catalog: str) -> str:
    return f"beam.n{new_tokens}.codes-{catalog}"


def kind_of(bucket: Bucket) -> str:
    """The kind of request a bucket runs: "score", "beam" (BeamSearch of any new_tokens: a batch's
    requests may generate different numbers of tokens), or "beam.n<new_tokens>.codes-<catalog>"
    (CodesBucket); only requests of one kind share a batch."""
    if isinstance(bucket, ScoreBucket):
        return "score"
    if isinstance(bucket, CodesBucket):
        return codes_kind(bucket.new_tokens, bucket.catalog)
    return "beam"


def pick_order(bucket: Bucket) -> tuple[int, ...]:
    """The order buckets are tried in: least padded work first (token rows, then samples; packed
    beam rows times decode steps, then rows, then prompt tokens, then the bookkeeping's width and
    requests). The first that holds a batch is the one it runs in: the default table has every shape
    at every new_tokens, so there a batch runs exactly its longest request's steps."""
    if isinstance(bucket, ScoreBucket):
        return bucket.max_tokens, bucket.max_samples
    return bucket.work, bucket.rows, bucket.max_prompt_tokens, bucket.beam_width, bucket.max_requests


class Fill:
    """The one answer to "which bucket holds these requests": a forming batch's running totals and
    the first bucket of its kind (in pick_order) that holds them. Used by the packer, the batcher,
    the cost table, `slmrank run`'s planner and the traffic report alike.

    Totals only grow, so a bucket that did not hold the batch never holds it again: the search for
    the first that holds goes on from the current one, and from the first bucket of at least the
    totals' least work (pick order is by work first: the buckets before it are too small). A batch
    beyond what every bucket from there on reaches (each count's most over them) is held by none,
    found without a search. Packing a 100,000-request log searched ~165 buckets a request before
    these two bounds.
    dims: (tokens, samples) of a Score request, (prompt tokens, beam width, new tokens, steps) of a
    BeamSearch one (runtime.batch.dims); totals: the bucket type's (ZERO, grow, holds: requests
    first), a tuple of 3 or 6 counts."""

    __slots__ = ("buckets", "totals", "bucket", "index", "reach", "works")

    def __init__(self, buckets: tuple[Bucket, ...]) -> None:
        self.buckets = buckets  # one kind's, in pick_order (BucketTable.of_kind)
        self.totals: tuple[int, ...] = buckets[0].ZERO if buckets else (0,)
        self.bucket: Bucket | None = None
        self.index = 0  # of self.bucket in buckets (0 while empty)
        self.reach, self.works = _bounds(buckets)

    @property
    def count(self) -> int:
        return self.totals[0]

    def _start(self, totals: tuple[int, ...]) -> int:
        """Where the search for these totals' first holder starts: the current bucket, or the first
        of at least their least work if that lies further on."""
        if self.works is None:
            return self.index
        return max(self.index, bisect.bisect_left(self.works, self.buckets[0].least_work(totals)))

    def _beyond(self, totals: tuple[int, ...], index: int) -> bool:
        """No bucket from `index` on holds these totals, by their reach alone."""
        if index >= len(self.buckets):
            return True
        return any(t > r for t, r in zip(self.buckets[0].reach_of(totals), self.reach[index]))

    def fit(self, *dims: int) -> Bucket | None:
        """The bucket the batch would run in with one more request of these dims; None if none holds it."""
        if not self.buckets:
            return None
        totals = self.buckets[0].grow(self.totals, *dims)
        start = self._start(totals)
        if self._beyond(totals, start):
            return None
        for i in range(start, len(self.buckets)):
            if self.buckets[i].holds(*totals):
                return self.buckets[i]
        return None

    def add(self, *dims: int) -> Bucket | None:
        """Adds the request whatever fits; returns the bucket the batch now runs in (None: none)."""
        if self.buckets:
            self.totals = self.buckets[0].grow(self.totals, *dims)
            self.index = self._start(self.totals)
            if self._beyond(self.totals, self.index):
                self.index = len(self.buckets)
        while self.index < len(self.buckets) and not self.buckets[self.index].holds(*self.totals):
            self.index += 1
        self.bucket = self.buckets[self.index] if self.index < len(self.buckets) else None
        return self.bucket


# Fill's bounds, per tuple of buckets (one kind's, in pick order): reach[i] is, count by count, the
# most any of buckets[i:] reaches; works[i] is buckets[i]'s work (None out of pick order). Keyed by
# the tuple's id, the tuple kept with them (so the id is not reused while the entry lives): a few
# tables a process, each kind's tuple made once; the batcher's, the cost table's and the engine's
# threads share them.
_BOUNDS: dict[int, tuple[tuple[Bucket, ...], tuple[list[tuple[int, ...]], list[int] | None]]] = {}
_BOUNDS_KEPT = 64
_BOUNDS_LOCK = threading.Lock()


def _bounds(buckets: tuple[Bucket, ...]) -> tuple[list[tuple[int, ...]], list[int] | None]:
    hit = _BOUNDS.get(id(buckets))
    if hit is not None and hit[0] is buckets:
        return hit[1]
    reach: list[tuple[int, ...]] = [()] * len(buckets)
    most: tuple[int, ...] | None = None
    for i in range(len(buckets) - 1, -1, -1):
        r = buckets[i].reach
        most = r if most is None else tuple(map(max, most, r))
        reach[i] = most
    works: list[int] | None = [b.work for b in buckets]
    if any(a > b for a, b in zip(works, works[1:])):  # type: ignore[arg-type]
        works = None  # not in pick order: the first holder is searched for in the order given
    out = reach, works
    if len(buckets) > 8:  # a table's kind, not a one-off handful (those are cheaper to redo than to keep)
        with _BOUNDS_LOCK:
            if len(_BOUNDS) >= _BOUNDS_KEPT:
                _BOUNDS.pop(next(iter(_BOUNDS)))
            _BOUNDS[id(buckets)] = (buckets, out)
    return out


@dataclass(frozen=True)
class BucketTable:
    score: tuple[ScoreBucket, ...]
    beam: tuple[BeamBucket, ...]
    # (catalog, code length): each has a CodesBucket kind, the beam buckets of its code length again
    # (derived at load: not in the manifest, nor in `beam`)
    codes: tuple[tuple[str, int], ...] = ()
    _kinds: dict[str, tuple[Bucket, ...]] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    def __post_init__(self) -> None:
        if not self.score or not self.beam:
            raise ConfigError("bucket table: needs at least one score and one beam bucket")
        kinds: dict[str, list[Bucket]] = {}
        for b in (*self.score, *self.beam):
            kinds.setdefault(kind_of(b), []).append(b)
        for catalog, length in self.codes:
            kinds[codes_kind(length, catalog)] = [CodesBucket(**dataclasses.asdict(b), catalog=catalog)
                                                  for b in self.beam if b.new_tokens == length]
        self._kinds.update({k: tuple(sorted(bs, key=pick_order)) for k, bs in kinds.items()})

    def of_kind(self, kind: str) -> tuple[Bucket, ...]:
        """One kind's buckets in pick_order ("score", "beam", a codes kind); () for a kind with none."""
        return self._kinds.get(kind, ())

    @property
    def kinds(self) -> dict[str, tuple[Bucket, ...]]:
        return dict(self._kinds)

    def to_dict(self) -> dict[str, Any]:
        return {"score": [dataclasses.asdict(b) for b in self.score],
                "beam": [dataclasses.asdict(b) for b in self.beam]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BucketTable":
        return cls(score=tuple(sorted(ScoreBucket(**b) for b in d["score"])),
                   beam=tuple(sorted(BeamBucket(**b) for b in d["beam"])))

    def fits_one(self, limits: ServingLimits) -> None:
        """Every request within the limits must fit some bucket on its own."""
        if not any(b.holds(1, limits.max_score_tokens, limits.max_samples) for b in self.score):
            raise ConfigError(f"bucket table: no score bucket holds one request of the limits "
                              f"({limits.max_score_tokens} tokens, {limits.max_samples} samples)")
        for n in range(1, limits.max_new_tokens + 1):
            ok = [b for b in self.beam if b.holds(1, limits.max_prompt_tokens, limits.max_beam_width,
                                                  limits.max_beam_width, n, n)]
            if not ok:
                raise ConfigError(f"bucket table: no beam bucket holds a request with new_tokens={n}, "
                                  f"beam_width={limits.max_beam_width}, {limits.max_prompt_tokens} prompt tokens")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return out + [hi]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


# Score token tiers an octave: 8 pads a batch at most 1/8 of its rows above 512 tokens (4.2% on
# average over batches of uniform size, against 8.3% with 4; 2026-12-04 on the H200 a score-mix
# batch ran ~11% slower a token than W1's, whose 7,680 tokens are a tier of their own with 8)
SCORE_STEPS_PER_OCTAVE = 8


def token_tiers(lo: int, hi: int, steps_per_octave: int = SCORE_STEPS_PER_OCTAVE, align: int = 64) -> list[int]:
    """lo, then steps_per_octave tiers an octave, multiples of align, up to hi (included): with 8 a
    step, a batch pads at most 1/8 of its rows above 8 x align tokens, ~1/16 on average."""
    out, octave = {lo, hi}, align
    while octave < hi:
        step = max(align, octave // steps_per_octave)
        out.update(v for v in range(octave, 2 * octave + 1, step) if lo <= v <= hi)
        octave *= 2
    return sorted(out)


def score_buckets(limits: ServingLimits, max_batch_tokens: int = 8192,
                  steps_per_octave: int = SCORE_STEPS_PER_OCTAVE) -> list[ScoreBucket]:
    """Score buckets bounded by total tokens (token_tiers from 64 up to max_batch_tokens), two sample
    tiers each (a sample a 32 tokens, the W1 kind of request; a sample an 8 tokens, short candidates,
    up to 512: the LM-head rows and their float32 log-softmax; never fewer than one request of
    max_samples), and requests (T / 64, 2 to 64)."""
    top = max(max_batch_tokens, limits.max_score_tokens)
    out = []
    for t in token_tiers(min(64, top), top, steps_per_octave):
        r = min(64, max(2, t // 64))
        for s in sorted({_round_up(max(16, t // 32), 16), _round_up(max(limits.max_samples, min(t // 8, 512)), 16)}):
            out.append(ScoreBucket(t, s, r))
    return out


# Beam row tiers an octave above 128 rows: 4 pads a batch at most 1/4 of its rows (at an octave's
# first step, 1/7 at its last; ~10% on average), against 1/3 with the half octaves before: W2's
# 2, 3 and 8 requests (200, 300, 800 rows) ran in 256, 384 and 1024 rows (28% padding of the decode
# GEMMs and LM head) and now run in 224, 320 and 896.
BEAM_ROW_STEPS_PER_OCTAVE = 4


def beam_row_tiers(max_width: int, max_rows: int,
                   steps_per_octave: int = BEAM_ROW_STEPS_PER_OCTAVE) -> list[int]:
    """The packed beam rows of the BeamSearch buckets: 4 and 16 (greedy and narrow requests), half
    octaves 32, 48, 64, 96, 128, then steps_per_octave tiers an octave (multiples of 16) up to
    max_rows, and max_width (one request of the widest beam runs in its own rows)."""
    out = {4, 16, 32, 48, 64, 96, 128, max_width}
    octave = 128
    while octave < max_rows:
        step = max(16, octave // steps_per_octave // 16 * 16)
        out.update(v for v in range(octave, 2 * octave + 1, step) if v <= max_rows)
        octave *= 2
    return sorted(v for v in out if v <= max(max_rows, max_width))


def is_half_octave(rows: int) -> bool:
    """rows is 2^k or 3 x 2^k: the tiers of the wide-width buckets (wide requests are few; their
    row tiers stay half octaves, so the finer steps do not double their graphs)."""
    odd = rows // (rows & -rows)
    return odd in (1, 3)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# The narrowest of the widest-request tiers of a row tier above it: a row keeps as many candidates
# as the bucket's widest request allows (the fused selection sorts and merges that many keys a row),
# so a batch of beams up to this wide (W2's 100, most of beam-mix) does not pay for the limit's 400.
NARROW_BEAM_WIDTH = 128


def beam_width_tiers(max_width: int) -> list[int]:
    """The widest-request tiers of the packed beam buckets: NARROW_BEAM_WIDTH, its octaves below
    max_width, and max_width. Each caps a bucket's requests at about 2 x rows / width, so a batch
    whose widest request sits between two tiers runs in the upper one's rows: with only 128 and 400,
    three beam-mix requests (20-200 wide, 333 rows on average) whose widest passed 128 took a bucket
    of 512 rows and 400 wide; with 256 between, one of 384 rows (expected padding of beam-mix's
    packed batches: 60% -> 28% at 3 a batch, 91% -> 33% at 4; `slmrank build --traffic` reports it)."""
    out, w = {min(NARROW_BEAM_WIDTH, max_width), max_width}, NARROW_BEAM_WIDTH * 2
    while w < max_width:
        out.add(w)
        w *= 2
    return sorted(out)


def beam_buckets(limits: ServingLimits, max_rows: int = 1600, max_requests: int = 8) -> list[BeamBucket]:
    """Per new_tokens, one bucket per (rows tier, widest tier, prompt tier). Rows: beam_row_tiers (at
    most requests x width); the widest request min(rows, NARROW_BEAM_WIDTH), every tier of
    beam_width_tiers below rows (pick_order tries the narrower first), and min(rows, max_beam_width)
    at the half-octave row tiers and max_beam_width; requests rows / 4 in the narrow tier, 2 x rows /
    width in the wider ones (2 to max_requests: the bookkeeping is requests x width ranks, the fused
    selection merges requests x width x width keys). Prompt tokens in octaves from max(128, rows) up to max(max_prompt_tokens,
    4 x rows), at most requests x max_prompt_tokens: a prompt token costs a prefill about what a beam
    row costs a decode step, and prompts run ~1-4 x the beam width (beam-mix: 2.3 on average), so a
    batch of far longer prompts than beams runs in a bucket of more rows rather than in more buckets."""
    out = set()
    middle = beam_width_tiers(limits.max_beam_width)[1:-1]  # between the narrow tier and the limit
    for tier in beam_row_tiers(limits.max_beam_width, max_rows):
        widths = {min(tier, NARROW_BEAM_WIDTH, limits.max_beam_width)} | {w for w in middle if w < tier}
        if is_half_octave(tier) or tier == limits.max_beam_width:
            widths.add(min(tier, limits.max_beam_width))
        for width in widths:
            # narrow: up to a request per 4 rows; wide: about twice the rows' worth of widest requests
            # (the bookkeeping and the merge are requests x width ranks of width keys each: W5's one
            # 400-wide request ran in a bucket of 8 requests and 512 rows at 54.0 req/s, 2026-12-04,
            # against 61.6 in one of 1 request and 400 rows before the packed rows)
            requests = min(max_requests, max(2, tier // 4 if width <= NARROW_BEAM_WIDTH else -(-2 * tier // width)))
            rows = min(tier, requests * width)
            top = min(requests * limits.max_prompt_tokens, max(limits.max_prompt_tokens, _pow2_at_least(4 * rows)))
            prompts, p = {top}, max(128, _pow2_at_least(rows))
            while p < top:
                prompts.add(p)
                p *= 2
            out.update(BeamBucket(n, requests, p, width, rows) for n in range(1, limits.max_new_tokens + 1)
                       for p in prompts)
    return sorted(out)


def _row_values(cfg: ModelConfig) -> int:
    """The live values of one token row in a layer: 2·hidden + 2·q + 2·kv + 3·intermediate."""
    return 2 * cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size


def activation_bytes(bucket: Bucket, cfg: ModelConfig, elem: int = 2, dense_attention: bool = False) -> int:
    """The activation memory of a batch of this bucket with elem-byte activations (2: bfloat16, on a
    GPU; 4: float32), the operator's formula of `slmrank build --max-activation-mib`: a Score
    bucket of T tokens and S samples elem·T·A + (elem + 4)·S·V; a BeamSearch bucket of N packed
    rows, P prompt tokens and n new tokens elem·P·(A + 2·L·kv) + N·(elem·A + (elem + 4)·V +
    2·elem·L·n·kv), with A the live values of a token row in a layer (_row_values), L layers, kv
    = kv heads x head dim, V the vocabulary (or a classification head's labels).

    dense_attention: the ATen path (the CPU's). Its attention holds float32 scores and
    probabilities for every query row against every key of the batch, with a boolean mask or two
    of the same size: 4 x 4·H·Q·K + 4·Q·K bytes (H heads) for Q x K = T x T (Score), P x P (the
    prompts) and N x P (a decode step); its beam step keeps four float32 copies of a row's
    V logits (logits, log-softmax, plus the beam score, padded: 16·V bytes a row) and one per rank
    of the R x B bookkeeping (gathered per request: 4·V), and its Score head three (12·V a sample). On the CPU a Score batch of 8,192 tokens of embedded:tiny
    (4 heads) grew the peak RSS by 3.3 GiB (Python runtime) and 4.3 GiB (C++) where the rest of
    the formula says 0.35: tests/service/test_batch_memory.py measures it."""
    a = _row_values(cfg)
    head = cfg.num_labels if cfg.has_cls_head else cfg.vocab_size

    def dense(q: int, k: int) -> int:
        return (16 * cfg.num_heads + 4) * q * k if dense_attention else 0

    if isinstance(bucket, ScoreBucket):
        per_sample = 12 if dense_attention else elem + 4
        return elem * bucket.max_tokens * a + bucket.max_samples * head * per_sample + dense(bucket.max_tokens,
                                                                                           bucket.max_tokens)
    p, n = bucket.max_prompt_tokens, bucket.max_rows
    per_row = 16 if dense_attention else elem + 4
    ranks = 4 * head * bucket.max_requests * bucket.beam_width if dense_attention else 0
    step = elem * a + head * per_row + 2 * cfg.num_layers * bucket.new_tokens * cfg.kv_size * elem
    return elem * p * (a + 2 * cfg.num_layers * cfg.kv_size) + n * step + ranks + max(dense(p, p), dense(n, p))


def default_bucket_table(limits: ServingLimits, max_batch_tokens: int = 8192,
                         max_beam_rows: int = 1600) -> BucketTable:
    """Score: score_buckets (eighth-octave token tiers up to max_batch_tokens; padding < 1/8 above 512).
    BeamSearch: beam_buckets (half-octave packed-row tiers up to max_beam_rows, octave prompt tiers)."""
    table = BucketTable(tuple(sorted(score_buckets(limits, max_batch_tokens))),
                        tuple(sorted(beam_buckets(limits, max_beam_rows))))
    table.fits_one(limits)
    return table
