"""On the GPU (bfloat16, embedded:tiny): the Python runtime, the C++ runtime node by node
(use_graphs=False) and the C++ runtime replaying CUDA graphs agree byte for byte; graph mode
reports per-node device times; capture() logs each bucket; step-by-step traces agree on cuda.

Every test is marked gpu: tests/conftest.py skips them without CUDA (run them by hand on the
GPU machine: `pytest -q tests/cpp_dag/test_gpu_runtime.py`).
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

import pytest
import torch

from service.runtime.batch import BeamBatch, ScoreBatch, pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.engine import execute
from service.runtime.requests import BeamRequest, ExecutionError, ScoreRequest

pytestmark = pytest.mark.gpu

VOCAB = 151936  # embedded:tiny: the Qwen vocabulary
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory):
    from service.artifact.artifact import build_artifact, load_artifact

    return load_artifact(build_artifact("embedded:tiny", tmp_path_factory.mktemp("gpu_tiny") / "art", quiet=True))


@pytest.fixture(scope="module")
def runtimes(tiny_artifact) -> dict[str, Any]:
    from service.runtime.cpp_runtime import CppRuntime
    from service.runtime.python_runtime import PythonRuntime

    rts = {"python": PythonRuntime(tiny_artifact, device="cuda", dtype=DTYPE),
           "eager": CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=False),
           "graphs": CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True)}
    yield rts
    rts["eager"].shutdown()
    rts["graphs"].shutdown()


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _requests(seed: int = 7) -> list[ScoreRequest | BeamRequest]:
    rng = random.Random(seed)
    return [
        ScoreRequest((_ids(rng, 3), _ids(rng, 7), _ids(rng, 1)), _ids(rng, 4), _ids(rng, 12), id="s-prefix"),
        BeamRequest(_ids(rng, 9), 1, 1, id="b1-t1"),
        ScoreRequest((_ids(rng, 5), _ids(rng, 2)), _ids(rng, 2), id="s-plain"),
        BeamRequest(_ids(rng, 17), 3, 2, id="b3-t2"),
        ScoreRequest(tuple(_ids(rng, 4) for _ in range(15)), _ids(rng, 16), _ids(rng, 40), id="s-15"),
        ScoreRequest((_ids(rng, 1),), _ids(rng, 1), id="s-batched"),
        BeamRequest(_ids(rng, 30), 16, 3, id="b16-t3"),
        BeamRequest(_ids(rng, 5), 4, 3, id="b4-t3-batched"),
        BeamRequest(_ids(rng, 100), 70, 4, id="b70-t4"),
        BeamRequest(_ids(rng, 1), 5, 5, id="b5-t5"),
        BeamRequest(_ids(rng, 60), 128, 5, id="b128-t5"),
        BeamRequest(_ids(rng, 20), 2, 5, id="b2-t5-batched"),
        BeamRequest(_ids(rng, 3), 999, 2, id="too-wide"),  # a RequestError, same in all three
    ]


def _comparable(results: list) -> list:
    return [(type(r).__name__, str(r)) if isinstance(r, Exception) else r for r in results]


def test_execute_byte_identical_python_eager_graphs(tiny_artifact, runtimes) -> None:
    reqs = _requests()
    out = {name: execute(tiny_artifact, rt, reqs) for name, rt in runtimes.items()}
    assert sum(isinstance(r, Exception) for r in out["python"]) == 1
    for name in ("eager", "graphs"):
        got, want = _comparable(out[name]), _comparable(out["python"])
        differing = [reqs[i].id for i, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not differing, f"{name} differs from the Python runtime in {differing}"
    # replaying the captured graphs again (now warm) gives the same bytes once more
    assert _comparable(execute(tiny_artifact, runtimes["graphs"], reqs)) == _comparable(out["python"])


def _score_batch(art, seed: int = 1) -> ScoreBatch:
    rng = random.Random(seed)
    reqs = [ScoreRequest((_ids(rng, 3), _ids(rng, 5)), _ids(rng, 3), _ids(rng, 9)),
            ScoreRequest((_ids(rng, 6),), _ids(rng, 2))]
    return pack_score(reqs, pick_score_bucket(art.buckets, reqs), art.limits.max_labels)


def _beam_batch(art, widths=(3, 16), new_tokens: int = 5, seed: int = 2) -> BeamBatch:
    rng = random.Random(seed)
    reqs = [BeamRequest(_ids(rng, 4 + 3 * i), w, new_tokens) for i, w in enumerate(widths)]
    return pack_beam(reqs, pick_beam_bucket(art.buckets, reqs))


def test_triton_kernels_byte_identical_python_eager_graphs(tiny_artifact, runtimes) -> None:
    """kernels="triton": both runtimes launch the same AOT cubins: identical bytes, and results within
    bf16 noise of the ATen path (beam ids may differ only where scores tie closely)."""
    from service.runtime.cpp_runtime import CppRuntime
    from service.runtime.python_runtime import PythonRuntime

    rts = {"python": PythonRuntime(tiny_artifact, device="cuda", dtype=DTYPE, kernels="triton"),
           "eager": CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=False, kernels="triton"),
           "graphs": CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, kernels="triton")}
    try:
        reqs = _requests()
        results = {name: execute(tiny_artifact, rt, reqs) for name, rt in rts.items()}
        failed = [(r.id, str(res)) for r, res in zip(reqs, results["python"]) if isinstance(res, ExecutionError)]
        assert not failed, failed  # e.g. a kernel variant missing for some bucket
        out = {name: _comparable(res) for name, res in results.items()}
        assert out["eager"] == out["python"] and out["graphs"] == out["python"]
        aten = execute(tiny_artifact, runtimes["python"], reqs)
        for req, got, want in zip(reqs, execute(tiny_artifact, rts["python"], reqs), aten):
            if isinstance(req, ScoreRequest) and not isinstance(want, Exception):
                diff = max(abs(a - b) for ga, wa in zip(got.scores, want.scores) for a, b in zip(ga, wa))
                assert diff < 0.1, (req.id, diff)
    finally:
        rts["eager"].shutdown()
        rts["graphs"].shutdown()


def test_graph_mode_timings(tiny_artifact, runtimes) -> None:
    rt = runtimes["graphs"]
    assert rt.uses_graphs
    for batch, dag, kind in [(_score_batch(tiny_artifact), tiny_artifact.score_dag, "score"),
                             (_beam_batch(tiny_artifact, new_tokens=4), tiny_artifact.beam_dag, "beam")]:
        for _ in range(2):  # the first run may capture; the second surely replays
            rt.run_score(batch) if kind == "score" else rt.run_beam(batch)
        t = rt.last_timings
        assert t.graph is True
        steps = 1 if kind == "score" else batch.bucket.new_tokens
        assert [n.name for n in t.nodes] == [n.name for n in dag if n.step < steps]
        for node in t.nodes:
            assert node.host_ms >= 0 and node.device_ms >= 0, node
        stamps = [t.submit_ns, t.start_ns, t.h2d_end_ns, t.launch_ns, t.d2h_end_ns, t.done_ns]
        assert stamps == sorted(stamps)


def test_eager_mode_device_timings(tiny_artifact, runtimes) -> None:
    rt = runtimes["eager"]
    rt.run_beam(_beam_batch(tiny_artifact, new_tokens=2))
    t = rt.last_timings
    assert t.graph is False
    assert all(n.device_ms >= 0 for n in t.nodes)


def test_capture_logs_each_bucket(tiny_artifact, runtimes) -> None:
    from service.runtime.cpp_runtime import CppRuntime

    rt = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True)
    batch = _score_batch(tiny_artifact, 21)  # two requests: a bucket of request blocks with R >= 2
    try:
        buckets = [batch.bucket, tiny_artifact.buckets.beam[0], tiny_artifact.buckets.beam[-1]]
        log = rt.capture(buckets, quiet=True)
        assert sorted(e["bucket"] for e in log) == sorted(b.key for b in buckets)
        for entry in log:
            assert entry["capture_ms"] > 0 and entry["reserved_bytes"] > 0, entry
        assert rt.capture(buckets[:1], quiet=True)[0]["capture_ms"] == 0, "already captured: no second capture"
        # a captured bucket then serves a batch by replay, with the Python runtime's bytes
        assert _same_bytes(rt.run_score(batch), runtimes["python"].run_score(batch))
        assert rt.last_timings.graph is True
    finally:
        rt.shutdown()


def test_captured_graphs_share_the_lane_pool(tiny_artifact, runtimes) -> None:
    """Capturing many buckets keeps only each graph's inputs and outputs: the intermediates (logits
    of up to 1536 packed beam rows x 151936 float32 = 0.9 GiB each) go back to the lane's pool and the
    next capture reuses them. Replays of interleaved buckets from that shared pool stay exact."""
    from service.runtime.cpp_runtime import CppRuntime

    rt = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, num_lanes=1)
    try:
        buckets = sorted((b for b in tiny_artifact.buckets.beam if b.new_tokens == 5),
                         key=lambda b: -b.max_rows)
        assert len(buckets) > 20
        log = rt.capture(buckets, quiet=True)
        # torch's reserved bytes are this process's own; the device's used bytes count other test
        # processes too (pytest -n), so they are a measure only when this one runs alone
        for key in ("reserved_bytes",) + (("device_used_bytes",) if "PYTEST_XDIST_WORKER" not in os.environ else ()):
            first, last = log[0][key], log[-1][key]
            assert last - first < 2**30, (key, [(e["bucket"], e[key] >> 20) for e in log])
        batches = [_beam_batch(tiny_artifact, widths, 5, seed) for seed, widths in
                   enumerate([(3, 16), (400,), (1,), (70, 2, 9), (128, 100), (5,)])]
        assert len({b.bucket.key for b in batches}) >= 4
        for batch in batches * 2:
            seqs, scores = rt.run_beam(batch)
            assert rt.last_timings.graph is True
            want_seqs, want_scores = runtimes["eager"].run_beam(batch)
            assert torch.equal(seqs, want_seqs) and _same_bytes(scores, want_scores), batch.bucket.key
    finally:
        rt.shutdown()


def test_lanes_capture_at_once(tiny_artifact, runtimes) -> None:
    """capture(lanes_at_once=True) (serve --capture-graphs parallel): each lane's worker captures its
    own graph of every bucket, the lanes at once; afterwards batches on both lanes replay what was
    captured (no capture at a batch) and give the eager run's bytes, interleaved and concurrent."""
    from service.runtime.cpp_runtime import CppRuntime

    rt = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, num_lanes=2)
    try:
        batches = [_beam_batch(tiny_artifact, widths, 5, seed) for seed, widths in
                   enumerate([(3, 16), (400,), (1,), (70, 2, 9), (128, 100), (5,)])]
        batches += [_score_batch(tiny_artifact, seed) for seed in (3, 21)]
        buckets = list({b.bucket.key: b.bucket for b in batches}.values())
        log = rt.capture(buckets, quiet=True, lanes_at_once=True)
        assert len(log) == len(buckets) and all(e["capture_ms"] > 0 for e in log), log
        assert rt._executor.num_graphs == 2 * len(buckets)
        assert rt.capture(buckets[:1], quiet=True, lanes_at_once=True)[0]["capture_ms"] == 0

        async def main():
            return await asyncio.wait_for(asyncio.gather(*[rt.submit(b) for b in batches * 3]), timeout=300)

        for batch, (outputs, timings) in zip(batches * 3, asyncio.run(main())):
            assert timings.graph is True
            if isinstance(batch, ScoreBatch):
                assert _same_bytes(outputs[0], runtimes["eager"].run_score(batch)), batch.bucket.key
            else:
                want_seqs, want_scores = runtimes["eager"].run_beam(batch)
                assert torch.equal(outputs[0], want_seqs) and _same_bytes(outputs[1], want_scores), batch.bucket.key
        assert rt._executor.num_graphs == 2 * len(buckets), "a batch captured a graph: the lanes' captures were lost"
    finally:
        rt.shutdown()


