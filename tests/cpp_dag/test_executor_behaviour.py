"""The C++ executor's behaviour around the numbers (CPU): per-node timings, asynchronous
submission, errors that name their node and poison nothing, shutdown that loses nothing, and no
host-memory growth over many batches."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from service.runtime import cpp_runtime as cpp_runtime_mod
from service.runtime.batch import BeamBatch, ScoreBatch, pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.requests import BeamRequest, ScoreRequest
from service.runtime.timings import BatchTimings, NodeTiming

# ---- batches -----------------------------------------------------------------------------------


def _score_batch(art, rng: random.Random, helpers, shapes=((5, (3, 4)), (0, (2,)))) -> ScoreBatch:
    reqs = [ScoreRequest(tuple(helpers.rand_ids(rng, n) for n in samples), helpers.rand_ids(rng, 3),
                         helpers.rand_ids(rng, prefix)) for prefix, samples in shapes]
    bucket = pick_score_bucket(art.buckets, reqs)
    return pack_score(reqs, bucket, art.limits.max_labels)


def _beam_batch(art, rng: random.Random, helpers, widths=(3, 5), new_tokens: int = 3) -> BeamBatch:
    reqs = [BeamRequest(helpers.rand_ids(rng, 2 + rng.randrange(8)), w, new_tokens) for w in widths]
    bucket = pick_beam_bucket(art.buckets, reqs)
    return pack_beam(reqs, bucket)


def _mixed_batches(art, helpers, n: int, seed: int = 5) -> list[ScoreBatch | BeamBatch]:
    rng = random.Random(seed)
    out: list[ScoreBatch | BeamBatch] = []
    for i in range(n):
        if i % 2 == 0:
            out.append(_score_batch(art, rng, helpers, ((rng.randrange(6), (1 + rng.randrange(5),) * (1 + i % 3)),)))
        else:
            out.append(_beam_batch(art, rng, helpers, (1 + rng.randrange(6),) * (1 + i % 2), 1 + i % 5))
    return out


def _bad_labels(batch: ScoreBatch) -> ScoreBatch:
    """The same batch with float label ids: only the label_logprobs node (gather) refuses them."""
    inputs = dict(batch.inputs, labels=batch.inputs["labels"].to(torch.float32))
    return ScoreBatch(batch.requests, batch.bucket, batch.num_labels, inputs)


def _run(rt, batch) -> list[torch.Tensor]:
    if isinstance(batch, ScoreBatch):
        return [rt.run_score(batch)]
    return list(rt.run_beam(batch))


def _same(a: list[torch.Tensor], b: list[torch.Tensor], helpers) -> bool:
    return len(a) == len(b) and all(helpers.same_bytes(x, y) for x, y in zip(a, b))


def _beam_kwargs(batch: BeamBatch) -> dict[str, int]:
    b = batch.bucket
    return {"num_requests": b.max_requests, "beam_width": b.beam_width, "new_tokens": b.new_tokens}


# ---- timings -----------------------------------------------------------------------------------


def _check_timings(t: BatchTimings, expected_names: list[str]) -> None:
    assert type(t) is BatchTimings and isinstance(t.nodes, tuple)
    names = [n.name for n in t.nodes]
    assert names == expected_names, "one timing per executed node, in DAG order"
    for node in t.nodes:
        assert type(node) is NodeTiming
        assert isinstance(node.host_ms, float) and node.host_ms >= 0, node
        assert node.device_ms == -1, "no device timer on the CPU"
    stamps = [t.submit_ns, t.start_ns, t.h2d_end_ns, t.launch_ns, t.d2h_end_ns, t.done_ns]
    assert all(isinstance(s, int) and s > 0 for s in stamps)
    assert stamps == sorted(stamps), f"timestamps not monotone: {stamps}"
    # the nodes ran between the launch and the copy back: their host times fit inside that span
    assert sum(n.host_ms for n in t.nodes) <= (t.d2h_end_ns - t.launch_ns) / 1e6 + 1e-3
    assert t.graph is False and t.paused_ns == 0
    assert t.run_ns == t.done_ns - t.start_ns and t.queue_ns == t.start_ns - t.submit_ns


def test_score_node_timings(qwen2_small, helpers) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    rt.run_score(_score_batch(art, random.Random(1), helpers))
    names = [n.name for n in art.score_dag]
    _check_timings(rt.last_timings, names)
    assert rt.node_names("score") == names


@pytest.mark.parametrize("new_tokens", [1, 2, 5])
def test_beam_node_timings_skip_unrun_steps(qwen2_small, helpers, new_tokens: int) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    rt.run_beam(_beam_batch(art, random.Random(new_tokens), helpers, (2, 4), new_tokens))
    expected = [n.name for n in art.beam_dag if n.step < new_tokens]
    assert len(expected) < len(art.beam_dag) or new_tokens == art.limits.max_new_tokens
    _check_timings(rt.last_timings, expected)
    assert rt.node_names("beam") == [n.name for n in art.beam_dag]


def test_submitted_batch_timings(qwen2_small, helpers) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    batch = _beam_batch(art, random.Random(3), helpers, (3,), 4)

    async def main():
        return await rt.submit(batch)

    _, timings = asyncio.run(main())
    _check_timings(timings, [n.name for n in art.beam_dag if n.step < 4])


def test_plain_run_returns_outputs_and_timings_only(qwen2_small, helpers) -> None:
    """A trace is Executor.trace's alone: a plain run returns (outputs, the timings tuple), no
    per-node buffers (RunOutput::trace is "only when BatchSpec::trace_buffers is set")."""
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    batch = _score_batch(art, random.Random(4), helpers)
    result = rt._executor.run("score", batch.inputs)
    assert len(result) == 2 and len(result[1]) == 9, f"a plain run returned more: {[type(r) for r in result]}"
    traced = rt._executor.trace("score", batch.inputs, ["x"])
    assert [node for node, _ in traced] == [n.name for n in art.score_dag]


# ---- asynchronous submission -----------------------------------------------------------------------


@pytest.mark.parametrize("num_lanes", [1, 2])
def test_concurrent_submits_match_blocking_runs(qwen2_small, helpers, monkeypatch, num_lanes: int) -> None:
    art = qwen2_small.artifact
    rt = qwen2_small.cpp if num_lanes == 1 else CppRuntime(art, num_lanes=num_lanes)
    batches = _mixed_batches(art, helpers, 8, seed=11)
    expected = [_run(rt, b) for b in batches]

    resolved_on: list[int] = []
    original = cpp_runtime_mod._resolve

    def spy(fut, result, error):  # _resolve is what the executor's callback schedules on the loop
        resolved_on.append(threading.get_ident())
        original(fut, result, error)

    monkeypatch.setattr(cpp_runtime_mod, "_resolve", spy)

    async def main():
        loop_thread = threading.get_ident()
        futs = [rt.submit(b) for b in batches]  # all queued before any is awaited
        results = await asyncio.wait_for(asyncio.gather(*futs), timeout=120)
        return loop_thread, results

    loop_thread, results = asyncio.run(main(), debug=True)  # debug: a cross-thread call_soon raises
    assert len(resolved_on) == len(batches)
    assert set(resolved_on) == {loop_thread}, "every future resolves on the event loop's thread"
    assert loop_thread == threading.main_thread().ident
    for batch, want, (outputs, timings) in zip(batches, expected, results):
        assert _same(list(outputs), want, helpers)
        assert type(timings) is BatchTimings and timings.nodes[0].name == "masks"
    if rt is not qwen2_small.cpp:
        rt.shutdown()


# ---- errors ------------------------------------------------------------------------------------------


def test_an_input_nothing_provides_is_refused_at_load(qwen2_small, tmp_path, helpers) -> None:
    art = qwen2_small.artifact
    dag = [n.to_dict() for n in art.score_dag]
    head = next(d for d in dag if d["type"] == "lm_head")
    head["inputs"] = ["h_missing"]
    with pytest.raises(ValueError) as info:
        helpers.executor_with_dags(art, tmp_path, score_dag=dag)
    msg = str(info.value)
    assert head["name"] in msg and "lm_head" in msg and "h_missing" in msg and "earlier node" in msg, msg


@pytest.mark.parametrize("kind, node_type, drop, where", [
    ("score", "decoder_layer", "positions", "inputs"),  # read by name
    ("score", "score_masks", "cu_blocks", "outputs"),  # written by name
    ("beam", "beam_init", "beam_seqs", "inputs"),  # changed in place: must be an input too
    ("beam", "beam_step", "beam_parents", "outputs"),
])
def test_a_buffer_the_node_uses_but_does_not_declare_is_refused_at_load(qwen2_small, tmp_path, helpers, kind,
                                                                       node_type, drop, where) -> None:
    art = qwen2_small.artifact
    dag = [n.to_dict() for n in (art.score_dag if kind == "score" else art.beam_dag)]
    node = next(d for d in dag if d["type"] == node_type)
    node[where] = [name for name in node[where] if name != drop]
    with pytest.raises(ValueError) as info:
        helpers.executor_with_dags(art, tmp_path, **{f"{kind}_dag": dag})
    msg = str(info.value)
    assert node["name"] in msg and drop in msg, msg


def test_the_artifact_dags_load_and_run_unchanged(qwen2_small, tmp_path, helpers) -> None:
    """The copy path itself: the very same DAGs load and give the runtime's bytes."""
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    ex = helpers.executor_with_dags(art, tmp_path)
    batch = _score_batch(art, random.Random(6), helpers)
    (scores,), _ = ex.run("score", batch.inputs)
    assert helpers.same_bytes(scores, rt.run_score(batch))
    ex.shutdown()


