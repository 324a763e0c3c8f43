"""The scheduler on embedded:tiny: concurrent whole requests batched into buckets give exactly the
results of `engine.execute` on the same batches; and, on a fake runtime that can be held, the
release rules, in-flight cap, priority order, cancellation, deadlines, failures and draining."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from typing import Any

import pytest
import torch

from service.sched.admission import AdmissionConfig, DeadlineUnmeetable, Overloaded, Priority, Ticket
from service.runtime.batch import BeamBatch, ScoreBatch
from service.observe.records import Completed
from service.sched.batcher import BatcherConfig, DeadlineExpired, Scheduler
from service.runtime.engine import execute
from service.runtime.requests import BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult
from service.runtime.timings import BatchTimings, NodeTiming

O, N, B = Priority.ONLINE, Priority.NORMAL, Priority.BACKGROUND


@pytest.fixture(scope="module")
def art(embedded_tiny):
    return embedded_tiny[1]


def ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def score(name: str, samples: int = 2, tokens: int = 4) -> ScoreRequest:
    return ScoreRequest(samples=tuple((7 + i,) * tokens for i in range(samples)), label_ids=(1, 2), id=name)


def beam(name: str, new_tokens: int = 1, width: int = 2) -> BeamRequest:
    return BeamRequest(prompt_ids=(5, 6, 7), beam_width=width, new_tokens=new_tokens, id=name)


async def until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the scheduler"
        await asyncio.sleep(0.002)


class FakeRuntime:
    """Zeros of the right shapes; records what ran; can be held (gate) or made to fail."""

    name = "fake"

    def __init__(self, delay_s: float = 0.0, fail_ids: tuple[str, ...] = ()) -> None:
        self.delay_s, self.fail_ids = delay_s, fail_ids
        self.gate = threading.Event()
        self.gate.set()
        self.started: list[list[str]] = []  # request ids per batch, as each batch starts

    def _enter(self, batch: ScoreBatch | BeamBatch) -> None:
        names = [r.id for r in batch.requests]
        self.started.append(names)
        if any(n in self.fail_ids for n in names):
            raise RuntimeError("injected failure")
        assert self.gate.wait(10)
        time.sleep(self.delay_s)

    def run_score(self, batch: ScoreBatch) -> torch.Tensor:
        self._enter(batch)
        return torch.full((batch.bucket.max_samples, batch.num_labels), -1.5)

    def run_beam(self, batch: BeamBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self._enter(batch)
        b = batch.bucket
        return (torch.zeros(b.max_requests, b.beam_width, b.new_tokens, dtype=torch.int64),
                torch.zeros(b.max_requests, b.beam_width))

    @property
    def ran(self) -> list[str]:
        return [n for names in self.started for n in names]


class FakeSubmitRuntime(FakeRuntime):
    """The C++ runtime's shape: submit(batch) -> a future the test resolves, oldest first."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[Any, asyncio.Future, int]] = []
        self.submitted_s: list[float] = []  # time.monotonic() of each submit

    def submit(self, batch):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((batch, fut, time.monotonic_ns()))
        self.submitted_s.append(time.monotonic())
        return fut

    def finish_oldest(self) -> None:
        batch, fut, submit_ns = self.pending.pop(0)
        start_ns = time.monotonic_ns()
        out = [self.run_score(batch)] if isinstance(batch, ScoreBatch) else list(self.run_beam(batch))
        fut.set_result((out, BatchTimings.host(submit_ns, start_ns, time.monotonic_ns(),
                                               (NodeTiming("fake", 0.1, 0.05),))))


async def finish_all(s: Scheduler, rt: FakeSubmitRuntime, tasks: list[asyncio.Task]) -> None:
    """Answers the submitted batches, oldest first, until every task is done; then closes s."""
    while not all(t.done() for t in tasks):
        if rt.pending:
            rt.finish_oldest()
        await asyncio.sleep(0.005)
    await s.close()


async def started(art, runtime, admission: AdmissionConfig | None = None, **batcher) -> Scheduler:
    s = Scheduler(art, runtime, admission, BatcherConfig(**batcher))
    await s.start()
    return s


# ---- against the reference engine ---------------------------------------------------------------

