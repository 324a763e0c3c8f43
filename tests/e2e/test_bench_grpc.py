"""ops/bench/bench_grpc.py end to end on the CPU: `slmrank serve` and the Hugging Face peer as
subprocesses on loopback, a tiny random Qwen2 checkpoint (vocab 512) that both load, a small Score
workload, levels 1 and 2. The numbers are not judged, only that the report is whole and sane; and
the two systems' answers on the same requests agree within 1e-4 (same weights, float32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch


def _checkpoint(out: Path, max_positions: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                      initializer_range=0.3, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("bench_grpc") / "qwen2_tiny", 256)


@pytest.mark.parametrize("workload", ["score,prefix=5,samples=3,len=7,labels=2"])
def test_bench_grpc_with_peer(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              workload: str) -> None:
    from ops.bench import bench_grpc

    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    bench_grpc.main(["--workload", workload, "--levels", "1,2", "--warmup-s", "0.2", "--measure-s", "1",
                     "--out", str(out), "--peer", "--device", "cpu", "--model", str(tiny_checkpoint),
                     "--check-requests", "3", "--start-timeout-s", "60"])
    result = json.loads((out / "bench_grpc.json").read_text())

    assert set(result["systems"]) == {"slmrank", "hf_peer"} and "partial" not in result
    assert result["logical_flops_per_request"] > 0
    assert result["id_range"] == [0, 512]
    for name, system in result["systems"].items():
        assert [r["level"] for r in system["levels"]] == [1, 2], name
        for r in system["levels"]:
            assert r["qps"] > 0 and r["completed"] > 0, (name, r)
            assert r["mean_ms"] > 0 and r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0, (name, r)
            assert r["num_errors"] == 0 and r["errors"] == {}, (name, r)
        assert system["exit_code"] == 0, name
        for r in system["levels"]:  # the server's own view over the window: slmrank's /metrics only
            sv = r["server"]
            if name != "slmrank":
                assert sv is None
                continue
            assert sv["batches"] >= 1 and 0 < sv["requests_per_batch"] <= r["level"] + 1, sv
            assert {"decode", "queue", "execute", "encode"} <= set(sv["stage_mean_ms"]), sv
            assert sv["stage_mean_ms"]["execute"] > 0
            # the server's latency holds its stages, and the client's holds the server's
            assert sum(sv["stage_mean_ms"].values()) <= sv["latency_mean_ms"] * 1.01 + 0.05, sv
            assert sv["latency_mean_ms"] < r["mean_ms"], (sv, r)
            if Path("/proc/self/task").is_dir():  # the loop thread's CPU, from /proc
                assert sv["loop_cpu_ms_per_request"] > 0 and 0 < sv["loop_busy"] < 1.5, sv
        cap = system["capacity"]
        if cap is not None:
            assert cap["mean_ms"] < 20 and cap["p99_ms"] < 80
            assert system["eff_mfu_bf16"] > 0

    agree = result["agreement"]
    assert agree["requests"] == 3
    assert agree["max_abs_logprob_diff"] < 1e-4, agree
    first = agree["first"]
    assert len(first["slmrank"]["samples"]) == len(first["hf_peer"]["samples"]) == 3
    for a, b in zip(first["slmrank"]["samples"], first["hf_peer"]["samples"]):
        assert a["logprobs"] == pytest.approx(b["logprobs"], abs=1e-4)


def test_bench_grpc_score_mix_with_the_strong_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--workload score-mix --strong-peer: both systems take the same pool, drawn within slmrank's
    limits; effective MFU from the FLOPs of the requests completed; the peer pads to powers of two
    and warms each such shape before serving (TORCH_COMPILE_DISABLE: the compiled path runs eagerly,
    ~17 s a shape of compile on this CPU otherwise). 2,048 positions: slmrank's limits hold
    score-mix's requests (with 256, hardly one in a thousand draws fits)."""
    from ops.bench import bench_grpc
    from ops.bench.hf_peer import mix_score_shapes

    tiny_checkpoint = _checkpoint(tmp_path / "qwen2_tiny", 2048)
    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    out = tmp_path / "out"
    bench_grpc.main(["--workload", "score-mix", "--levels", "1,2", "--warmup-s", "2", "--measure-s", "2",
                     "--out", str(out), "--strong-peer", "2", "--device", "cpu", "--model", str(tiny_checkpoint),
                     "--check-requests", "2", "--pool", "32", "--start-timeout-s", "120"])
    result = json.loads((out / "bench_grpc.json").read_text())
    assert set(result["systems"]) == {"slmrank", "hf_strong"} and result["logical_flops_per_request"] is None
    for name, system in result["systems"].items():
        assert system["pool"]["score"]["requests"] == 32 and "beam" not in system["pool"], name
        assert system["pool"] == result["systems"]["slmrank"]["pool"]  # the same requests
        # a score-mix request can take a second on this CPU: a level's window may close on none
        assert sum(r["completed"] for r in system["levels"]) > 0, name
        for r in system["levels"]:
            assert r["num_errors"] == 0 and (r["flops_per_s"] > 0) == (r["completed"] > 0), (name, r)
        cap = system["capacity"]
        assert system["eff_mfu_bf16"] == (pytest.approx(cap["flops_per_s"] / 989e12) if cap else 0.0)
    assert result["agreement"]["max_abs_logprob_diff"] < 1e-4, result["agreement"]
    # slmrank's limits (2,048 tokens, 64 samples) cut neither bound: rows 8..64 x width 64..512 warmed
    assert result["peers"]["hf_strong"][-2:] == ["--warm-mix", "30:416"] and len(mix_score_shapes(2, 30, 416)) == 16


