"""What a request costs the executor: the buckets it can run in, and the logical FLOPs of each.

A batch runs in a bucket (static shapes), so its time is its bucket's time, shared by the whole
requests batched into it. Per request shape (cached; the shapes are few):

  solo      the bucket the request runs in alone (the batcher's pick for [request])
  packings  (n, bucket) for n = 1, 2, 4, ... copies of the request: the bucket n of them fill.
            With n of its kind batched together, a request's share of the executor is
            bucket_s / n; admission counts queued work (and a client's fairness cost) in these
            shares, in seconds.

BucketInfo.flops is a bucket's logical FLOPs at full occupancy: the axis along which
ServiceTimeModel interpolates the time of a bucket it has not measured yet.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..artifact.artifact import Artifact
from ..artifact.buckets import Bucket, Fill, ScoreBucket
from ..model.config import ModelConfig
from ..model.flops import beam_flops, score_flops
from ..runtime.batch import dims
from ..runtime.batch import kind as request_kind  # re-exported: the batcher and the benches key tickets by it
from ..runtime.requests import BeamRequest, ScoreRequest

Request = ScoreRequest | BeamRequest


@dataclass(frozen=True)
class BucketInfo:
    key: str  # the bucket's key ("score.t1280.s48.r20", "beam.n3.rows128.r8.p128.b128", ...)
    family: str  # "score" or "beam": buckets whose times lie on one curve over flops
    flops: float  # logical FLOPs of the bucket when full


@dataclass(frozen=True)
class RequestCost:
    kind: str
    solo: BucketInfo
    packings: tuple[tuple[int, BucketInfo], ...]  # (n copies, the bucket they fill), n = 1, 2, 4, ...


def bucket_flops(cfg: ModelConfig, bucket: Bucket) -> float:
    """A full bucket as its rows would be used: T tokens as samples of 64 (Score, a W1 sample; the
    attention part is small beside the linear layers at these lengths); R requests with P/R prompt
    tokens and max_rows/R beams each, new_tokens steps (BeamSearch: the packed rows are the sum of
    the widths)."""
    if isinstance(bucket, ScoreBucket):
        lens = [64] * (bucket.max_tokens // 64) + ([bucket.max_tokens % 64] if bucket.max_tokens % 64 else [])
        return float(score_flops(cfg, 0, lens))
    r = bucket.max_requests
    prompt = max(bucket.max_prompt_tokens // r, 1)
    return float(sum(beam_flops(cfg, prompt, width, bucket.new_tokens) for width in _shares(bucket.max_rows, r)))


def _shares(total: int, n: int) -> list[int]:
    """total split into n near-equal non-negative parts."""
    return [total // n + (i < total % n) for i in range(n)]


class CostTable:
    """RequestCost of a request, by its shape (cached, at most `max_shapes` kept)."""

    def __init__(self, artifact: Artifact, max_batch_requests: int, max_shapes: int = 4096) -> None:
        self.artifact, self.cfg = artifact, artifact.config
        self.max_batch_requests = max_batch_requests
        self.max_shapes = max_shapes
        self._shapes: OrderedDict[tuple, RequestCost] = OrderedDict()
        self._infos: dict[str, BucketInfo] = {}

    def info(self, bucket: Bucket) -> BucketInfo:
        info = self._infos.get(bucket.key)
        if info is None:
            family = "score" if isinstance(bucket, ScoreBucket) else "beam"
            info = self._infos[bucket.key] = BucketInfo(bucket.key, family, bucket_flops(self.cfg, bucket))
        return info

    def of(self, request: Request) -> RequestCost:
        """Raises ValueError for a request no bucket holds (an unvalidated one)."""
        if isinstance(request, ScoreRequest):
            shape: tuple = ("score", request.num_tokens, request.num_samples)
        else:
            shape = ("beam", request.new_tokens, len(request.prompt_ids), request.beam_width)
        cost = self._shapes.get(shape)
        if cost is None:
            cost = self._shapes[shape] = self._compute(request)
            if len(self._shapes) > self.max_shapes:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(shape)
        return cost

    def _compute(self, request: Request) -> RequestCost:
        fill, d = Fill(self.artifact.buckets.of_kind(request_kind(request))), dims(request)
        packings: list[tuple[int, BucketInfo]] = []
        n = 1
        while n <= self.max_batch_requests:
            while fill.count < n and fill.add(*d) is not None:
                pass
            if fill.count < n or fill.bucket is None:
                break
            packings.append((n, self.info(fill.bucket)))
            n *= 2
        if not packings:
            raise ValueError(f"no bucket holds this {request_kind(request)} request")
        return RequestCost(request_kind(request), packings[0][1], tuple(packings))