def test_concurrent_requests_are_batched_and_equal_execute_exactly(art, cpu_runtime):
    runtime = cpu_runtime
    kind = runtime.name
    rng = random.Random(7)
    vocab = art.config.vocab_size
    scores = [ScoreRequest(samples=tuple(ids(rng, rng.randint(1, 8), vocab) for _ in range(rng.randint(1, 4))),
                           label_ids=ids(rng, rng.randint(1, 4), vocab),
                           prefix_ids=ids(rng, rng.randint(1, 6), vocab) if i % 2 else (), id=f"s{i}")
              for i in range(6)]
    beams = [BeamRequest(ids(rng, rng.randint(3, 9), vocab), beam_width=w, new_tokens=n, id=f"b{i}")
             for i, (w, n) in enumerate([(3, 2), (1, 2), (2, 1)])]
    reqs = scores + beams
    priorities = [O, N, B, N, O, B, N, B, O]

    async def main() -> tuple[list[Completed], dict]:
        s = await started(art, runtime, max_wait_s=0.05)
        done = await asyncio.gather(*[s.submit(r, p) for r, p in zip(reqs, priorities)])
        assert await s.drain(timeout_s=30)
        await s.close()
        return done, s.stats()

    t0 = time.perf_counter()
    done, stats = asyncio.run(main())
    wall_s = time.perf_counter() - t0

    batches: dict[int, list[tuple[int, Any, Completed]]] = {}
    for r, c in zip(reqs, done):
        batches.setdefault(c.timings.batch_id, []).append((c.timings.batch_index, r, c))
    assert len(batches) == 2, "one batch per kind: score, and beam (n=2 and n=1 in one batch of 2 steps)"
    assert stats["batches"] == 2 and stats["requests_executed"] == len(reqs)
    assert stats["batch_sizes"] == {3: 1, 6: 1}
    for members in batches.values():
        members.sort(key=lambda m: m[0])
        assert [m[0] for m in members] == list(range(len(members)))
        same = execute(art, runtime, [r for _, r, _ in members])  # the same batch, the same bucket
        for (_, r, c), want in zip(members, same):
            assert type(c.result) is type(want) and c.result == want, f"{r.id}: differs from engine.execute"
            t = c.timings
            assert t.batch_size == len(members) and t.bucket.startswith(("score", "beam"))
            assert t.enqueued_s <= t.dequeued_s <= t.batch_start_s <= t.batch_end_s
            ex = t.executor
            assert type(ex) is BatchTimings and ex.submit_ns <= ex.start_ns <= ex.done_ns
            assert (ex.done_ns - ex.start_ns) / 1e9 <= t.batch_end_s - t.batch_start_s + 1e-3
            dag = art.score_dag if isinstance(c.result, ScoreResult) else art.beam_dag
            assert [n.name for n in ex.nodes][:2] == [n.name for n in dag][:2] == ["masks", dag[1].name]
    assert isinstance(done[0].result, ScoreResult) and isinstance(done[-1].result, BeamResult)
    assert 0 < stats["occupancy_mean"] <= 1
    assert stats["model"]["batches_observed"] == 2
    assert sum(key.startswith("beam.n2.") for key in stats["model"]["bucket_s"]) == 1
    print(f"\n{kind}: 9 requests in 2 batches, {wall_s:.2f} s")


# ---- release rules ----------------------------------------------------------------------------------

def test_a_batch_waits_for_max_wait_unless_it_is_full(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.3)
        t0 = time.monotonic()
        lone = asyncio.create_task(s.submit(score("lone")))
        await asyncio.sleep(0.1)
        assert rt.started == [], "released before max_wait with room left in the bucket"
        await lone
        assert time.monotonic() - t0 >= 0.29
        await s.close()

        # max_wait too long to matter: only a full batch goes; drain() releases the rest at once
        s = await started(art, rt, max_wait_s=60.0, max_batch_requests=3)
        four = [asyncio.create_task(s.submit(score(f"q{i}"))) for i in range(4)]
        await until(lambda: len(rt.started) == 2)  # the cap reached
        assert rt.started[1] == ["q0", "q1", "q2"]
        await asyncio.sleep(0.05)
        assert len(rt.started) == 2
        assert await s.drain(timeout_s=10)
        await asyncio.gather(*four)
        assert rt.started[2] == ["q3"]
        await s.close()

        # the bucket full: 4 requests of 2048 tokens fill the largest score bucket (8,192 tokens); the fifth is left out
        s = await started(art, rt, max_wait_s=60.0)
        big = [ScoreRequest(samples=((9,) * 128,) * 16, label_ids=(1,), id=f"big{i}") for i in range(5)]
        tasks = [asyncio.create_task(s.submit(r)) for r in big]
        await until(lambda: len(rt.started) == 4)
        assert rt.started[3] == ["big0", "big1", "big2", "big3"]
        assert await s.drain(timeout_s=10)
        await asyncio.gather(*tasks)
        assert rt.started[4] == ["big4"]
        assert s.stats()["buckets"] == {"score.t8192.s256.r64": {"batches": 1, "occupancy_mean": 1.0},
                                        "score.t2048.s64.r32": {"batches": 1, "occupancy_mean": 1.0}}
        await s.close()

        # exactly the cap waiting and nothing behind it: full, it goes without waiting max_wait
        s = await started(art, rt, max_wait_s=60.0, max_batch_requests=3)
        three = [asyncio.create_task(s.submit(score(f"e{i}"))) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*three), 10)
        assert rt.started[-1] == ["e0", "e1", "e2"]
        await s.close()

    asyncio.run(main())


def test_kinds_never_share_a_batch_and_the_inflight_cap_holds(art):
    rt = FakeSubmitRuntime()

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=2)
        tasks = [asyncio.create_task(s.submit(r)) for r in
                 [score("s0"), beam("b1", new_tokens=1), beam("b2", new_tokens=2), score("s1")]]
        await until(lambda: len(rt.pending) == 2)
        tasks.append(asyncio.create_task(s.submit(beam("b3", new_tokens=2))))  # a third batch: it must wait
        await asyncio.sleep(0.05)
        assert len(rt.pending) == 2 and s.stats()["inflight"] == 2, "more than max_inflight handed over"
        rt.finish_oldest()
        await until(lambda: len(rt.pending) == 2)
        while rt.pending:
            rt.finish_oldest()
            await asyncio.sleep(0.01)
        done = await asyncio.gather(*tasks)
        # BeamSearch requests of different new_tokens are one kind: b1 (1 token) and b2 (2) share a batch
        kind_of = {"s0": "score", "s1": "score", "b1": "beam", "b2": "beam", "b3": "beam"}
        assert rt.started == [["s0", "s1"], ["b1", "b2"], ["b3"]]
        assert all(len({kind_of[n] for n in names}) == 1 for names in rt.started)
        assert done[1].timings.executor.nodes == (NodeTiming("fake", 0.1, 0.05),)
        assert s.stats()["inflight"] == 0 and s.stats()["batches"] == len(rt.started)
        await s.close()

    asyncio.run(main())


