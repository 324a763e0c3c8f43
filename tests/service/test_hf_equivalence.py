"""slmrank's Score and BeamSearch equal Hugging Face transformers on the same checkpoint.

Tiny random Qwen2 (q/k/v bias, tied embeddings), Qwen3 (q/k norm, untied embeddings), a sharded
Qwen3 checkpoint and a Qwen2ForSequenceClassification, all made with transformers and loaded by
slmrank from their save_pretrained directories (see conftest.py).
"""

from __future__ import annotations

import json
import random

import pytest

from service.runtime.engine import execute, plan_batches
from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult

TOL = 1e-4
ARCHS = ["qwen2_tiny", "qwen3_tiny"]


def _model(request, name):
    return request.getfixturevalue(name)


def _check_score(m, hf_ref, req: ScoreRequest, res) -> None:
    assert isinstance(res, ScoreResult), res
    assert len(res.scores) == len(req.samples)
    for sample, got in zip(req.samples, res.scores):
        want = hf_ref.label_logprobs(m.hf, list(req.prefix_ids) + list(sample), list(req.label_ids))
        assert len(got) == len(req.label_ids)
        diff = max(abs(a - b) for a, b in zip(got, want))
        assert diff <= TOL, f"score differs from HF by {diff}: {got} vs {want}"


def _check_beam(m, hf_ref, req: BeamRequest, res) -> None:
    assert isinstance(res, BeamResult), res
    want_ids, want_scores = hf_ref.beam(m.hf, list(req.prompt_ids), req.beam_width, req.new_tokens)
    got_ids = [b.ids for b in res.beams]
    assert len(got_ids) == req.beam_width
    assert got_ids == want_ids, f"B={req.beam_width} T={req.new_tokens}: beam ids differ from HF"
    diff = max(abs(b.logprob - s) for b, s in zip(res.beams, want_scores))
    assert diff <= TOL, f"B={req.beam_width} T={req.new_tokens}: cumulative scores differ from HF by {diff}"
    logprobs = [b.logprob for b in res.beams]
    assert logprobs == sorted(logprobs, reverse=True), "beams are not best first"


# ---- Score ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "prefix"])
def test_score_single_request(request, hf_ref, arch, with_prefix):
    m = _model(request, arch)
    rng = random.Random(f"{arch}-{with_prefix}")  # str seeds are deterministic (not hash-randomised)
    req = ScoreRequest(samples=tuple(hf_ref.rand_ids(rng, rng.randint(1, 9)) for _ in range(5)),
                       label_ids=hf_ref.rand_ids(rng, 6),
                       prefix_ids=hf_ref.rand_ids(rng, 11) if with_prefix else ())
    (res,) = execute(m.artifact, m.runtime, [req])
    _check_score(m, hf_ref, req, res)


@pytest.mark.parametrize("arch", ARCHS)
def test_score_several_requests_batched(request, hf_ref, arch):
    m = _model(request, arch)
    rng = random.Random(7 if arch == "qwen2_tiny" else 8)
    reqs = []
    for i in range(6):
        prefix = hf_ref.rand_ids(rng, rng.randint(1, 20)) if i % 2 else ()
        labels = hf_ref.rand_ids(rng, rng.randint(1, m.artifact.limits.max_labels))
        if i == 3:
            labels = labels[:2] + labels[:2]  # repeated label ids are answered per position
        reqs.append(ScoreRequest(samples=tuple(hf_ref.rand_ids(rng, rng.randint(1, 12))
                                               for _ in range(rng.randint(1, 7))),
                                 label_ids=labels, prefix_ids=prefix, id=f"r{i}"))
    assert len(plan_batches(m.artifact, reqs)) == 1, "the requests were meant to share one batch"
    results = execute(m.artifact, m.runtime, reqs)
    assert len(results) == len(reqs)
    for req, res in zip(reqs, results):
        _check_score(m, hf_ref, req, res)


def test_score_one_token_samples_and_long_prefix(qwen3_tiny, hf_ref):
    m = qwen3_tiny
    rng = random.Random(99)
    prefix = hf_ref.rand_ids(rng, 200)
    req = ScoreRequest(samples=tuple(hf_ref.rand_ids(rng, 1) for _ in range(8)),
                       label_ids=hf_ref.rand_ids(rng, 3), prefix_ids=prefix)
    (res,) = execute(m.artifact, m.runtime, [req])
    _check_score(m, hf_ref, req, res)


# ---- BeamSearch -------------------------------------------------------------------------------

