"""The float64 truth of `slmrank evaluate --truth float64` (service/evaluate/truth.py), a decoder of
its own: equal to Hugging Face transformers run in float64 on the same checkpoint (Qwen2: q/k/v
bias, tied embeddings; Qwen3: q/k norms, untied; a classification head), Score and BeamSearch,
and to the runtime on catalog-constrained BeamSearch (only items, fewer beams than B)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from service.artifact.artifact import build_artifact, load_artifact
from service.evaluate.truth import Float64Model
from service.runtime.engine import execute
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest

TOL = 2e-6  # HF in float64 still takes RMSNorm's variance in float32 (the truth does not): ~1e-7 apart


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def tiny(request):
    m = request.getfixturevalue(request.param)
    return m, copy.deepcopy(m.hf).double(), Float64Model(m.artifact)


def test_score_equals_hf_in_float64(tiny, hf_ref) -> None:
    m, hf, truth = tiny
    rng = random.Random(3)
    for prefix_len in (0, 7):
        prefix = hf_ref.rand_ids(rng, prefix_len)
        samples = tuple(hf_ref.rand_ids(rng, n) for n in (1, 4, 9))
        labels = hf_ref.rand_ids(rng, 3)
        got = truth.score(ScoreRequest(samples=samples, label_ids=labels, prefix_ids=prefix)).scores
        with torch.no_grad():
            for sample, row in zip(samples, got):
                logits = hf(torch.tensor([list(prefix + sample)])).logits[0, -1]
                want = torch.log_softmax(logits, -1)[list(labels)]
                assert want.dtype == torch.float64
                assert torch.allclose(torch.tensor(row, dtype=torch.float64), want, atol=TOL, rtol=0), (row, want)


def test_beams_equal_hf_in_float64(tiny, hf_ref) -> None:
    m, hf, truth = tiny
    rng = random.Random(4)
    for width, steps in ((1, 4), (4, 3), (12, 2)):
        prompt = hf_ref.rand_ids(rng, rng.randrange(2, 10))
        seqs, scores = hf_ref.beam(hf, list(prompt), width, steps)
        got = truth.beam(BeamRequest(prompt_ids=prompt, beam_width=width, new_tokens=steps)).beams
        assert [b.ids for b in got] == seqs
        assert max(abs(b.logprob - s) for b, s in zip(got, scores)) < 1e-5  # hf_beam's scores are float32


def test_a_classification_head_gives_its_outputs(qwen2_cls, hf_ref) -> None:
    truth = Float64Model(qwen2_cls.artifact)
    hf = copy.deepcopy(qwen2_cls.hf).double()
    rng = random.Random(5)
    prefix, samples = hf_ref.rand_ids(rng, 5), (hf_ref.rand_ids(rng, 3), hf_ref.rand_ids(rng, 6))
    got = truth.score(ScoreRequest(samples=samples, prefix_ids=prefix)).scores
    with torch.no_grad():
        for sample, row in zip(samples, got):
            want = hf(torch.tensor([list(prefix + sample)])).logits[0]
            assert len(row) == 3 and torch.allclose(torch.tensor(row, dtype=torch.float64), want, atol=TOL, rtol=0)


def test_catalog_beams_are_the_runtimes(qwen2_tiny, tmp_path) -> None:
    """Held to a catalog: the same items as the Python runtime (float32), best first; a catalog of
    3 items gives 3 beams to a request of width 8."""
    rng = random.Random(6)
    codes = {f"item-{i}": tuple(rng.randrange(512) for _ in range(3)) for i in range(40)}
    (tmp_path / "many.tsv").write_text("".join(f"{k}\t{' '.join(map(str, v))}\n" for k, v in codes.items()))
    (tmp_path / "few.tsv").write_text("a\t1 2 3\nb\t1 2 4\nc\t5 6 7\n")
    art = load_artifact(build_artifact(str(qwen2_tiny.ckpt), tmp_path / "art", quiet=True,
                                       catalogs={"many": tmp_path / "many.tsv", "few": tmp_path / "few.tsv"}))
    truth = Float64Model(art)
    reqs = [BeamRequest(prompt_ids=(3, 9, 27), beam_width=6, new_tokens=3, catalog="many"),
            BeamRequest(prompt_ids=(11, 12), beam_width=8, new_tokens=3, catalog="few"),
            BeamRequest(prompt_ids=(11, 12), beam_width=5, new_tokens=3)]
    for req, res in zip(reqs, execute(art, PythonRuntime(art), reqs)):
        got = truth.beam(req).beams
        assert [(b.ids, b.item_id) for b in got] == [(b.ids, b.item_id) for b in res.beams]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, res.beams)) < 1e-4
    assert len(truth.beam(reqs[1]).beams) == 3 and all(b.item_id in codes for b in truth.beam(reqs[0]).beams)