@pytest.mark.parametrize("kernels", ["aten", "triton"])
def test_conditional_steps_on_the_gpu(tiny_artifact, runtimes, kernels) -> None:
    """beam_graphs="conditional": the buckets of one family (the same requests, prompt tokens, width
    and rows; 1 to 5 new tokens) share one captured graph whose decode steps are IF nodes; each
    batch's replay runs its own steps and gives the bytes of the bucket's own graph, mixed new tokens
    in one batch too; its timings have the first step's nodes, then a "decode step t" a step it ran."""
    from service.artifact.buckets import BeamBucket
    from service.runtime.cpp_runtime import CppRuntime

    plain = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, num_lanes=1, kernels=kernels)
    rt = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, num_lanes=1, kernels=kernels,
                    beam_graphs="conditional")
    try:
        rng = random.Random(5)
        base = pick_beam_bucket(tiny_artifact.buckets, [BeamRequest(_ids(rng, 20), 16, 5)] * 3)
        family = [BeamBucket(n, base.max_requests, base.max_prompt_tokens, base.beam_width, base.max_rows)
                  for n in range(1, tiny_artifact.limits.max_new_tokens + 1)]
        log = rt.capture(family, quiet=True)
        assert sum(e["capture_ms"] > 0 for e in log) == 1 and rt._executor.num_graphs == 1, log
        first = rt.node_names("beam")
        for steps in ([1], [2], [5], [3, 1, 5], [2, 4, 1], [4]):
            reqs = [BeamRequest(_ids(rng, 5 + 7 * i), w, n) for i, (w, n) in enumerate(zip((16, 3, 9), steps))]
            bucket = family[max(steps) - 1]
            batch = pack_beam(reqs, bucket)
            seqs, scores = rt.run_beam(batch)
            t = rt.last_timings
            want_seqs, want_scores = plain.run_beam(batch)
            assert plain.last_timings.graph is True and t.graph is True
            assert torch.equal(seqs, want_seqs) and _same_bytes(scores, want_scores), steps
            names = [n.name for n in t.nodes]
            decode = [f"decode step {k}" for k in range(1, max(steps))]
            assert names[len(names) - len(decode):] == decode and all(n.device_ms >= 0 for n in t.nodes), names
            assert names[:len(names) - len(decode)] == first[:len(names) - len(decode)]
        assert rt._executor.num_graphs == 1, "a batch captured a graph of its own"
    finally:
        rt.shutdown()
        plain.shutdown()