def test_priority_order_through_the_scheduler(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=1)
        rt.gate.clear()
        first = asyncio.create_task(s.submit(score("first")))
        await until(lambda: len(rt.started) == 1)
        # queued while the executor is held; one kind (BeamSearch of any new_tokens), taken in priority order
        tasks = [asyncio.create_task(s.submit(r, p)) for r, p in
                 [(beam("bg", 1), B), (beam("nm", 2), N), (beam("on", 3), O)]]
        await until(lambda: s.stats()["admitted"] == 4)
        rt.gate.set()
        await asyncio.gather(first, *tasks)
        assert rt.ran == ["first", "on", "nm", "bg"]
        await s.close()

    asyncio.run(main())


class KindRuntime(FakeRuntime):
    """BeamSearch batches take beam_s, Score batches score_s; records (id, start, end) per batch."""

    def __init__(self, beam_s: float, score_s: float) -> None:
        super().__init__()
        self.beam_s, self.score_s = beam_s, score_s
        self.spans: list[tuple[str, float, float]] = []
        self.began: list[str] = []  # the first request id of each batch, as it begins (started: as it ends)

    def run_score(self, batch: ScoreBatch) -> torch.Tensor:
        self.began.append(batch.requests[0].id)
        t0 = time.monotonic()
        time.sleep(self.score_s)
        self.spans.append((batch.requests[0].id, t0, time.monotonic()))
        return super().run_score(batch)

    def run_beam(self, batch: BeamBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.began.append(batch.requests[0].id)
        t0 = time.monotonic()
        time.sleep(self.beam_s)
        self.spans.append((batch.requests[0].id, t0, time.monotonic()))
        return super().run_beam(batch)


@pytest.mark.parametrize("beam_s, score_s, light_within_s", [
    (0.4, 0.01, 0.2),  # a Score under heavy_batch_s
    # over heavy_batch_s (a slow CPU host's small Score), heavy on its own; beside a BeamSearch over
    # HEAVY_GAP times as long it is the light work the last slot is kept for (before: it waited for the
    # whole BeamSearch, 1.67 s here at 0.8 s; 0.1-1.1 s stalls of the light client of test_overload's
    # fairness test)
    (1.2, 0.12, 0.5),
])
def test_heavy_batches_leave_the_last_slot_to_light_work(art, beam_s, score_s, light_within_s):
    from service.sched.batcher import HEAVY_GAP

    rt = KindRuntime(beam_s=beam_s, score_s=score_s)
    assert rt.score_s < rt.beam_s / HEAVY_GAP

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=2, heavy_batch_s=0.1, heavy_ratio=0.0)
        # the rule, not the host: a batch that a busy CI host starved is kept at its time x its CPU share
        # (ServiceTimeModel): a BeamSearch kept at half its time would make the Score heavy beside it
        # again (the likely cause of a 0.88 s wait in a clean-clone run of the whole suite, 2026-12-07)
        s.model.host = None
        await s.submit(beam("warm-beam", new_tokens=1))  # measured: heavy
        await s.submit(beam("warm-beam2", new_tokens=2))
        await s.submit(score("warm-score"))
        heavy_before = sum(s.stats()["heavy_batches"].values())
        # a heavy batch, then a second one (submitted while the first runs: its own batch), then a light request
        heavy = [asyncio.create_task(s.submit(beam("b1", new_tokens=1)))]
        await until(lambda: "b1" in rt.began)
        heavy.append(asyncio.create_task(s.submit(beam("b2", new_tokens=2))))
        await asyncio.sleep(0.05)
        assert "b2" not in rt.began, "a second heavy batch took the last slot"
        t0 = time.monotonic()
        await s.submit(score("light"))
        waited = time.monotonic() - t0
        assert waited < light_within_s, f"the light request waited {waited:.2f} s behind a heavy batch"
        await asyncio.gather(*heavy)
        spans = {name: (a, b) for name, a, b in rt.spans}
        assert spans["b2"][0] >= spans["b1"][1] - 0.01  # the heavy batches one at a time
        assert spans["light"][1] < spans["b1"][1]  # beside the first
        assert sum(s.stats()["heavy_batches"].values()) == heavy_before + 2  # b1 and b2, not the Score
        await s.close()

    asyncio.run(main())


@pytest.mark.parametrize("heavy_ratio, light_window_s, light_gone, serial", [
    (4.0, 5.0, False, True),  # a beam 12x a Score lately seen: heavy, under heavy_batch_s though it is
    (0.0, 5.0, False, False),  # the ratio off: only heavy_batch_s counts, and the beams take both slots
    (4.0, 0.05, True, False),  # no Score within the window: nothing to keep the last slot for
])
def test_requests_far_heavier_than_another_kind_leave_it_the_last_slot(art, heavy_ratio, light_window_s, light_gone,
                                                                        serial):
    rt = KindRuntime(beam_s=0.12, score_s=0.01)

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=2, heavy_batch_s=1.0, heavy_ratio=heavy_ratio,
                          light_window_s=light_window_s)
        await s.submit(beam("warm-beam", new_tokens=1))
        await s.submit(beam("warm-beam2", new_tokens=2))
        await s.submit(score("warm-score"))
        if light_gone:
            await asyncio.sleep(0.1)
        heavy = [asyncio.create_task(s.submit(beam("b1", new_tokens=1)))]
        await until(lambda: "b1" in rt.began)
        heavy.append(asyncio.create_task(s.submit(beam("b2", new_tokens=2))))
        await asyncio.sleep(0.04)
        assert ("b2" in rt.began) is not serial, rt.began
        if serial:
            t0 = time.monotonic()
            await s.submit(score("light"))
            assert time.monotonic() - t0 < 0.08, "the light request waited behind a heavy batch"
        await asyncio.gather(*heavy)
        spans = {name: (a, b) for name, a, b in rt.spans}
        assert (spans["b2"][0] >= spans["b1"][1] - 0.01) is serial
        heavy_batches = s.stats()["heavy_batches"]  # b1 and b2 (the warm-up beams saw no Score yet)
        assert heavy_batches == ({"ratio": 2} if serial else {}), heavy_batches
        await s.close()

    asyncio.run(main())