def test_a_run_cut_during_the_peer_keeps_slmranks_figures(tiny_checkpoint: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_grpc.json is written after each system, marked partial until the run ends: a run cut
    while the peer is measured (ops/device/capacity's time limit) still holds slmrank's levels."""
    from ops.bench import bench_grpc

    real = bench_grpc.bench_system

    async def cut_at_the_peer(name, *a, **kw):
        if name != "slmrank":
            raise KeyboardInterrupt  # what a time limit's signal does mid-run
        return await real(name, *a, **kw)

    monkeypatch.setattr(bench_grpc, "bench_system", cut_at_the_peer)
    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        bench_grpc.main(["--workload", "score,prefix=0,samples=2,len=4,labels=2", "--levels", "1",
                         "--warmup-s", "0.1", "--measure-s", "0.3", "--out", str(out), "--peer", "--device", "cpu",
                         "--model", str(tiny_checkpoint), "--check-requests", "1", "--start-timeout-s", "60"])
    result = json.loads((out / "bench_grpc.json").read_text())
    assert result["partial"] is True and set(result["systems"]) == {"slmrank"}
    assert [r["level"] for r in result["systems"]["slmrank"]["levels"]] == [1]
    assert result["systems"]["slmrank"]["levels"][0]["completed"] > 0


def test_strong_peer_batches_agree_with_one_at_a_time(tiny_checkpoint: Path) -> None:
    """The strong peer's batched calls (several requests in one forward / one generate, padded)
    answer each request as the one-at-a-time calls do."""
    from ops.bench.hf_peer import HFModel

    model = HFModel(str(tiny_checkpoint), "cpu")
    g = torch.Generator().manual_seed(11)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 512, (n,), generator=g).tolist()

    scores = [(ids(p), [ids(n) for n in lens], [3, 77]) for p, lens in ((0, (4, 9)), (5, (1, 6, 2)), (2, (7,)))]
    batched = model.score_many(scores)
    for req, got in zip(scores, batched):
        assert torch.allclose(torch.tensor(got), torch.tensor(model.score(*req)), atol=1e-4)
    prompts = [ids(n) for n in (6, 11, 3)]
    for (want_seqs, got_seqs) in zip((model.beam(p, 4, 3) for p in prompts), model.beam_many(prompts, 4, 3)):
        assert [s for s, _ in got_seqs] == [s for s, _ in want_seqs]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got_seqs, want_seqs)) < 1e-4


def test_the_strong_peer_warms_each_padded_score_shape_once(tiny_checkpoint: Path) -> None:
    """--warm-score: one batch per distinct padded shape of 1..max-batch requests. W1's shape (15
    samples of 64) pads to 16, 32, 64 (3 and 4 requests) and 128 rows (5 to 8): four batches, of 1,
    2, 3 and 5 requests; unpadded (not compiled) every count is its own shape. Bad values name the
    option."""
    from ops.bench.hf_peer import HFModel, _warm_shape, start_peer

    model = HFModel(str(tiny_checkpoint), "cpu")
    assert [r["requests"] for r in model.warm_score(3, 5, 2, 4)] == [1, 2, 3, 4]
    model.compiled = True  # the padding a compiled model gets (the forward itself stays eager here)
    ran = model.warm_score(15, 64, 0, 8)
    assert [(r["requests"], r["rows"], r["width"]) for r in ran] == [(1, 16, 64), (2, 32, 64), (3, 64, 64),
                                                                     (5, 128, 64)]
    assert [(r["rows"], r["width"]) for r in model.warm_score(15, 24, 384, 2)] == [(16, 416), (32, 416)]
    # at start-up, before serving: the shapes are printed to the peer's log
    async def start_and_stop() -> None:
        server, port = await start_peer(str(tiny_checkpoint), max_batch=2, warm_score=(3, 5, 0))
        assert port > 0
        await server.stop(None)

    asyncio.run(start_and_stop())
    assert _warm_shape("15:64:0") == (15, 64, 0)
    for bad in ("15:64", "a:1:0", "0:64:0"):
        with pytest.raises(argparse.ArgumentTypeError, match="--warm-score"):
            _warm_shape(bad)


def test_server_breakdown_is_the_window_delta() -> None:
    """Stage means, requests per batch and the loop's share come from the difference of two
    scrapes, not from the totals since start."""
    from ops.bench import bench_grpc

    stage = 'kind="Score",stage="execute"'
    before = {("slmrank_request_stage_seconds_sum", stage): 10.0, ("slmrank_request_stage_seconds_count", stage): 1000,
              ("slmrank_node_batches_total", 'mode="graph"'): 300, ("slmrank_event_loop_cpu_seconds_total", ""): 50.0,
              ("slmrank_request_latency_seconds_sum", 'kind="Score"'): 20.0,
              ("slmrank_request_latency_seconds_count", 'kind="Score"'): 1000}
    after = {("slmrank_request_stage_seconds_sum", stage): 10.6, ("slmrank_request_stage_seconds_count", stage): 1040,
             ("slmrank_node_batches_total", 'mode="graph"'): 310, ("slmrank_event_loop_cpu_seconds_total", ""): 52.0,
             ("slmrank_request_latency_seconds_sum", 'kind="Score"'): 20.8,
             ("slmrank_request_latency_seconds_count", 'kind="Score"'): 1040}
    sv = bench_grpc.server_breakdown(before, after, requests=40, window_s=4.0)
    assert sv["stage_mean_ms"] == {"execute": pytest.approx(15.0)} and sv["latency_mean_ms"] == pytest.approx(20.0)
    assert sv["batches"] == 10 and sv["requests_per_batch"] == 4.0
    assert sv["loop_cpu_ms_per_request"] == pytest.approx(50.0) and sv["loop_busy"] == pytest.approx(0.5)
    text = "\n".join(["# HELP x", 'slmrank_request_stage_seconds_sum{kind="Score",stage="execute"} 1.5',
                      "slmrank_event_loop_cpu_seconds_total 3.25", 'slmrank_queue_depth{lane="NORMAL"} 3',
                      'slmrank_batch_size_bucket{le="2"} 7'])
    lines = text.splitlines()
    assert all(bench_grpc._SAMPLE.match(line) for line in lines[1:4])
    assert bench_grpc._SAMPLE.match(lines[4]) is None  # a series no bench reads