def test_conditional_steps_stop_when_cancelled(tiny_artifact, runtimes) -> None:
    """A family's graph reads its lane's stop flag (mapped host memory) before each decode step:
    cancel() while the graph replays sets it, the run raises RunCancelled (no answers), and the
    lane serves the next batch with the right bytes. Of runs cancelled a quarter of the way into a
    batch's usual time, at least one must end in under 80% of it (the steps after it skipped)."""
    import statistics
    import threading
    import time

    from service.runtime.cpp_runtime import CppRuntime

    rt = CppRuntime(tiny_artifact, device="cuda", dtype=DTYPE, use_graphs=True, num_lanes=1, kernels="triton",
                    beam_graphs="conditional")
    try:
        batch = _beam_batch(tiny_artifact, (400, 400, 400), 5, 11)
        want = rt.run_batch(batch)[0]
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            rt.run_batch(batch)
            times.append(time.perf_counter() - t0)
        whole = statistics.median(times)
        ended: list[float] = []
        for _ in range(30):
            control, outcome = rt.control(), {}

            def run() -> None:
                try:
                    rt.run_batch(batch, control)
                    outcome["answered"] = True
                except RuntimeError as e:
                    outcome["error"] = str(e)

            thread = threading.Thread(target=run)
            t0 = time.perf_counter()
            thread.start()
            time.sleep(whole / 4)
            control.cancel()
            thread.join(60)
            if "error" in outcome:
                assert "cancelled" in outcome["error"], outcome
                ended.append(time.perf_counter() - t0)
        print(f"\n[conditional-cancel] whole batch {whole * 1e3:.2f} ms; {len(ended)} of 30 cancelled, "
              f"the fastest ended after {min(ended, default=float('nan')) * 1e3:.2f} ms")
        assert ended and min(ended) < 0.8 * whole, (whole, sorted(ended)[:5])
        again = rt.run_batch(batch)[0]
        assert torch.equal(again[0], want[0]) and _same_bytes(again[1], want[1])
    finally:
        rt.shutdown()