def test_recent_solos_keep_each_kinds_lightest_request_within_the_window():
    from service.sched.batcher import RecentSolos
    from service.sched.cost import BucketInfo

    small, big, mid = (BucketInfo(k, "score", f) for k, f in (("s", 1.0), ("b", 9.0), ("m", 4.0)))
    times = {"s": 0.002, "b": 0.030, "m": 0.010, "beam": 0.050}
    r = RecentSolos(window_s=1.0)
    r.add("score", big, 0.0)
    r.add("score", small, 0.1)  # lighter: takes its place
    r.add("score", big, 0.2)  # heavier: does not
    r.add("beam", BucketInfo("beam", "beam", 100.0), 0.3)
    assert r.lightest(lambda i: times[i.key], 0.5) == {"score": 0.002, "beam": 0.050}
    r.add("score", mid, 1.3)  # the lightest last seen 1.2 s ago: the next one takes its place
    assert r.lightest(lambda i: times[i.key], 1.35) == {"score": 0.010}  # beam's last 1.05 s ago: gone
    assert len(r) == 1


def test_a_heavy_batch_pauses_between_nodes_while_a_light_one_runs():
    from service.sched.batcher import _LightFirst

    gate, nodes, stop = _LightFirst(), [], threading.Event()

    def heavy() -> None:
        while not stop.is_set():
            gate.pause_heavy()
            nodes.append(time.monotonic())
            time.sleep(0.002)  # one node

    worker = threading.Thread(target=heavy)
    worker.start()
    time.sleep(0.05)
    gate.enter_light()
    entered = time.monotonic()
    time.sleep(0.1)
    left = time.monotonic()
    gate.exit_light()
    time.sleep(0.05)
    stop.set()
    worker.join(5)
    during = [t for t in nodes if entered + 0.005 < t < left]
    assert during == [], "the heavy batch ran nodes while the light one ran"
    assert any(t > left for t in nodes) and any(t < entered for t in nodes)


# ---- cancellation, deadlines, failures ------------------------------------------------------------

def test_a_cancelled_request_is_never_executed_and_frees_its_slot(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, AdmissionConfig(max_queue_normal=1), max_wait_s=0.0, max_inflight=1)
        rt.gate.clear()
        a = asyncio.create_task(s.submit(score("a")))
        await until(lambda: len(rt.started) == 1)  # a holds the executor
        b = asyncio.create_task(s.submit(score("b")))
        await until(lambda: s.stats()["queue_depth"]["NORMAL"] == 1)
        with pytest.raises(Overloaded) as e:
            await s.submit(score("c"))
        assert e.value.reason == "queue_full"
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        assert s.stats()["queue_depth"]["NORMAL"] == 0 and s.stats()["cancelled"] == 1
        c = asyncio.create_task(s.submit(score("c")))  # the freed slot
        await until(lambda: s.stats()["admitted"] == 3)
        rt.gate.set()
        await asyncio.gather(a, c)
        assert rt.ran == ["a", "c"]
        st = s.stats()
        assert st["requests_executed"] == 2 and st["refused"]["queue_full"] == 1
        await s.close()

    asyncio.run(main())


def test_a_too_short_deadline_is_refused_at_once_and_never_runs(art):
    rt = FakeRuntime(delay_s=0.05)

    async def main() -> None:
        s = await started(art, rt, AdmissionConfig(default_service_s=0.001, safety_margin=0.0), max_wait_s=0.0)
        with pytest.raises(DeadlineUnmeetable):
            await s.submit(score("past"), O, deadline=time.monotonic() - 0.01)
        for i in range(3):  # measure the bucket: ≈ 50 ms
            await s.submit(score(f"m{i}"))
        assert s.stats()["model"]["tau_s"] >= 0.045
        refused = s.submit(score("short"), O, deadline=time.monotonic() + 0.02)
        with pytest.raises(DeadlineUnmeetable):  # shorter than its own batch: no retry could meet it
            refused.send(None)  # raises on its first step: refused without ever waiting
        rt.gate.clear()  # behind a running batch, a deadline it could meet alone: UNAVAILABLE, with a hint
        held = asyncio.create_task(s.submit(score("held")))
        await until(lambda: len(rt.started) == 4)
        # a deadline the request meets alone but not behind the running batch: from the measured
        # time (a loaded machine stretches the 50 ms sleep), not a constant
        own_s = s.stats()["model"]["tau_s"] + s.admission.config.response_margin_s
        with pytest.raises(Overloaded) as e:
            await s.submit(score("behind"), O, deadline=time.monotonic() + 1.4 * own_s)
        assert e.value.reason == "deadline" and 0 < e.value.retry_after_s <= s.admission.config.max_retry_after_s
        rt.gate.set()
        await held
        await s.submit(score("roomy"), O, deadline=time.monotonic() + 2.0)
        assert not {"past", "short", "behind"} & set(rt.ran) and "roomy" in rt.ran
        refused_counts = s.stats()["refused"]
        assert refused_counts["impossible"] == 2 and refused_counts["deadline"] == 1
        assert s.stats()["requests_executed"] == 5
        await s.close()

    asyncio.run(main())