def test_wrong_dtype_input_fails_in_its_node(qwen2_small, helpers) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    batch = _score_batch(art, random.Random(7), helpers)
    with pytest.raises(RuntimeError, match=r"label_logprobs") as info:
        rt.run_score(_bad_labels(batch))
    assert "node label_logprobs" in str(info.value)


def test_unknown_node_type_at_construction(qwen2_small, tmp_path, helpers) -> None:
    art = qwen2_small.artifact
    dag = [n.to_dict() for n in art.score_dag]
    dag.insert(2, {"name": "mystery_node", "type": "fancy_attention", "inputs": ["x"], "outputs": ["x"], "attrs": {}})
    with pytest.raises(ValueError) as info:
        helpers.executor_with_dags(art, tmp_path, score_dag=dag)
    assert "mystery_node" in str(info.value) and "fancy_attention" in str(info.value)


def test_failed_batch_does_not_poison_the_executor(qwen2_small, helpers) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    rng = random.Random(8)
    good_score = _score_batch(art, rng, helpers)
    good_beam = _beam_batch(art, rng, helpers, (4, 2), 5)
    want_score = rt.run_score(good_score)  # before any failure
    want_beam = list(rt.run_beam(good_beam))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="label_logprobs"):
            rt.run_score(_bad_labels(good_score))
        assert helpers.same_bytes(rt.run_score(good_score), want_score)
        with pytest.raises(RuntimeError, match="label_logprobs"):
            rt.run_score(_bad_labels(good_score))
        assert _same(list(rt.run_beam(good_beam)), want_beam, helpers)
    assert [n.name for n in rt.last_timings.nodes] == [n.name for n in art.beam_dag]