BEAM_CASES = [(1, 1), (1, 5), (4, 2), (4, 5), (16, 3), (16, 4), (80, 1), (80, 5)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beams,new_tokens", BEAM_CASES, ids=[f"B{b}-T{t}" for b, t in BEAM_CASES])
def test_beam_search_equals_hf_generate(request, hf_ref, arch, beams, new_tokens):
    m = _model(request, arch)
    rng = random.Random(1000 * beams + new_tokens + (0 if arch == "qwen2_tiny" else 500))
    req = BeamRequest(prompt_ids=hf_ref.rand_ids(rng, rng.randint(1, 24)), beam_width=beams, new_tokens=new_tokens)
    (res,) = execute(m.artifact, m.runtime, [req])
    assert all(len(b.ids) == new_tokens for b in res.beams)
    _check_beam(m, hf_ref, req, res)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_batched_requests_each_equal_hf(request, hf_ref, arch):
    m = _model(request, arch)
    rng = random.Random(4242 if arch == "qwen2_tiny" else 4343)
    # one bucket of width 128 and 5 steps, 4 requests of 3, 5, 1 and 2 new tokens: each answered at its own step
    widths_and_lengths = [(16, 7, 3), (1, 30, 5), (80, 3, 1), (5, 1, 2)]
    reqs = [BeamRequest(prompt_ids=hf_ref.rand_ids(rng, n), beam_width=b, new_tokens=t, id=f"b{i}")
            for i, (b, n, t) in enumerate(widths_and_lengths)]
    assert len(plan_batches(m.artifact, reqs)) == 1, "the beam requests were meant to share one batch"
    results = execute(m.artifact, m.runtime, reqs)
    for req, res in zip(reqs, results):
        assert all(len(b.ids) == req.new_tokens for b in res.beams)
        _check_beam(m, hf_ref, req, res)


# ---- sharded checkpoint -----------------------------------------------------------------------

def test_sharded_checkpoint_loads_and_equals_hf(qwen3_sharded, hf_ref):
    m = qwen3_sharded
    shards = sorted(p.name for p in m.ckpt.glob("*.safetensors"))
    index = m.ckpt / "model.safetensors.index.json"
    assert len(shards) >= 3, f"expected several shards, got {shards}"
    assert index.exists()
    assert set(json.loads(index.read_text())["weight_map"].values()) == set(shards)
    rng = random.Random(5)
    score = ScoreRequest(samples=(hf_ref.rand_ids(rng, 4), hf_ref.rand_ids(rng, 9)),
                         label_ids=hf_ref.rand_ids(rng, 5), prefix_ids=hf_ref.rand_ids(rng, 6))
    beam = BeamRequest(prompt_ids=hf_ref.rand_ids(rng, 12), beam_width=4, new_tokens=3)
    res_score, res_beam = execute(m.artifact, m.runtime, [score, beam])
    _check_score(m, hf_ref, score, res_score)
    _check_beam(m, hf_ref, beam, res_beam)


# ---- classification head ----------------------------------------------------------------------

@pytest.mark.parametrize("with_prefix", [False, True], ids=["no_prefix", "prefix"])
def test_classification_head_equals_hf_logits(qwen2_cls, with_prefix):
    import torch

    m = qwen2_cls
    assert m.artifact.config.num_labels == 3
    rng = random.Random(31 + with_prefix)
    prefix = tuple(rng.randrange(512) for _ in range(8)) if with_prefix else ()
    reqs = [ScoreRequest(samples=tuple(tuple(rng.randrange(512) for _ in range(rng.randint(1, 10)))
                                       for _ in range(k)), prefix_ids=prefix)
            for k in (1, 4)]
    results = execute(m.artifact, m.runtime, reqs)
    for req, res in zip(reqs, results):
        assert isinstance(res, ScoreResult), res
        assert len(res.scores) == len(req.samples)
        for sample, got in zip(req.samples, res.scores):
            with torch.no_grad():
                want = m.hf(torch.tensor([list(prefix) + list(sample)])).logits[0].float().tolist()
            assert len(got) == 3
            diff = max(abs(a - b) for a, b in zip(got, want))
            assert diff <= TOL, f"classification outputs differ from HF by {diff}: {got} vs {want}"


# ---- config reading and the position limits ---------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_config_read_from_checkpoint(request, arch):
    m = _model(request, arch)
    hf, cfg = m.hf.config, m.artifact.config
    assert cfg.arch == hf.model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size) == (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
                                       hf.num_key_value_heads, hf.head_dim, hf.intermediate_size)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.max_positions == hf.max_position_embeddings
    assert cfg.qk_norm == (cfg.arch == "qwen3") and cfg.attention_bias == (cfg.arch == "qwen2")
    assert cfg.arch == arch.removesuffix("_tiny")


@pytest.mark.parametrize("arch", ARCHS)
def test_longest_allowed_requests_equal_hf(request, hf_ref, arch):
    """At the limits: a Score of exactly max_score_tokens and a beam over the longest prompt with the most
    new tokens reach the last rotary position of the model."""
    m = _model(request, arch)
    lim = m.artifact.limits
    assert lim.max_prompt_tokens + lim.max_new_tokens == m.artifact.config.max_positions
    rng = random.Random(606)
    score = ScoreRequest(samples=(hf_ref.rand_ids(rng, lim.max_score_tokens - 100), hf_ref.rand_ids(rng, 3)),
                         label_ids=hf_ref.rand_ids(rng, 4), prefix_ids=hf_ref.rand_ids(rng, 97))
    assert score.num_tokens == lim.max_score_tokens
    beam = BeamRequest(prompt_ids=hf_ref.rand_ids(rng, lim.max_prompt_tokens), beam_width=4,
                       new_tokens=lim.max_new_tokens)
    res_score, res_beam = execute(m.artifact, m.runtime, [score, beam])
    _check_score(m, hf_ref, score, res_score)
    _check_beam(m, hf_ref, beam, res_beam)