def test_a_cold_start_does_not_teach_the_calibration_the_assumed_default(art):
    """Issue 11 on a cold CPU server: the first W1 request took 488 ms where 10 ms was assumed; that
    49x "error" stretched every prediction by the calibration's cap (2x), and the idle server then
    refused one request with a 1 s deadline ("predicted completion in 1.057 s"). A prediction made
    on the assumed default teaches the calibration nothing; measured ones still do."""
    rt = FakeRuntime(delay_s=0.2)

    async def main() -> None:
        s = await started(art, rt, AdmissionConfig(default_service_s=0.01), max_wait_s=0.0)
        await s.submit(score("cold"), deadline=time.monotonic() + 5.0)  # 20x the assumed 10 ms
        assert s.stats()["model"]["calibration"] == 1.0
        # measured now (~0.2 s): its own time and margins fit 0.35 s on the idle server; stretched
        # by a calibration of 2 they did not
        await s.submit(score("warm"), deadline=time.monotonic() + 0.35)
        assert rt.ran == ["cold", "warm"]
        s.admission.model.observe_prediction(0.1, 0.15, s.clock())  # a measured miss still calibrates
        assert s.stats()["model"]["calibration"] > 1.4
        await s.close()

    asyncio.run(main())


def test_a_deadline_passing_in_the_queue_drops_the_request_unexecuted(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, AdmissionConfig(default_service_s=0.001), max_wait_s=0.0, max_inflight=1)
        rt.gate.clear()
        a = asyncio.create_task(s.submit(score("a")))
        await until(lambda: len(rt.started) == 1)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExpired):
            await s.submit(score("late"), deadline=time.monotonic() + 0.15)
        assert 0.14 <= time.monotonic() - t0 < 1.0
        assert s.stats()["expired"] == 1 and s.stats()["queue_depth"]["NORMAL"] == 0
        rt.gate.set()
        await a
        assert rt.ran == ["a"]
        await s.close()

    asyncio.run(main())


def test_a_queued_request_that_can_no_longer_finish_in_time_is_dropped_before_its_deadline(art):
    """Once its own bucket's fastest recent run no longer fits before its deadline, a queued
    request is dropped unexecuted then (DEADLINE_EXCEEDED, saying why), not at the deadline: run
    later it would only be answered late, on GPU time others could use."""
    rt = FakeRuntime(delay_s=0.15)

    async def main() -> None:
        s = await started(art, rt, AdmissionConfig(default_service_s=0.001, safety_margin=0.0), max_wait_s=0.0,
                          max_inflight=1)
        for i in range(3):  # measure the bucket: >= 150 ms
            await s.submit(score(f"m{i}"))
        rt.gate.clear()
        held = asyncio.create_task(s.submit(score("held")))
        await until(lambda: len(rt.started) == 4)
        own_s = s.model.bucket_min_s(s.costs.of(score("late")).solo, s.clock())  # its fastest (>= 150 ms)
        assert own_s >= 0.15
        t0 = time.monotonic()
        # admitted: the held batch's rest and its own run fit (about own_s each)
        with pytest.raises(DeadlineExpired, match="could no longer finish by its deadline") as e:
            await s.submit(score("late"), deadline=t0 + 3 * own_s)
        waited = time.monotonic() - t0
        # dropped at the deadline less its own time (~2 own_s), well before the deadline itself
        assert 1.5 * own_s <= waited <= 2.5 * own_s, (waited, own_s, str(e.value))
        assert s.stats()["expired"] == 1
        rt.gate.set()
        await held
        assert "late" not in rt.ran
        await s.close()

    asyncio.run(main())


def test_a_failing_batch_fails_only_its_own_requests(art):
    rt = FakeRuntime(fail_ids=("boom",))

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.01)
        results = await asyncio.gather(s.submit(score("boom")), s.submit(score("with-boom")),
                                       s.submit(beam("fine")), return_exceptions=True)
        assert isinstance(results[0], ExecutionError) and isinstance(results[1], ExecutionError)
        assert "injected failure" in str(results[0])
        assert isinstance(results[2], Completed) and isinstance(results[2].result, BeamResult)
        after = await s.submit(score("after"))  # the scheduler carries on
        assert after.result.scores == [[-1.5, -1.5]] * 2
        assert s.stats()["batches_failed"] == 1
        await s.close()

    asyncio.run(main())


def test_invalid_requests_and_priorities_are_refused(art):
    async def main() -> None:
        s = await started(art, FakeRuntime())
        with pytest.raises(RequestError, match="label_ids"):
            await s.submit(ScoreRequest(samples=((1,),), label_ids=(art.config.vocab_size,)))
        with pytest.raises(RequestError, match="priority"):
            await s.submit(score("x"), priority=0)
        assert s.stats()["admitted"] == 0
        await s.close()
        with pytest.raises(RuntimeError, match="not running"):
            await s.submit(score("y"))

    asyncio.run(main())


# ---- draining ----------------------------------------------------------------------------------------

def test_drain_finishes_inflight_and_queued_work_and_refuses_new(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=1)
        rt.gate.clear()
        a = asyncio.create_task(s.submit(score("a")))
        await until(lambda: len(rt.started) == 1)
        b = asyncio.create_task(s.submit(beam("b")))
        await until(lambda: s.stats()["admitted"] == 2)
        drain = asyncio.create_task(s.drain(timeout_s=10))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded) as e:
            await s.submit(score("new"), O)
        assert e.value.reason == "draining" and not drain.done()
        rt.gate.set()
        assert await drain is True
        assert isinstance((await a).result, ScoreResult) and isinstance((await b).result, BeamResult)
        assert rt.ran == ["a", "b"] and s.stats()["refused"]["draining"] == 1
        assert await s.drain(timeout_s=0.0) is True  # nothing left: done even with no time to wait
        await s.close()

    asyncio.run(main())


