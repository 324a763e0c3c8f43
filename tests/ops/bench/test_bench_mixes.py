"""The variable-shape mixes in the executor bench and the strong peer (ops/bench/bench_executor.py,
ops/bench/hf_peer.py), on the CPU: the batches the bench forms are plan_batches' grouping of the
requests `slmrank bench` draws; the FLOPs it reports are those of exactly the requests run; the
peer pads a mix's Score batches to the stated powers of two, warms every one of them, and its
padded answers equal its unpadded ones."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ops.bench import bench_executor as be
from ops.bench.hf_peer import HFModel, mix_score_shapes, pad_shape
from ops.bench.workloads import (MIXES, Requests, message_flops, mix_requests, mix_score_bounds, parse_workload,
                                 runtime_of)
from service.model.config import ServingLimits
from service.runtime.engine import plan_batches
from service.runtime.requests import BeamRequest, ScoreRequest


@pytest.fixture(scope="module")
def tiny_art(tmp_path_factory: pytest.TempPathFactory):
    from service.artifact.artifact import build_artifact, load_artifact

    return load_artifact(build_artifact("embedded:tiny", tmp_path_factory.mktemp("mixes") / "art", quiet=True))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("mixes") / "qwen2_tiny"
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out)
    return out


@pytest.mark.parametrize("name", sorted(MIXES))
def test_a_mixs_batches_are_plan_batches_grouping_of_slmrank_benchs_requests(tiny_art, name: str) -> None:
    art = tiny_art
    batches = be.mix_batches(art, name, 8, num_requests=96)
    reqs = mix_requests(name, art.config, art.limits, 96)
    assert [r for b in batches for r in b.requests] == reqs  # every request once, in order
    assert [[reqs.index(r) for r in b.requests] for b in batches] == plan_batches(art, reqs, 8)
    assert max(len(b.requests) for b in batches) <= 8 and len(batches) < 96
    # the cap only splits: without it, the engine's own grouping
    assert [[reqs.index(r) for r in b.requests] for b in be.mix_batches(art, name, 10**6, 96)] == plan_batches(art, reqs)
    # the same requests as `slmrank bench --workload name` sends this server (seed 7), FLOPs and all
    msgs = Requests(parse_workload(name, mixes=True), min(150000, art.config.vocab_size), seed=7, limits=art.limits)
    for req, msg in zip(reqs, (msgs.next() for _ in reqs)):
        assert be.request_flops(art.config, req) == message_flops(art.config, msg)
    for b in batches:
        assert b.flops == sum(be.request_flops(art.config, r) for r in b.requests)
        assert b.batch.bucket is not None and b.kind == ("score" if isinstance(b.requests[0], ScoreRequest) else "beam")
    assert {b.kind for b in batches} == set(MIXES[name])


def test_the_reported_flops_are_those_of_exactly_the_requests_run(tiny_art) -> None:
    batches = be.mix_batches(tiny_art, "mixed", 8, num_requests=40)
    ran: list[be.Timed] = []
    r = be.time_batches(ran.append, batches, seconds=0.05)
    timed = ran[len(batches):]  # after the warm-up's one pass
    assert r["batches"] == len(timed) >= 1
    assert r["requests"] == sum(len(b.requests) for b in timed)
    assert r["flops"] == sum(be.request_flops(tiny_art.config, q) for b in timed for q in b.requests)
    assert r["flops"] == sum(b.flops for b in itertools.islice(itertools.cycle(batches), r["batches"]))
    assert r["eff_mfu_bf16"] == pytest.approx(r["flops"] / (r["requests"] / r["req_per_s"]) / be.PEAK_BF16)
    assert r["requests_per_batch"] == pytest.approx(r["requests"] / r["batches"], abs=0.01)


def test_the_mix_padding_is_powers_of_two_and_leaves_the_fixed_shapes_alone() -> None:
    assert pad_shape(120, 64, "fixed") == (128, 64) and pad_shape(15, 88, "fixed") == (16, 96)  # W1..W6: as before
    assert pad_shape(3, 10, "mix") == (8, 64) and pad_shape(120, 129, "mix") == (128, 256)
    assert pad_shape(5, 7, "none") == (5, 7)
    # score-mix within the default limits, 8 requests a batch: rows 8..256 x width 64..512
    assert mix_score_bounds(ServingLimits()) == (30, 416)
    shapes = mix_score_shapes(8, 30, 416)
    assert len(shapes) == 24 and {r for r, _ in shapes} == {8, 16, 32, 64, 128, 256}
    assert {w for _, w in shapes} == {64, 128, 256, 512}


def test_the_peer_on_a_mix_pads_within_the_stated_shapes_and_answers_as_unpadded(tiny_checkpoint: Path) -> None:
    """score-mix's requests (vocabulary 512) in batches of up to 4 through the peer padded "mix":
    every forward ran at a shape of mix_score_shapes, and each request's log-probs equal the
    unpadded model's on that request alone. BeamSearch requests of a batch run one generate per
    width, answered in their order."""
    limits = ServingLimits()
    msgs = Requests(parse_workload("mixed", mixes=True), 512, seed=3, limits=limits)
    reqs = [runtime_of(msgs.next()) for _ in range(24)]
    reqs = [r for r in reqs if isinstance(r, ScoreRequest)][:12] + [
        BeamRequest(prompt_ids=tuple(range(1, 1 + n)), beam_width=w, new_tokens=3) for n, w in ((5, 3), (9, 2), (4, 3))]
    batches = [be.Timed(reqs[i:i + 4], "", None, 0) for i in range(0, 12, 4)] + [be.Timed(reqs[12:], "", None, 0)]
    padded, plain = HFModel(str(tiny_checkpoint), "cpu", padding="mix"), HFModel(str(tiny_checkpoint), "cpu")
    allowed = set(mix_score_shapes(4, *mix_score_bounds(limits)))
    shapes = be.peer_shapes(padded, batches)
    assert shapes and shapes <= allowed, shapes - allowed
    for b in batches:
        for req, got in zip(b.requests, be.peer_run(padded, b.requests)):
            if isinstance(req, ScoreRequest):
                want = plain.score(list(req.prefix_ids), [list(s) for s in req.samples], list(req.label_ids))
                assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
            else:
                want = plain.beam(list(req.prompt_ids), req.beam_width, req.new_tokens)
                assert [s for s, _ in got] == [s for s, _ in want]
                assert max(abs(a - c) for (_, a), (_, c) in zip(got, want)) < 1e-4
    # the start-up warm-up runs each shape of the set once (here eager: 2 requests of <= 30 x 416)
    ran = padded.warm_mix(2, 30, 416)
    assert [(r["rows"], r["width"]) for r in ran] == mix_score_shapes(2, 30, 416) and len(ran) == 16
