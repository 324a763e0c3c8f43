"""Cancellation and expiry reach a batch handed to the executor (issue 32, point 4; the Scheduler's
_Flight in service/sched/batcher.py), on both CPU runtimes (the C++ executor, the Python runtime):

- a heavy BeamSearch cancelled while it runs frees the executor within a node: a small Score sent
  after the cancel, behind it on the one in-flight slot, is answered long before the heavy run
  would have ended;
- a batched request whose deadline passes mid-run gets DeadlineExpired at the deadline, is never
  answered late, and its batch stops;
- stats() counts them: cancelled_in_flight, expired_in_flight, batches_cancelled.

embedded:tiny (Qwen's 151,936-token vocabulary): its BeamSearch is 33 nodes, the five beam steps
the heaviest. A maximal one (beam 400, prompt 512) takes 6-9 s on this repository's 2-core CI
machine, a beam step 1-2 s of it; the heavy one here (beam 64) 1 s on the C++ runtime and 2.5 s on
the Python one, a beam step 15% of that, so the tests stay within seconds. Times are compared with
that run's own, measured in the test, with wide margins (a shared machine)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest
import torch

from service.runtime.requests import BeamRequest, ScoreRequest
from service.sched.admission import AdmissionConfig, DeadlineExpired
from service.sched.batcher import BatcherConfig, Scheduler


@pytest.fixture(scope="module")
def art(embedded_tiny):
    return embedded_tiny[1]


def heavy_beam(art: Any, i: int) -> BeamRequest:
    rng = random.Random(i)
    return BeamRequest(prompt_ids=tuple(rng.randrange(500) for _ in range(512)), beam_width=64,
                       new_tokens=art.limits.max_new_tokens, id=f"beam{i}")


def small_score(i: int) -> ScoreRequest:
    rng = random.Random(i)
    return ScoreRequest(samples=tuple(tuple(rng.randrange(500) for _ in range(4)) for _ in range(3)),
                        label_ids=(1, 2), prefix_ids=tuple(rng.randrange(500) for _ in range(6)), id=f"score{i}")


async def until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the scheduler"
        await asyncio.sleep(0.002)


@pytest.fixture(scope="module")
def full_s(art, cpu_runtime) -> float:
    """The seconds a heavy BeamSearch takes alone on the runtime."""

    async def main() -> float:
        s = await _one_slot(art, cpu_runtime)
        t0 = time.monotonic()
        await s.submit(heavy_beam(art, 1))
        took = time.monotonic() - t0
        await s.close()
        return took

    return asyncio.run(main())


async def _one_slot(art: Any, runtime: Any, **admission: Any) -> Scheduler:
    """A Scheduler with one in-flight slot: a small request waits for the batch that holds it."""
    s = Scheduler(art, runtime, AdmissionConfig(**admission), BatcherConfig(max_inflight=1, max_wait_s=0.0))
    await s.start()
    return s


def test_a_cancelled_heavy_beam_search_frees_the_executor_within_a_node(art, cpu_runtime, full_s):
    """Issue 32: cancelled 1 s into its run, a maximal BeamSearch kept the C++ executor on the CPU
    busy; a small Score sent after it took 16.1 s."""

    async def main() -> None:
        s = await _one_slot(art, cpu_runtime)
        big = asyncio.create_task(s.submit(heavy_beam(art, 2)))
        await until(lambda: s.stats()["batches"] == 1)
        await asyncio.sleep(0.2 * full_s)  # well into its run
        big.cancel()
        t0 = time.monotonic()
        done = await s.submit(small_score(2))
        small_s = time.monotonic() - t0
        with pytest.raises(asyncio.CancelledError):
            await big
        # behind the rest of the big run, it would take >= 0.8 full_s (more, on a loaded machine)
        assert small_s < 0.4 * full_s, (small_s, full_s)
        assert done.result.scores
        stats = s.stats()
        assert (stats["cancelled_in_flight"], stats["batches_cancelled"], stats["expired_in_flight"]) == (1, 1, 0)
        assert stats["cancelled"] == 1 and stats["batches_failed"] == 0
        await s.close()

    asyncio.run(main())


def test_a_batched_request_past_its_deadline_is_answered_deadline_expired_at_it(art, cpu_runtime, full_s):
    """A cold heavy BeamSearch (its bucket not yet measured, so admission tries it) with a deadline
    shorter than its run: DeadlineExpired at the deadline, never its result after it, and the batch,
    left with no member, stops at its next node."""

    async def main() -> None:
        # cold (nothing measured): a deadline shorter than the run is tried, not refused as impossible
        s = await _one_slot(art, cpu_runtime, default_service_s=0.001)
        deadline_s = 0.3 * full_s
        t0 = time.monotonic()
        with pytest.raises(DeadlineExpired, match="could not finish by the deadline"):
            await s.submit(heavy_beam(art, 3), deadline=t0 + deadline_s)
        answered_s = time.monotonic() - t0
        assert s.stats()["batches"] == 1, "it never ran"
        assert deadline_s <= answered_s < deadline_s + max(0.25 * full_s, 0.1), (answered_s, deadline_s, full_s)
        await until(lambda: s.stats()["batches_cancelled"] == 1, 0.5 * full_s + 5)
        t1 = time.monotonic()
        await s.submit(small_score(3))
        assert time.monotonic() - t1 < 0.4 * full_s
        stats = s.stats()
        assert (stats["expired_in_flight"], stats["cancelled_in_flight"], stats["batches_cancelled"]) == (1, 0, 1)
        assert stats["expired"] == 1 and stats["answered_late"] == 0
        await s.close()

    asyncio.run(main())


class _HeldRuntime:
    """A runtime whose batch runs until the test opens the gate (no node boundaries: it cannot stop
    early), then answers zeros."""

    name = "held"

    def __init__(self) -> None:
        self.gate, self.entered = threading.Event(), threading.Event()

    def run_score(self, batch: Any) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(30)
        return torch.zeros(batch.bucket.max_samples, batch.num_labels)


def test_a_result_after_the_deadline_is_never_sent(art):
    """Of two requests in one batch that ends after the first one's deadline: the first gets
    DeadlineExpired at its deadline (the batch goes on for the second), the second its result."""
    rt = _HeldRuntime()

    async def main() -> None:
        s = Scheduler(art, rt, AdmissionConfig(default_service_s=0.001), BatcherConfig(max_wait_s=0.05))
        await s.start()
        t0 = time.monotonic()
        short = asyncio.create_task(s.submit(small_score(1), deadline=t0 + 0.3))
        roomy = asyncio.create_task(s.submit(small_score(2), deadline=t0 + 30))
        try:
            await until(rt.entered.is_set)
            with pytest.raises(DeadlineExpired):
                await asyncio.wait_for(short, 5)
            assert 0.3 <= time.monotonic() - t0 < 1.5
            assert not roomy.done()
        finally:
            rt.gate.set()
        assert (await roomy).result.scores
        stats = s.stats()
        assert stats["batches"] == 1 and stats["expired_in_flight"] == 1 and stats["batches_cancelled"] == 0
        assert stats["answered_late"] == 0
        await s.close()

    asyncio.run(main())