def test_failed_submit_fails_alone(qwen2_small, helpers) -> None:
    art, rt = qwen2_small.artifact, qwen2_small.cpp
    rng = random.Random(9)
    good = [_score_batch(art, rng, helpers), _beam_batch(art, rng, helpers, (2,), 2),
            _score_batch(art, rng, helpers, ((0, (7,)),))]
    want = [_run(rt, b) for b in good]  # the blocking runs' answers
    bad = _bad_labels(good[0])

    async def main():
        futs = [rt.submit(good[0]), rt.submit(bad), rt.submit(good[1]), rt.submit(bad), rt.submit(good[2])]
        return await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout=120)

    results = asyncio.run(main())
    for i in (1, 3):
        assert isinstance(results[i], RuntimeError), results[i]
        assert "node label_logprobs" in str(results[i])
    for res, w in zip([results[0], results[2], results[4]], want):
        assert not isinstance(res, BaseException), res
        assert _same(list(res[0]), w, helpers)
    # and the worker is alive afterwards
    async def again():
        return await asyncio.wait_for(rt.submit(good[1]), timeout=60)

    assert _same(list(asyncio.run(again())[0]), want[1], helpers)


# ---- shutdown ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_lanes", [1, 2])
def test_shutdown_finishes_every_submitted_batch(qwen2_small, helpers, num_lanes: int) -> None:
    art = qwen2_small.artifact
    rt = CppRuntime(art, num_lanes=num_lanes)
    batches = _mixed_batches(art, helpers, 10, seed=13)
    want = [_run(qwen2_small.cpp, b) for b in batches]

    async def main():
        futs = [rt.submit(b) for b in batches]
        rt.shutdown()  # blocks until the queue is drained and the workers joined
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout=60)
        with pytest.raises(RuntimeError, match="shut down"):
            rt.submit(batches[0])
        return results

    results = asyncio.run(main())
    assert len(results) == len(batches)
    for res, w in zip(results, want):
        assert not isinstance(res, BaseException), f"a batch submitted before shutdown failed: {res!r}"
        assert _same(list(res[0]), w, helpers)
    rt.shutdown()  # idempotent