def test_submit_in_graph_mode(tiny_artifact, runtimes) -> None:
    rt = runtimes["graphs"]
    batches = [_score_batch(tiny_artifact, 3), _beam_batch(tiny_artifact, (2,), 3, 4),
               _score_batch(tiny_artifact, 5), _beam_batch(tiny_artifact, (7, 1), 2, 6)]
    want = [[rt.run_score(b)] if isinstance(b, ScoreBatch) else list(rt.run_beam(b)) for b in batches]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[rt.submit(b) for b in batches]), timeout=120)

    for (outputs, timings), w in zip(asyncio.run(main()), want):
        assert all(torch.equal(a, b) for a, b in zip(outputs, w))
        assert timings.graph is True


def _python_trace(run, batch, names):
    out = []

    def fn(node, env):
        out.append((node.name, {n: env[n].detach().cpu().clone() for n in names if n in env}))

    run(batch, trace=fn)
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("kind", ["score", "beam"])
def test_step_by_step_on_cuda(tiny_artifact, runtimes, kind: str) -> None:
    cfg = tiny_artifact.config
    py = runtimes["python"]
    if kind == "score":
        batch = _score_batch(tiny_artifact, 9)
        names = ["x", "h", "logits", "scores"]
        run = py.run_score
        dag = tiny_artifact.score_dag
    else:
        batch = _beam_batch(tiny_artifact, (3, 70), 5, 10)
        names = ["x", "logits", "beam_tokens", "beam_scores", "beam_parents", "beam_seqs"]
        names += [f"{p}_{kv}.{i}" for p in ("prompt", "suffix") for kv in "kv" for i in range(cfg.num_layers)]
        run = py.run_beam
        dag = [n for n in tiny_artifact.beam_dag if n.step < batch.bucket.new_tokens]
    want = _python_trace(run, batch, names)
    for name in ("eager", "graphs"):  # tracing runs node by node in either mode
        got = runtimes[name].trace(batch, names)
        assert [n for n, _ in got] == [n for n, _ in want] == [n.name for n in dag]
        for (node, gb), (_, wb) in zip(got, want):
            assert set(gb) == set(wb), (node, sorted(gb), sorted(wb))
            for buf in gb:
                assert gb[buf].device.type == "cpu"
                assert _same_bytes(gb[buf], wb[buf]), f"{name}: after {node}, {buf} differs"
