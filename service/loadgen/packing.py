"""Replaying a log's requests into batches: in arrival order, as many a batch as some bucket holds
(buckets.Fill) and as were in flight as its first arrived, each batch in its bucket. What
`slmrank build --traffic` minimises (tiers.py: in logical FLOPs of the linear layers and the LM
head) and what `slmrank traffic` reports of a table (traffic.py: in rows): the padded work of those
batches against the requests' own, in the unit of the caller's `work` and requests' real work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..artifact.buckets import BeamBucket, Bucket, Fill, ScoreBucket, pick_order
from ..model.config import ModelConfig
from ..model.flops import head_flops, linear_flops_per_token

FLOOR_ROWS = 128  # a forward pass of fewer rows costs as much as one of these (tiers.py's docstring)

Request = tuple[tuple[int, ...], int, int]  # dims, real work, requests of its kind in flight as it arrived


@dataclass
class Batch:
    """The batches of one totals: the bucket Fill runs them in, how many, their real work."""

    bucket: Bucket
    count: int = 0
    real: int = 0


Batches = dict[tuple, Batch]  # by the batch's totals (Fill.totals)


def pack(buckets: Sequence[Bucket], requests: Sequence[Request], alone: bool = False) -> Batches:
    """requests in arrival order, into batches of consecutive requests: as many as some bucket
    holds (Fill) and fewer than were in flight as the batch's first arrived (alone: one)."""
    out: Batches = {}
    ordered = tuple(sorted(buckets, key=pick_order))
    fill, real, cap = Fill(ordered), 0, 1

    def close() -> None:
        batch = out.setdefault(fill.totals, Batch(fill.bucket))  # type: ignore[arg-type]
        batch.count += 1
        batch.real += real

    for d, rows, in_flight in requests:
        if fill.count and (fill.count >= cap or fill.fit(*d) is None):
            close()
            fill, real = Fill(ordered), 0
        if not fill.count:
            cap = 1 if alone else in_flight
        fill.add(*d)
        real += rows
    if fill.count:
        close()
    return out


def rows_of(bucket: Bucket) -> int:
    """A bucket's padded rows: Score token rows; BeamSearch beam rows times decode steps."""
    return bucket.work


def padding_of(batches: Batches, work: Callable[[Bucket], int] = rows_of) -> dict[str, Any]:
    """Per bucket its batches, their real work and the bucket's (work: a bucket's, in the unit of
    the requests' real work); and the totals."""
    per: dict[Bucket, list[int]] = {}
    for batch in batches.values():
        slot = per.setdefault(batch.bucket, [0, 0, 0])
        slot[0] += batch.count
        slot[1] += batch.real
        slot[2] += batch.count * work(batch.bucket)
    real = sum(v[1] for v in per.values())
    padded = sum(v[2] for v in per.values())
    return {"batches": sum(v[0] for v in per.values()), "real": real, "padded": padded,
            "padding": round((padded - real) / real, 4) if real else None,
            "buckets": [{"key": b.key, "batches": v[0], "real": v[1], "padded": v[2]}
                        for b, v in sorted(per.items(), key=lambda bv: pick_order(bv[0]))]}


def work_of(kind: str, cfg: ModelConfig) -> tuple[Callable[[Any], int], Callable[[tuple[int, ...]], int]]:
    """(a bucket's work, a request's real work from its dims: batch.dims) in the FLOPs that
    `slmrank build --traffic` minimises (tiers.py's docstring): t a token row through the layers'
    linear maps, h an LM-head row, a forward pass of at least FLOOR_ROWS rows."""
    t, h, f = linear_flops_per_token(cfg), head_flops(cfg), FLOOR_ROWS
    if kind == "score":
        def score(b: ScoreBucket) -> int:
            return max(b.max_tokens, f) * t + b.max_samples * h

        return score, lambda d: d[0] * t + d[1] * h  # d: (tokens, samples)

    def beam(b: BeamBucket) -> int:  # the prefill, the first token's head a request, n - 1 decode steps
        return max(b.max_prompt_tokens, f) * t + b.max_requests * h + max(b.max_rows, f) * (b.new_tokens - 1) * (t + h)

    return beam, lambda d: d[0] * t + h + d[1] * (d[2] - 1) * (t + h)  # d: (prompt, width, new tokens, steps)