def test_a_drain_that_times_out_answers_the_queued_requests(art):
    rt = FakeRuntime()

    async def main() -> None:
        s = await started(art, rt, max_wait_s=0.0, max_inflight=1)
        rt.gate.clear()
        a = asyncio.create_task(s.submit(score("a")))
        await until(lambda: len(rt.started) == 1)
        b = asyncio.create_task(s.submit(beam("b")))
        await until(lambda: s.stats()["admitted"] == 2)
        assert await s.drain(timeout_s=0.1) is False
        with pytest.raises(Overloaded) as e:
            await b
        assert e.value.reason == "draining"
        rt.gate.set()
        assert isinstance((await a).result, ScoreResult)  # the in-flight batch still completes
        assert rt.ran == ["a"] and s.stats()["drained"] == 1
        await s.close()

    asyncio.run(main())


def _first_batch(art: Any, reqs: list, before: Any = None) -> list:
    """The ids of the batch a fresh Scheduler would form first from `reqs` queued in this order
    (NORMAL priority, one client); before() runs just before the plan."""
    from service.sched.cost import request_kind

    async def plan() -> list:
        s = Scheduler(art, FakeRuntime(), None, BatcherConfig())
        loop = asyncio.get_running_loop()
        for r in reqs:
            s.admission.admit(Ticket(r, request_kind(r), N, None, future=loop.create_future(), client="c",
                                     cost=s._cost(r)))
        if before is not None:
            before()
        return [t.payload.id for t in s._plan(time.monotonic()).tickets]

    return asyncio.run(plan())


# ---- planning cost ------------------------------------------------------------------------------

def test_planning_a_batch_looks_at_a_bounded_part_of_a_long_queue(art, monkeypatch):
    """Under overload hundreds wait; forming a batch must not try each of them (it runs on the event
    loop for every batch): it stops once the batch holds as many requests as the kind's largest
    bucket, and it looks at MAX_MISSES requests that do not join at most for one further back that
    would."""
    from service.sched import batcher as bm

    calls = [0]
    fit = bm._Fill.fit_request

    def counting_fit(self, req):
        calls[0] += 1
        return fit(self, req)

    monkeypatch.setattr(bm._Fill, "fit_request", counting_fit)

    def plan(reqs: list) -> list:
        return _first_batch(art, reqs, before=lambda: calls.__setitem__(0, 0))

    most = max(b.max_requests for b in art.buckets.score)
    got = (plan([score(f"s{i}") for i in range(250)]))
    assert got == [f"s{i}" for i in range(most)] and calls[0] <= most + 1

    # batch times where beam rows are what costs: a wide request beside a narrow head would make the
    # batch slower per request, so it never joins; a second narrow one does
    monkeypatch.setattr(bm.Scheduler, "_bucket_s", lambda self, b, now: 1e-4 * b.max_requests * b.beam_width)

    def big(name: str) -> BeamRequest:
        return BeamRequest(prompt_ids=(5, 6, 7), beam_width=art.limits.max_beam_width, new_tokens=1, id=name)

    near = [beam("head")] + [big(f"w{i}") for i in range(bm.MAX_MISSES - 1)] + [beam("small")]
    assert (plan(near)) == ["head", "small"]  # found behind MAX_MISSES - 1 that do not join
    far = [beam("head")] + [big(f"w{i}") for i in range(200)] + [beam("small")]
    assert (plan(far)) == ["head"] and calls[0] <= bm.MAX_MISSES + 1


def test_a_batch_grows_into_a_larger_bucket_by_what_the_queue_will_fill_it_with(art, monkeypatch):
    """Batch times in proportion to a bucket's packed beam rows: taking a bucket of 16 rows for a
    2nd request of 3 beams is 4x slower than its first's 4 rows judged by that request alone, but no
    slower per request once the requests waiting behind it fill its 4 slots. A queue of the largest
    narrow bucket's worth goes as one batch (measured on the H200: W2 at 8 in flight ran in batches
    of exactly 2, two at a time sharing the GPU); with only 3 waiting, a bucket of 4 slots would
    be a quarter idle, and the batch stays at 1."""
    from service.sched import batcher as bm

    monkeypatch.setattr(bm.Scheduler, "_bucket_s", lambda self, b, now: 1e-4 * b.rows)
    narrow = sorted({(b.rows, b.max_requests) for b in art.buckets.of_kind("beam")
                     if b.beam_width >= 3 and b.new_tokens == 1})
    assert narrow[:3] == [(4, 2), (16, 4), (32, 8)], narrow  # the embedded artifact's narrowest row tiers

    def plan(n: int) -> list:
        return _first_batch(art, [beam(f"b{i}", width=3) for i in range(n)])

    assert plan(8) == [f"b{i}" for i in range(8)]  # 24 rows in the 32-row bucket of 8: 4 rows a request
    assert plan(3) == ["b0"]  # 16 rows for 3 (5.3 a request) against 4 for one


def test_the_bucket_a_batch_is_formed_in_is_the_runtimes_own_pick(art):
    """The batcher packs a batch into the bucket it formed it in (no second search over ~400 buckets
    on the event loop): that bucket must be the one pick_score_bucket / pick_beam_bucket choose."""
    from service.runtime.batch import pick_beam_bucket, pick_score_bucket
    from service.sched.batcher import _Fill

    rng, lim = random.Random(3), art.limits
    for _ in range(300):
        n = rng.randint(1, 8)
        if rng.random() < 0.5:
            reqs = [ScoreRequest(samples=tuple((7,) * rng.randint(1, 40) for _ in range(rng.randint(1, 16))),
                                 label_ids=(1,), prefix_ids=(5,) * rng.randint(0, 30)) for _ in range(n)]
            kind, want = "score", pick_score_bucket(art.buckets, reqs)
        else:
            reqs = [BeamRequest(prompt_ids=(5,) * rng.randint(1, 300), beam_width=rng.randint(1, lim.max_beam_width),
                                new_tokens=rng.randint(1, lim.max_new_tokens)) for _ in range(n)]
            kind, want = "beam", pick_beam_bucket(art.buckets, reqs)
        fill = _Fill(art.buckets.of_kind(kind))
        for r in reqs:
            got = fill.fit_request(r)
            if got is None:
                break
            fill.add_request(r)
        assert (got and fill.bucket) == want, reqs


