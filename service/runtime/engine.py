"""Whole requests in, results out: validation, batching into buckets, a runtime, unpacking.

Used by `slmrank run`; the gRPC batcher forms batches with the same bucket rules.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Union

import torch

from ..artifact.artifact import Artifact
from ..artifact.buckets import Fill
from .batch import (BeamBatch, ScoreBatch, dims, kind, pack_beam, pack_score, pick_beam_bucket, pick_score_bucket,
                    unpack_beam, unpack_score)
from .requests import (BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult,
                       validate_beam, validate_score)

Request = Union[ScoreRequest, BeamRequest]
Result = Union[ScoreResult, BeamResult, RequestError, ExecutionError]


class Runtime(Protocol):
    name: str

    def run_score(self, batch: ScoreBatch) -> torch.Tensor: ...

    def run_beam(self, batch: BeamBatch) -> tuple[torch.Tensor, torch.Tensor]: ...


def validate(artifact: Artifact, req: Request) -> None:
    if isinstance(req, ScoreRequest):
        validate_score(req, artifact.config, artifact.limits)
    else:
        validate_beam(req, artifact.config, artifact.limits, catalogs=artifact.catalog_lengths)


def plan_batches(artifact: Artifact, requests: Sequence[Request], max_requests: int | None = None) -> list[list[int]]:
    """Greedy, in order: consecutive requests of one kind (and one new_tokens) share a batch while
    some bucket holds them all (buckets.Fill), and (if given) while the batch has fewer than
    max_requests. Returns lists of indices into requests. Never splits a request."""
    batches: list[list[int]] = []
    current: list[int] = []
    fill: Fill | None = None
    for i, req in enumerate(requests):
        if (current and kind(req) == kind(requests[current[0]]) and fill is not None and fill.fit(*dims(req))
                and (max_requests is None or len(current) < max_requests)):
            fill.add(*dims(req))
            current.append(i)
            continue
        if current:
            batches.append(current)
        current, fill = [i], Fill(artifact.buckets.of_kind(kind(req)))
        fill.add(*dims(req))
    if current:
        batches.append(current)
    return batches


def execute(artifact: Artifact, runtime: Runtime, requests: Sequence[Request]) -> list[Result]:
    """Validates every request, runs the valid ones in batches, and answers each in order.

    A bad request is answered with its RequestError; a failing batch with an ExecutionError."""
    results: list[Result | None] = [None] * len(requests)
    valid: list[int] = []
    for i, req in enumerate(requests):
        try:
            validate(artifact, req)
            valid.append(i)
        except RequestError as e:
            results[i] = e
    for batch_idx in plan_batches(artifact, [requests[i] for i in valid]):
        idx = [valid[j] for j in batch_idx]
        reqs = [requests[i] for i in idx]
        try:
            if isinstance(reqs[0], ScoreRequest):
                out: list = run_score_requests(artifact, runtime, reqs)  # type: ignore[arg-type]
            else:
                out = run_beam_requests(artifact, runtime, reqs)  # type: ignore[arg-type]
        except Exception as e:  # one failed batch answers its own requests with the error, and only those
            out = [ExecutionError(f"batch of {len(reqs)} request(s) failed: {e}")] * len(reqs)
        for i, res in zip(idx, out):
            results[i] = res
    return results  # type: ignore[return-value]


def run_score_requests(artifact: Artifact, runtime: Runtime, reqs: list[ScoreRequest]) -> list[ScoreResult]:
    bucket = pick_score_bucket(artifact.buckets, reqs)
    assert bucket is not None, "plan_batches only forms batches that fit a bucket"
    # label columns are padded to max_labels; a classification head reads no labels
    label_columns = artifact.label_columns
    batch = pack_score(reqs, bucket, label_columns)
    return unpack_score(batch, runtime.run_score(batch))


def run_beam_requests(artifact: Artifact, runtime: Runtime, reqs: list[BeamRequest]) -> list[BeamResult]:
    bucket = pick_beam_bucket(artifact.buckets, reqs)
    assert bucket is not None, "plan_batches only forms batches that fit a bucket"
    batch = pack_beam(reqs, bucket, artifact.catalogs)
    seqs, scores = runtime.run_beam(batch)
    return unpack_beam(batch, seqs, scores)
