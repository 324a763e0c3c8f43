"""Beam rows packed by each request's own width (issue 26, point 2): requests of different widths
and prompt lengths share one batch of sum-of-widths rows, and that never changes an answer, on the
Python and the C++ runtime alike (CPU, float32):

- the same batch with more beam rows and a wider bookkeeping (the same prompt tokens and request
  slots) gives the very same bytes: padding rows and ranks are never read;
- each request's answer equals its answer alone, byte for byte. On the CPU that takes two things
  (service/model/layers.py): the prompt attention runs a request's rows over its own prompt keys
  only, and the prefill a request at a time (the dense form summed a request's keys in SIMD lanes
  that depended on where its prompt lay among the packed prompt tokens); and a GEMM of fewer than 12
  rows is padded to a multiple of 4 (MKL rounds the rows past the last 4 of such a call otherwise:
  the prefill's LM head has a row a request slot)."""

from __future__ import annotations

import random

import pytest
import torch

from service.artifact.buckets import BeamBucket
from service.runtime.batch import pack_beam, pick_beam_bucket
from service.runtime.requests import BeamRequest

SHAPES = [(5, 33), (40, 2), (12, 17), (1, 1), (70, 9), (23, 60)]  # (prompt tokens, beam width)


def _run(rt, reqs, bucket) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, scores = rt.run_beam(pack_beam(reqs, bucket))
    return seqs.cpu(), scores.cpu()


@pytest.mark.parametrize("runtime", ["python", "cpp"])
@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small"])
def test_packed_beam_rows_never_change_an_answer(model_name: str, runtime: str, request: pytest.FixtureRequest,
                                                 helpers) -> None:
    model = request.getfixturevalue(model_name)
    art, rt = model.artifact, getattr(model, runtime)
    rng = random.Random(26)
    reqs = [BeamRequest(helpers.rand_ids(rng, n), b, 4) for n, b in SHAPES]
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert sum(r.beam_width for r in reqs) <= bucket.max_rows < len(reqs) * bucket.beam_width
    seqs, scores = _run(rt, reqs, bucket)
    widths = torch.tensor([r.beam_width for r in reqs])
    assert torch.isneginf(scores[:len(reqs)]).eq(torch.arange(scores.shape[1]) >= widths.unsqueeze(1)).all()

    slots = bucket.max_requests
    for rows, width in ((bucket.max_rows + 5, bucket.beam_width), (3 * bucket.max_rows, 2 * bucket.beam_width)):
        big = BeamBucket(4, slots, bucket.max_prompt_tokens, width, rows)
        big_seqs, big_scores = _run(rt, reqs, big)
        for r, w in enumerate(widths.tolist()):
            assert helpers.same_bytes(big_seqs[r, :w], seqs[r, :w]), f"request {r}: beams differ in {big.key}"
            assert helpers.same_bytes(big_scores[r, :w], scores[r, :w]), f"request {r}: scores differ in {big.key}"

    for r, req in enumerate(reqs):
        a_seqs, a_scores = _run(rt, [req], pick_beam_bucket(art.buckets, [req]))
        w = req.beam_width
        assert torch.equal(seqs[r, :w], a_seqs[0, :w]), f"request {r}: its beams changed in the batch"
        assert helpers.same_bytes(scores[r, :w], a_scores[0, :w]), \
            f"request {r}: scores moved by {(scores[r, :w] - a_scores[0, :w]).abs().max()} in the batch"


@pytest.mark.parametrize("runtime", ["python", "cpp"])
@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small"])
def test_requests_of_different_new_tokens_share_a_batch_and_answer_as_alone(
        model_name: str, runtime: str, request: pytest.FixtureRequest, helpers) -> None:
    """Requests generating 1 to 5 tokens in one batch of 5 steps: each is answered with its beams as
    they stood after its own last step (the beam_hold nodes), byte for byte its answer alone in a
    bucket of its own new_tokens; padding requests and the batch's later steps change nothing. (That
    the answers alone, and those of a mixed batch, are Hugging Face's: test_hf_equivalence.)"""
    from service.runtime.batch import unpack_beam

    model = request.getfixturevalue(model_name)
    art, rt = model.artifact, getattr(model, runtime)
    rng = random.Random(2605)
    reqs = [BeamRequest(helpers.rand_ids(rng, n), b, t) for (n, b), t in zip(SHAPES, (3, 1, 5, 2, 4, 1))]
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert bucket.new_tokens == 5 and bucket.max_requests > len(reqs)  # a padding request slot too
    batch = pack_beam(reqs, bucket)
    assert batch.inputs["beam_steps"].tolist() == [3, 1, 5, 2, 4, 1] + [5] * (bucket.max_requests - len(reqs))
    seqs, scores = rt.run_beam(batch)
    got = unpack_beam(batch, seqs.cpu(), scores.cpu())
    for r, req in enumerate(reqs):
        alone_bucket = pick_beam_bucket(art.buckets, [req])
        assert alone_bucket.new_tokens == req.new_tokens
        a_seqs, a_scores = _run(rt, [req], alone_bucket)
        w, n = req.beam_width, req.new_tokens
        assert torch.equal(seqs[r, :w, :n], a_seqs[0, :w]), f"request {r} ({n} tokens): its beams changed in the batch"
        assert helpers.same_bytes(scores[r, :w], a_scores[0, :w]), \
            f"request {r} ({n} tokens): scores moved by {(scores[r, :w] - a_scores[0, :w]).abs().max()} in the batch"
        assert [b.ids for b in got[r].beams] == a_seqs[0, :w].tolist()  # unpack keeps its own n columns