def test_under_load_a_batch_waits_a_share_of_its_cost_for_company(art, monkeypatch):
    """load_wait_share: when requests of a kind arrive at least one per time a batch of one takes,
    a batch not yet full waits up to that share of that time, so the next arrival joins it (one
    batch of 2 instead of 1 + 1). At a lighter load, or with the share 0, it goes at once. A
    deadline caps the wait."""
    from service.sched import batcher as bm

    monkeypatch.setattr(bm.Scheduler, "_bucket_s", lambda self, b, now: 0.4)

    async def run(share: float, solo_s: float, tight: bool = False) -> tuple[list[list[str]], float]:
        monkeypatch.setattr(bm.Scheduler, "_solo_s", lambda self, ticket, now: solo_s)
        rt = FakeSubmitRuntime()
        s = await started(art, rt, max_wait_s=0.0, max_inflight=2, load_wait_share=share, load_wait_max_s=0.1,
                          heavy_batch_s=10.0)
        first = asyncio.create_task(s.submit(score("r1")))
        await until(lambda: len(rt.pending) == 1)
        t0 = time.monotonic()
        # tight: the batch's predicted finish (0.4 s stretched) and its 10% margin leave 10 ms to wait
        deadline = t0 + 1.1 * s._finish_s(0.4) + 0.01 if tight else None
        rest = [asyncio.create_task(s.submit(score("r2"), deadline=deadline))]
        await asyncio.sleep(0.03)
        rest.append(asyncio.create_task(s.submit(score("r3"), deadline=deadline)))
        await until(lambda: len(rt.submitted_s) >= 2, timeout_s=5)
        waited = rt.submitted_s[1] - t0  # r2's wait
        await finish_all(s, rt, [first, *rest])
        return list(rt.started), waited

    # two arrivals within ms: ~4 a second (ArrivalRates, tau 0.5 s)
    joined, waited = asyncio.run(run(0.25, solo_s=0.4))  # 4/s x 0.4 s >= 1: waits min(0.1, 0.25 x 0.4 s)
    assert joined == [["r1"], ["r2", "r3"]] and 0.09 <= waited < 0.3, (joined, waited)
    light, waited = asyncio.run(run(0.25, solo_s=0.2))  # 4/s x 0.2 s < 1: at once
    assert light[:2] == [["r1"], ["r2"]] and waited < 0.03, (light, waited)
    off, waited = asyncio.run(run(0.0, solo_s=0.4))
    assert off[:2] == [["r1"], ["r2"]] and waited < 0.03, (off, waited)
    # a deadline the wait would break: r2 goes alone, in time
    capped, waited = asyncio.run(run(0.25, solo_s=0.4, tight=True))
    assert capped[1] == ["r2"] and waited < 0.03, (capped, waited)


def test_a_load_wait_ends_once_the_batch_holds_the_requests_expected_in_the_server(art, monkeypatch):
    """Little's law: with 10 requests a second staying 0.2 s in the server (outside time 0), 2 are
    expected there. A batch of one waits for the second and goes the moment it joins, not at the end
    of its wait; a batch that already holds them, or whose company is in flight, goes at once."""
    from service.sched import batcher as bm

    monkeypatch.setattr(bm.Scheduler, "_bucket_s", lambda self, b, now: 0.4)
    monkeypatch.setattr(bm.Scheduler, "_solo_s", lambda self, ticket, now: 0.4)
    monkeypatch.setattr(bm.ArrivalRates, "rate", lambda self, kind, now: 10.0)

    async def run(residence_s: float, in_flight: bool = False) -> tuple[list[list[str]], float]:
        rt = FakeSubmitRuntime()
        s = await started(art, rt, max_wait_s=0.0, max_inflight=3, load_wait_share=0.5, load_wait_max_s=0.2,
                          load_wait_outside_s=0.0, heavy_batch_s=10.0)
        monkeypatch.setattr(s._residence, "mean", lambda kind: residence_s)
        tasks = []
        if in_flight:  # r0 alone: a wait of 0.5 x 0.4 s (capped at 0.2 s) for company... that is in flight
            monkeypatch.setattr(s, "_inflight_by_kind", bm.Counter({"score": 1}))
        t0 = time.monotonic()
        tasks.append(asyncio.create_task(s.submit(score("r1"))))
        await asyncio.sleep(0.03)
        tasks.append(asyncio.create_task(s.submit(score("r2"))))
        await until(lambda: len(rt.submitted_s) >= 1, timeout_s=5)
        first_s = rt.submitted_s[0] - t0
        await finish_all(s, rt, tasks)
        return list(rt.started), first_s

    # 10/s x 0.2 s = 2 expected: r1 waits (not at once), r2 joins and they go together, long before 0.2 s
    both, first_s = asyncio.run(run(0.2))
    assert both == [["r1", "r2"]] and 0.025 <= first_s < 0.15, (both, first_s)
    # 10/s x 0.1 s = 1 expected, and r1 is it: at once, alone
    alone, first_s = asyncio.run(run(0.1))
    assert alone == [["r1"], ["r2"]] and first_s < 0.025, (alone, first_s)
    # 2 expected, but one of them is in flight: at once
    flying, first_s = asyncio.run(run(0.2, in_flight=True))
    assert flying[0] == ["r1"] and first_s < 0.025, (flying, first_s)


