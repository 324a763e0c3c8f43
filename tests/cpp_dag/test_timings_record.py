"""Both runtimes time a batch into the one record, service.runtime.timings.BatchTimings (CPU):
the Python runtime and the C++ one (blocking and submitted), and the scheduler's executors over
each, give the same type with the same node names in the same order."""

from __future__ import annotations

import asyncio
import random

import pytest

from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.requests import BeamRequest, ScoreRequest
from service.runtime.timings import BatchTimings, NodeTiming, NodeTimer
from service.sched.batcher import _SubmitExecutor, _ThreadExecutor


def _batches(art, helpers):
    rng = random.Random(5)
    score = [ScoreRequest((helpers.rand_ids(rng, 4), helpers.rand_ids(rng, 2)), helpers.rand_ids(rng, 3),
                          helpers.rand_ids(rng, 6))]
    beam = [BeamRequest(helpers.rand_ids(rng, 7), 3, 2), BeamRequest(helpers.rand_ids(rng, 3), 2, 2)]
    return (pack_score(score, pick_score_bucket(art.buckets, score), art.limits.max_labels),
            pack_beam(beam, pick_beam_bucket(art.buckets, beam)))


def _check(t: object, names: list[str]) -> None:
    assert type(t) is BatchTimings
    assert isinstance(t.nodes, tuple) and all(type(n) is NodeTiming for n in t.nodes)
    assert [n.name for n in t.nodes] == names
    assert all(n.host_ms >= 0 and n.device_ms == -1 for n in t.nodes)  # host clocks only on the CPU
    assert t.submit_ns <= t.start_ns <= t.h2d_end_ns <= t.launch_ns <= t.d2h_end_ns <= t.done_ns
    assert t.graph is False and t.paused_ns == 0 and 0 <= t.run_ns == t.done_ns - t.start_ns
    with pytest.raises(AttributeError):  # frozen
        t.done_ns = 0  # type: ignore[misc]


def test_both_runtimes_return_one_record_with_the_same_nodes(qwen2_small, helpers) -> None:
    art, py_rt, cpp_rt = qwen2_small.artifact, qwen2_small.python, qwen2_small.cpp
    score, beam = _batches(art, helpers)
    want_score = [n.name for n in art.score_dag]
    want_beam = [n.name for n in art.beam_dag if n.step < 2]
    assert len(want_beam) < len(art.beam_dag), "new_tokens=2 leaves steps out"

    for rt in (py_rt, cpp_rt):  # blocking runs: last_timings
        rt.run_score(score)
        _check(rt.last_timings, want_score)
        rt.run_beam(beam)
        _check(rt.last_timings, want_beam)

    async def scheduled() -> list[tuple[str, BatchTimings]]:
        out = []
        for name, ex in (("python", _ThreadExecutor(py_rt)), ("cpp", _SubmitExecutor(cpp_rt))):
            try:
                for batch in (score, beam):
                    _, t = await ex.run(batch)
                    out.append((name, t))
            finally:
                ex.close()
        return out

    got = asyncio.run(scheduled())
    assert [name for name, _ in got] == ["python", "python", "cpp", "cpp"]
    for (_, t), names in zip(got, [want_score, want_beam] * 2):
        _check(t, names)


def test_from_executor_is_the_record_of_the_tuple() -> None:
    raw = (1, 2, 3, 4, 5, 9, True, (("masks", 0.5, 0.25), ("layer.0", 1.0, 0.75)), 3)
    t = BatchTimings.from_executor(raw)
    assert t == BatchTimings(1, 2, 3, 4, 5, 9, True, (NodeTiming("masks", 0.5, 0.25), NodeTiming("layer.0", 1.0, 0.75)),
                             3)
    assert all(type(n) is NodeTiming for n in t.nodes) and t.nodes[1].device_ms == 0.75
    assert (t.queue_ns, t.run_ns, t.paused_ns) == (1, 4, 3)


def test_node_timer_leaves_pauses_out_of_the_nodes() -> None:
    timer = NodeTimer(submit_ns=1)
    timer.lap("a")
    timer.skip(paused_ns=7)
    timer.lap("b")
    t = timer.timings()
    assert [n.name for n in t.nodes] == ["a", "b"] and t.paused_ns == 7 and t.submit_ns == 1
    assert (t.h2d_end_ns, t.launch_ns, t.d2h_end_ns) == (t.start_ns, t.start_ns, t.done_ns)
    assert t.run_ns == t.done_ns - t.start_ns - 7
