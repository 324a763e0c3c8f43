"""ops/bench/loop_cost.py --instant: the load instrument that takes the executor's time out of slmrank's
server. Its runtime must run each bucket for real once and answer every later batch of that bucket
from a worker thread through the loop, with the first batch's outputs."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ops.bench import loop_cost
from service.runtime.batch import pack_score, pick_score_bucket
from service.runtime.requests import ScoreRequest
from service.runtime.timings import BatchTimings


class Counting:
    """The real C++ runtime, counting the batches it runs."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ran = inner, []

    def run_score(self, batch: Any) -> torch.Tensor:
        self.ran.append(batch.bucket.key)
        return self.inner.run_score(batch)

    def __getattr__(self, name: str) -> Any:  # last_timings, num_lanes, ...: the runtime's
        return getattr(self.inner, name)


def test_instant_runtime_runs_a_bucket_once_then_answers_at_once(embedded_tiny):
    from service.runtime.cpp_runtime import CppRuntime

    art = embedded_tiny[1]
    real = CppRuntime(art)
    counting = Counting(real)
    instant = loop_cost.InstantRuntime(counting)
    first_reqs = [ScoreRequest(samples=((5, 6, 7), (8, 9)), label_ids=(1, 2))]
    later_reqs = [ScoreRequest(samples=((11, 12, 13), (14,)), label_ids=(1, 2))]
    bucket = pick_score_bucket(art.buckets, first_reqs)
    assert pick_score_bucket(art.buckets, later_reqs) == bucket

    async def run() -> tuple[Any, Any]:
        first = await instant.submit(pack_score(first_reqs, bucket, art.label_columns))
        later = await instant.submit(pack_score(later_reqs, bucket, art.label_columns))
        return first, later

    try:
        (first_out, first_t), (later_out, later_t) = asyncio.run(run())
        assert counting.ran == [bucket.key]  # the bucket ran once, for real
        expected = real.run_score(pack_score(first_reqs, bucket, art.label_columns))
        assert torch.equal(first_out[0], expected)  # the real outputs of the first batch...
        assert torch.equal(later_out[0], expected)  # ...are the answer of every later one
        assert type(later_t) is type(first_t) is BatchTimings
        assert later_t.submit_ns <= later_t.start_ns == later_t.done_ns  # no executor time
        assert later_t.nodes == first_t.nodes and later_t.nodes  # the real run's node timings
        assert instant.num_lanes == real.num_lanes  # the rest is the runtime's own
    finally:
        real.shutdown()