def test_behind_a_busy_executor_the_load_wait_counts_from_the_slot_freeing(art, monkeypatch):
    """One slot (--lanes 1): r2 queues while r1 runs, longer than any load wait. When r1's slot
    frees, r1's caller is expected back (Little's law: 3 requests in the server, r2 the only one
    there), so r2 still waits for company, counted from that moment, and r3 (r1's caller coming
    back) joins it: one batch of 2, not two of 1 that alternate. Without expected company it goes
    the moment the slot frees."""
    from service.sched import batcher as bm

    monkeypatch.setattr(bm.Scheduler, "_bucket_s", lambda self, b, now: 0.4)
    monkeypatch.setattr(bm.Scheduler, "_solo_s", lambda self, ticket, now: 0.4)
    monkeypatch.setattr(bm.ArrivalRates, "rate", lambda self, kind, now: 10.0)

    async def run(residence_s: float) -> tuple[list[list[str]], float]:
        rt = FakeSubmitRuntime()
        s = await started(art, rt, max_wait_s=0.0, max_inflight=1, load_wait_share=0.5, load_wait_max_s=0.15,
                          load_wait_outside_s=0.0, heavy_batch_s=10.0)
        monkeypatch.setattr(s._residence, "mean", lambda kind: residence_s)
        tasks = [asyncio.create_task(s.submit(score("r1")))]
        await until(lambda: len(rt.pending) == 1)
        tasks.append(asyncio.create_task(s.submit(score("r2"))))
        await asyncio.sleep(0.25)  # r2 has waited longer than load_wait_max_s behind r1
        assert len(rt.submitted_s) == 1
        rt.finish_oldest()
        freed_s = time.monotonic()
        await asyncio.sleep(0.03)
        tasks.append(asyncio.create_task(s.submit(score("r3"))))
        await until(lambda: len(rt.submitted_s) >= 2, timeout_s=5)
        second_s = rt.submitted_s[1] - freed_s
        await finish_all(s, rt, tasks)
        return list(rt.started), second_s

    # 10/s x 0.3 s = 3 expected, r2 alone in the queue: it waits from the slot freeing; r3 joins
    joined, second_s = asyncio.run(run(0.3))
    assert joined == [["r1"], ["r2", "r3"]] and second_s >= 0.025, (joined, second_s)
    # 10/s x 0.1 s = 1 expected, and r2 is it: it goes as the slot frees, alone
    alone, second_s = asyncio.run(run(0.1))
    assert alone == [["r1"], ["r2"], ["r3"]] and second_s < 0.025, (alone, second_s)


def test_a_forming_batchs_bucket_is_the_first_in_order_that_holds_it():
    """Fill searches on from its current bucket (a request only adds to the totals): after every
    request it must still name the first bucket in the kind's order that holds the whole batch."""
    from service.artifact.buckets import BeamBucket, ScoreBucket, pick_order
    from service.sched.batcher import _Fill

    rng = random.Random(5)
    score_buckets = tuple(sorted({ScoreBucket(r * rng.choice([64, 128, 256, 512]), rng.choice([16, 32, 64, 128, 512]), r)
                                  for r in (1, 2, 4, 8) for _ in range(4)}, key=pick_order))
    beam_buckets = tuple(sorted({BeamBucket(5, r, r * rng.choice([128, 256, 512]), w, rng.randint(w, r * w))
                                 for r in (1, 2, 4, 8) for _ in range(4) for w in [rng.choice([4, 16, 100, 128])]},
                                key=pick_order))
    for trial in range(300):
        is_score = trial % 2 == 0
        fill = _Fill(score_buckets if is_score else beam_buckets)
        reqs: list[Any] = []
        for _ in range(10):
            if is_score:
                req = ScoreRequest(samples=tuple((1,) * rng.randint(1, 300) for _ in range(rng.randint(1, 40))),
                                   label_ids=(1,))
            else:
                req = BeamRequest(prompt_ids=(1,) * rng.randint(1, 300), beam_width=rng.choice([1, 4, 16, 100]),
                                  new_tokens=5)
            if is_score:
                want = next((b for b in score_buckets if b.holds(len(reqs) + 1, sum(r.num_tokens for r in [*reqs, req]),
                                                                 sum(r.num_samples for r in [*reqs, req]))), None)
            else:
                want = next((b for b in beam_buckets if b.max_requests >= len(reqs) + 1
                             and b.beam_width >= max(r.beam_width for r in [*reqs, req])
                             and b.max_rows >= sum(r.beam_width for r in [*reqs, req])
                             and b.max_prompt_tokens >= sum(len(r.prompt_ids) for r in [*reqs, req])), None)
            got = fill.fit_request(req)
            assert got == want, (trial, len(reqs), got, want)
            if got is None:
                continue  # it does not join; the next request is tried against the same batch
            fill.add_request(req)
            reqs.append(req)
            assert fill.bucket == want and fill.buckets[fill.index] == want


def test_residence_is_a_weighted_mean_per_kind():
    from service.sched.batcher import Residence

    r = Residence(alpha=0.5)
    assert r.mean("score") is None
    r.add("score", 0.010)
    r.add("score", 0.020)
    r.add("beam.n5", 0.1)
    assert r.mean("score") == pytest.approx(0.015) and r.mean("beam.n5") == pytest.approx(0.1)


def test_arrival_rates_read_a_steady_rate_and_decay():
    from service.sched.batcher import ArrivalRates

    rates = ArrivalRates(tau_s=0.5)
    t = 0.0
    for _ in range(2000):  # 200 a second for 10 s
        rates.add("beam.n5", t)
        t += 0.005
    assert rates.rate("beam.n5", t) == pytest.approx(200, rel=0.02)
    assert rates.rate("score", t) == 0.0
    assert rates.rate("beam.n5", t + 0.5) == pytest.approx(200 / math.e, rel=0.02)
