"""No batch grows past what the machine is known to run within the Scheduler's max_batch_s (the
server's: half its SIGTERM grace; issue 32, point 6). On a CPU a Score bucket's cost grows faster
than its FLOPs (about flops^1.7 on the 2-core CI machine: one request of 1,260 tokens 1.2 s, six in
one bucket 30 s), so a batch priced by interpolating FLOPs from small measured buckets once took
longer than the whole grace and SIGTERM lost every request in flight. ServiceTimeModel.bound_s bounds
a bucket by its family's measured ones, quadratically above the largest."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
import torch

from service.runtime.requests import ScoreRequest
from service.sched.admission import AdmissionConfig, Overloaded
from service.sched.batcher import BatcherConfig, Scheduler
from service.sched.cost import BucketInfo
from service.sched.service_time import ServiceTimeModel


@pytest.fixture(scope="module")
def art(embedded_tiny):
    return embedded_tiny[1]


def test_the_bound_is_measured_a_chord_or_quadratic_above_the_largest() -> None:
    model = ServiceTimeModel(quantile=1.0)
    small, large = BucketInfo("s", "score", 1e6), BucketInfo("l", "score", 4e6)
    for batch_id, (info, seconds) in enumerate([(small, 0.1), (large, 0.7)]):
        model.batch_started(batch_id, info, 0.0)
        model.batch_finished(batch_id, info, (0.0, seconds), {1: 1})
    bound = lambda flops: model.bound_s(BucketInfo(f"x{flops}", "score", flops), 1.0)  # noqa: E731
    assert model.bound_s(large, 1.0) == pytest.approx(0.7)
    assert bound(2e6) == pytest.approx(0.3)  # on the chord
    assert bound(0.5e6) == pytest.approx(0.1)  # below the smallest: its time
    assert bound(8e6) == pytest.approx(0.7 * 4)  # twice the largest's flops: 4x its time
    assert model.bound_s(BucketInfo("b", "beam", 1e6), 1.0) is None  # nothing of its family measured
    assert model.bucket_s(BucketInfo("x8", "score", 8e6), 1.0) == pytest.approx(1.4)  # the estimate: linear


class QuadraticRuntime:
    """A Score batch takes K x (its bucket's tokens)^2 seconds: a CPU's cost curve, steeper."""

    name = "quadratic"
    K = 3e-8  # 1,280 tokens: 49 ms; 2,560: 0.2 s; 8,192: 2 s

    def __init__(self) -> None:
        self.buckets: list[Any] = []
        self.num_requests = 0

    def seconds(self, bucket: Any) -> float:
        return self.K * bucket.max_tokens ** 2

    def run_score(self, batch: Any) -> torch.Tensor:
        self.buckets.append(batch.bucket)
        self.num_requests += len(batch.requests)
        time.sleep(self.seconds(batch.bucket))
        return torch.zeros(batch.bucket.max_samples, batch.num_labels)


def _request(rng: random.Random, samples: int, tokens: int, prefix: int) -> ScoreRequest:
    ids = lambda n: tuple(rng.randrange(500) for _ in range(n))  # noqa: E731
    return ScoreRequest(samples=tuple(ids(tokens) for _ in range(samples)), label_ids=(1, 2), prefix_ids=ids(prefix))


def _six_at_once(art: Any, max_batch_s: float) -> QuadraticRuntime:
    """A small request and a 1,260-token one measured alone, then six 1,260-token ones at once."""
    rt, rng = QuadraticRuntime(), random.Random(5)

    async def main() -> None:
        s = Scheduler(art, rt, AdmissionConfig(), BatcherConfig(max_inflight=1, max_wait_s=0.01),
                      max_batch_s=max_batch_s)
        await s.start()
        await s.submit(_request(rng, 3, 4, 6))
        await s.submit(_request(rng, 16, 60, 300))
        await asyncio.gather(*(s.submit(_request(rng, 16, 60, 300)) for _ in range(6)))
        await s.close()

    asyncio.run(main())
    return rt


def test_no_batch_grows_past_the_bound(art) -> None:
    rt = _six_at_once(art, max_batch_s=0.3)
    # two share a bucket (bounded by 4x the one measured alone); once that bucket is measured,
    # slower per request than one alone, the rest go one by one
    assert max(rt.seconds(b) for b in rt.buckets) <= 0.3, [b.key for b in rt.buckets]
    assert rt.num_requests == 8
    # without the bound, the FLOPs' linear estimate lets the six share one bucket of 2 s
    rt = _six_at_once(art, max_batch_s=float("inf"))
    assert max(rt.seconds(b) for b in rt.buckets) > 1.0, [b.key for b in rt.buckets]


def test_a_drain_starts_no_batch_that_would_end_after_its_timeout(art) -> None:
    """Issue 32: a batch that outlasts the grace makes the process exit 1 with its requests unanswered.
    Draining, a batch that would end after the drain's timeout is not started: its requests are
    answered "draining" at once (another replica can serve them in time) and every batch that ran
    ended within the timeout."""
    rt, rng = QuadraticRuntime(), random.Random(6)
    rt.K *= 4  # a 1,260-token request alone: 0.2 s
    ended: list[float] = []
    run_score = rt.run_score
    rt.run_score = lambda batch: (run_score(batch), ended.append(time.monotonic()))[0]  # type: ignore[method-assign]

    async def main() -> tuple[list[Any], float, bool]:
        s = Scheduler(art, rt, AdmissionConfig(), BatcherConfig(max_inflight=1, max_wait_s=0.0), max_batch_s=0.3)
        await s.start()
        await s.submit(_request(rng, 16, 60, 300))  # measured: one alone, 0.2 s (two: 0.8 s, past max_batch_s)
        tasks = [asyncio.ensure_future(s.submit(_request(rng, 16, 60, 300))) for _ in range(4)]
        await asyncio.sleep(0.01)
        end_s = time.monotonic() + 0.5  # room for two of them, not three
        drained = await s.drain(timeout_s=0.5)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await s.close()
        return outcomes, end_s, drained

    outcomes, end_s, drained = asyncio.run(main())
    refused = [o for o in outcomes if isinstance(o, Overloaded)]
    assert drained and 1 <= len(outcomes) - len(refused) <= 3 and refused, outcomes
    assert all(o.reason == "draining" for o in refused)
    assert max(ended) <= end_s + 0.05, (max(ended) - end_s, len(ended))
