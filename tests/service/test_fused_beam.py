"""kernels="triton": the fused beam step (kernels/beam_topk.py: each parent row's top-B and
log-sum-exp in one pass over the model-dtype logits, top-B of B x B per request; every layer's
suffix K/V reordered in one gather) gives Hugging Face's beams, exactly as the ATen path does.
On a CPU the Python runtime runs the kernels through Triton's interpreter; on a GPU both runtimes
launch the AOT cubins (tests/cpp_dag GPU identity)."""

from __future__ import annotations

import random

import pytest
import torch

from service.runtime.batch import pack_beam, pick_beam_bucket
from service.runtime.engine import execute
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, BeamResult

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def fused(request):
    m = request.getfixturevalue(request.param)
    return m, PythonRuntime(m.artifact, kernels="triton")


def test_fused_beam_search_equals_hf_and_the_aten_path(fused, hf_ref) -> None:
    """Batches of several requests, some narrower than their bucket (dead beams), 2 to 5 new tokens."""
    m, rt = fused
    rng = random.Random(17)
    reqs = [BeamRequest(hf_ref.rand_ids(rng, 12), 4, 5), BeamRequest(hf_ref.rand_ids(rng, 7), 3, 5),
            BeamRequest(hf_ref.rand_ids(rng, 20), 2, 3), BeamRequest(hf_ref.rand_ids(rng, 4), 1, 3),
            BeamRequest(hf_ref.rand_ids(rng, 9), 6, 2)]
    got = execute(m.artifact, rt, reqs)
    plain = execute(m.artifact, m.runtime, reqs)
    for req, res, ref in zip(reqs, got, plain):
        assert isinstance(res, BeamResult), res
        want_ids, want_scores = hf_ref.beam(m.hf, list(req.prompt_ids), req.beam_width, req.new_tokens)
        assert [b.ids for b in res.beams] == want_ids == [b.ids for b in ref.beams]
        assert max(abs(b.logprob - s) for b, s in zip(res.beams, want_scores)) <= TOL


def test_fused_beam_state_is_one_suffix_buffer(fused, hf_ref) -> None:
    """With the fused kernels the per-layer suffix K/V are views of one buffer that is never
    reordered: a beam step hands each packed row its parent row's suffix_rows for the slots written
    so far (its own for the rest), and the last step leaves them as they are; the logits reach the
    beam nodes in the model dtype."""
    m, rt = fused
    reqs = [BeamRequest(hf_ref.rand_ids(random.Random(3), 6), 4, 3)]
    bucket = pick_beam_bucket(m.artifact.buckets, reqs)
    seen: dict[str, tuple] = {}

    def trace(node, env) -> None:
        if node.type in ("beam_init", "beam_step"):
            seen[node.name] = (env["logits"].dtype, env["suffix_kv"].data_ptr(),
                               all(env[f"suffix_k.{i}"].data_ptr() == env["suffix_kv"][i, 0].data_ptr()
                                   for i in range(m.artifact.config.num_layers)),
                               env["suffix_rows"].clone(), env["beam_parents"].clone())

    batch = pack_beam(reqs, bucket)
    rt.run_beam(batch, trace=trace)
    assert set(seen) == {"beam_init", "step1.beam_step", "step2.beam_step"}
    assert all(dtype == rt.dtype and views for dtype, _, views, _, _ in seen.values())
    assert len({ptr for _, ptr, _, _, _ in seen.values()}) == 1  # one buffer, never copied
    rows_before, rows_after, parents = seen["beam_init"][3], seen["step1.beam_step"][3], seen["step1.beam_step"][4]
    n, slots = rows_before.shape
    own = torch.arange(n).unsqueeze(1).expand(n, slots)
    assert torch.equal(rows_before, own)
    slot, src = batch.inputs["beam_slot"], batch.inputs["beam_src"]
    b = parents.shape[1]
    real = slot < parents.numel()
    parent_row = src[(slot.clamp_max(parents.numel() - 1) // b) * b + parents.reshape(-1)[slot.clamp_max(parents.numel() - 1)]]
    assert torch.equal(rows_after[:, 0], torch.where(real, parent_row, torch.arange(n)))  # slot 0: the parent's
    assert torch.equal(rows_after[:, 1:], own[:, 1:])  # the slot step 2 writes: the row's own
    assert not torch.equal(rows_after, own)  # some beam moved
    assert torch.equal(seen["step2.beam_step"][3], rows_after)  # the last step: no later step reads them
    assert rt.dtype == torch.float32  # the tiny checkpoints are float32


@pytest.mark.parametrize("fp8", [(), ("mlp", "attn", "head")], ids=["bf16", "fp8"])
def test_the_one_kernel_decode_attention_equals_qkv_rope_then_the_attention(qwen2_tiny, hf_ref, tmp_path,
                                                                            fp8: tuple) -> None:
    """Whole BeamSearch batches in bfloat16 through the fused kernels, where the decode attention
    takes the q/k/v GEMM's output (its RoPE inside) against the same runtime with the two kernels
    before it (kernels/qkv_rope.py into the suffix slot, then the attention from q): the same beams
    and log-probs to the bit, on a plain build and an all-FP8 one (the norms quantizing their
    output for the e4m3 q/k/v GEMM whose output the attention reads)."""
    from kernels.decode_attention import decode_attention
    from service.artifact.artifact import build_artifact, load_artifact

    art = load_artifact(build_artifact(str(qwen2_tiny.ckpt), tmp_path / "art", quiet=True, fp8=fp8))
    fused = PythonRuntime(art, dtype=torch.bfloat16, kernels="triton")
    two = PythonRuntime(art, dtype=torch.bfloat16, kernels="triton")
    calls = []

    def qkv_rope_then_attention(qkv, positions, pos_offset, cos, sin, num_heads, q_norm, k_norm, eps, prompt_k,
                                prompt_v, kv_start, kv_len, suffix_k, suffix_v, num_suffix, scale, suffix_rows):
        calls.append(num_suffix)
        q, _, _ = two.ctx.fused.qkv_rope(qkv, positions, pos_offset, cos, sin, num_heads, prompt_k.shape[1], q_norm,
                                         k_norm, eps, suffix_k[:, num_suffix - 1], suffix_v[:, num_suffix - 1])
        return decode_attention(q, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, num_suffix, scale,
                                suffix_rows=suffix_rows)

    two.ctx.fused.decode_attention_qkv = qkv_rope_then_attention
    rng = random.Random(5)
    reqs = [BeamRequest(hf_ref.rand_ids(rng, 9), 4, 4), BeamRequest(hf_ref.rand_ids(rng, 5), 2, 4)]
    got, want = execute(art, fused, reqs), execute(art, two, reqs)
    assert calls and max(calls) == 3  # the decode steps' attention went through the two kernels
    for res, ref in zip(got, want):
        assert isinstance(res, BeamResult) and isinstance(ref, BeamResult), (res, ref)
        assert [(b.ids, b.logprob) for b in res.beams] == [(b.ids, b.logprob) for b in ref.beams]