_DROP_WITH_QUEUED_BATCHES = textwrap.dedent("""
    import asyncio, random, sys, time
    from service.artifact.artifact import load_artifact
    from service.runtime.batch import pack_beam, pick_beam_bucket
    from service.runtime.cpp_runtime import CppRuntime
    from service.runtime.requests import BeamRequest

    art = load_artifact(sys.argv[1])
    rng = random.Random(0)
    reqs = [BeamRequest(tuple(rng.randrange(art.config.vocab_size) for _ in range(20)), 16, 5)]
    batch = pack_beam(reqs, pick_beam_bucket(art.buckets, reqs))

    async def main():
        rt = CppRuntime(art)
        futs = [rt.submit(batch) for _ in range(8)]
        print("submitted", flush=True)
        del rt  # no shutdown(): the last reference goes while batches are still queued
        print("dropped", flush=True)
        try:
            res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 20)
            print("resolved", sorted({type(r).__name__ for r in res}), flush=True)
        except asyncio.TimeoutError:
            print("lost", sum(not f.done() for f in futs), flush=True)

    asyncio.run(main())
    print("exit", flush=True)
""")


def test_dropping_the_runtime_with_queued_batches_does_not_hang(qwen2_small) -> None:
    """The executor's destructor runs shutdown() (finish every queued batch, join the workers).
    Dropped from Python it must not deadlock: the workers need the GIL to run each batch's
    callback, so the destructor cannot wait for them while holding it. (Run in a subprocess: a
    deadlock hangs the whole process.)"""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    try:
        proc = subprocess.run([sys.executable, "-c", _DROP_WITH_QUEUED_BATCHES, str(qwen2_small.artifact.path)],
                              cwd=root, env=env, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"the process hung after printing {out.split()!r}: dropping a CppRuntime with queued "
                    "batches deadlocks (~Executor joins its workers with the GIL held; each worker waits "
                    "for the GIL to run a batch's callback)")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["submitted", "dropped"] and lines[-1] == "exit", proc.stdout
    # every queued batch is finished (or failed): none is lost
    assert lines[2] in ("resolved ['tuple']", "resolved ['RuntimeError']", "resolved ['RuntimeError', 'tuple']"), \
        proc.stdout


# ---- memory -------------------------------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_no_host_memory_growth_over_many_batches(qwen2_small, helpers) -> None:
    art = qwen2_small.artifact
    rt = CppRuntime(art)
    batches = _mixed_batches(art, helpers, 12, seed=17)
    bad = _bad_labels(next(b for b in batches if isinstance(b, ScoreBatch)))

    def one_round(i: int) -> None:
        batch = batches[i % len(batches)]
        if i % 10 == 7:
            with pytest.raises(RuntimeError):
                rt.run_score(bad)
        elif i % 10 == 3:
            async def go():
                return await rt.submit(batch)
            asyncio.run(go())
        else:
            _run(rt, batch)

    for i in range(60):  # warm-up: allocator pools, thread pools, lazy inits
        one_round(i)
    gc.collect()
    before = _rss_mib()
    objects_before = len(gc.get_objects())
    for i in range(300):
        one_round(i)
    gc.collect()
    grown = _rss_mib() - before
    objects_grown = len(gc.get_objects()) - objects_before
    rt.shutdown()
    print(f"RSS {before:.1f} MiB -> +{grown:.2f} MiB, Python objects +{objects_grown}")
    assert grown < 30, f"host RSS grew by {grown:.1f} MiB over 300 batches"
    assert objects_grown < 300, f"{objects_grown} more Python objects after 300 batches"
