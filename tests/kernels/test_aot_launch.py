"""On the GPU: the AOT cubins (kernels/aot.py) launched from C++ (cpp_dag.TritonKernels) equal the
torch references like the JIT kernels do, inside a CUDA graph too. Marked gpu (CUDA builds only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from service.model.layers import rms_norm as rms_norm_ref
from service.model.layers import two_part_attention

from service.model.checkpoint import weight_source
from service.runtime.fused import kernel_shape

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory):
    from cpp_dag import _core

    out = tmp_path_factory.mktemp("aot_gpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--shape", json.dumps(kernel_shape(weight_source("embedded:qwen2.5-0.5b")[0])),
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _core.TritonKernels(str(out), "cuda")


def test_rms_norm_and_silu_mul(kernels) -> None:
    g = torch.Generator().manual_seed(3)
    x, r = ((2 * torch.randn(301, 896, generator=g)).to("cuda", torch.bfloat16) for _ in range(2))  # a partial tile
    w = (1 + 0.3 * torch.randn(896, generator=g)).to("cuda", torch.bfloat16)
    want = rms_norm_ref(x, w, 1e-6)
    assert (kernels.rms_norm(x, w, 1e-6).float() - want.float()).abs().max() <= 2 * 2 ** -8 * want.float().abs().max()
    out, total = kernels.rms_norm_residual(x, r, w, 1e-6)
    assert torch.equal(total, x + r)
    want = rms_norm_ref(x + r, w, 1e-6)
    assert (out.float() - want.float()).abs().max() <= 2 * 2 ** -8 * want.float().abs().max()
    gu = (3 * torch.randn(67, 2 * 4864, generator=g)).to("cuda", torch.bfloat16)
    gate, up = gu.chunk(2, -1)
    want = F.silu(gate) * up
    assert (kernels.silu_mul(gu).float() - want.float()).abs().max() <= 2 * 2 ** -8 * want.float().abs().max()


def _qkv_aten(qkv, pos, offset, cos, sin, h, g, norms=None):
    """The ATen path's ops (service.model.layers) on the q/k/v GEMM output."""
    from service.model.layers import apply_rope

    n, e = qkv.shape[0], cos.shape[1]
    q, k, v = qkv.split([h * e, g * e, g * e], dim=-1)
    q, k, v = q.reshape(n, h, e), k.reshape(n, g, e), v.reshape(n, g, e)
    if norms is not None:
        q, k = rms_norm_ref(q, norms[0], 1e-6), rms_norm_ref(k, norms[1], 1e-6)
    c, s = cos.index_select(0, pos + offset), sin.index_select(0, pos + offset)
    return apply_rope(q, c, s), apply_rope(k, c, s), v.contiguous()


def test_qkv_rope_equals_the_aten_path(kernels) -> None:
    """The split + RoPE + v copy from the C++ launch of the cubin give the ATen path's bytes (no FMA
    contraction: kernels/__init__.py), at a prefill's and a decode step's positions, into a decode
    step's suffix slot, and inside a CUDA graph; the q/k-norm variant within the norm's rounding."""
    g = torch.Generator().manual_seed(5)
    n, h, kv, e = 301, 14, 2, 64  # embedded:qwen2.5-0.5b heads; 301 tokens: a partial tile
    qkv = (2 * torch.randn(n, (h + 2 * kv) * e, generator=g)).to("cuda", torch.bfloat16)
    cos, sin = ((2 * torch.rand(600, e, generator=g) - 1).to("cuda", torch.bfloat16) for _ in range(2))
    pos = torch.randint(0, 590, (n,), generator=g).to("cuda")
    for offset in (0, 3):
        got = kernels.qkv_rope(qkv, pos, offset, cos, sin, h, kv, None, None, 1e-6)
        for a, b in zip(got, _qkv_aten(qkv, pos, offset, cos, sin, h, kv)):
            assert torch.equal(a, b)
    suffix_k, suffix_v = (torch.zeros(n, 4, kv, e, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q, _, _ = kernels.qkv_rope(qkv, pos, 2, cos, sin, h, kv, None, None, 1e-6, suffix_k[:, 2], suffix_v[:, 2])
    want = _qkv_aten(qkv, pos, 2, cos, sin, h, kv)
    assert torch.equal(q, want[0]) and torch.equal(suffix_k[:, 2], want[1]) and torch.equal(suffix_v[:, 2], want[2])
    assert not suffix_k[:, [0, 1, 3]].any() and not suffix_v[:, [0, 1, 3]].any()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.qkv_rope(qkv, pos, 1, cos, sin, h, kv, None, None, 1e-6)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = kernels.qkv_rope(qkv, pos, 1, cos, sin, h, kv, None, None, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, _qkv_aten(qkv, pos, 1, cos, sin, h, kv)))
    norms = tuple((1 + 0.3 * torch.randn(e, generator=g)).to("cuda", torch.bfloat16) for _ in range(2))
    got = kernels.qkv_rope(qkv, pos, 0, cos, sin, h, kv, norms[0], norms[1], 1e-6)
    for a, b in zip(got, _qkv_aten(qkv, pos, 0, cos, sin, h, kv, norms)):
        assert (a.float() - b.float()).abs().max() <= 2 * 2 ** -8 * b.float().abs().max()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_attention_from_qkv_in_a_cuda_graph(kernels, qk_norm: bool) -> None:
    """The C++ launch of the decode-attention cubin (from the q/k/v GEMM's output, qkv_rope's work
    included): the same bytes as the JIT kernel, k/v included, as accurate against float64 as the
    ATen parts, and the same inside a CUDA graph; fewer suffix slots take the same variant."""
    from kernels.decode_attention import decode_attention_qkv
    from kernels.qkv_rope import qkv_rope

    g = torch.Generator().manual_seed(4)
    rows, slots, h, kv, e = 64, 4, 14, 2, 64
    bf16 = lambda *shape: torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)  # noqa: E731
    qkv, pk, pv = bf16(rows, (h + 2 * kv) * e), bf16(200, kv, e), bf16(200, kv, e)
    sk, sv = bf16(rows, slots, kv, e), bf16(rows, slots, kv, e)
    cos, sin = bf16(256, e), bf16(256, e)
    norms = (bf16(e), bf16(e)) if qk_norm else (None, None)
    start = torch.tensor([0] * 32 + [120] * 32, device="cuda")
    length = torch.tensor([120] * 32 + [80] * 32, device="cuda")
    pos = length.clone()
    seg = torch.tensor([0] * 120 + [1] * 80, device="cuda")
    mask = torch.arange(2, device="cuda").repeat_interleave(32)[:, None] == seg[None, :]
    scale = 0.125

    # the beams' ancestry before step 3: slots 0 and 1 of each row at other rows, slot 2 and 3 its own
    own = torch.arange(rows, device="cuda").unsqueeze(1).expand(rows, slots)
    anc = torch.where(torch.arange(slots, device="cuda") < 2, torch.randint(0, rows, (rows, slots), generator=g)
                      .cuda(), own).contiguous()

    def run(fn, k_cache, v_cache, t=3, rows_of=anc):
        return fn(qkv, pos, t - 1, cos, sin, h, *norms, 1e-6, pk, pv, start, length, k_cache, v_cache, t, scale,
                  suffix_rows=rows_of)

    eager_k, eager_v = sk.clone(), sv.clone()
    eager = run(kernels.decode_attention_qkv, eager_k, eager_v)
    jit_k, jit_v = sk.clone(), sv.clone()
    assert torch.equal(eager, run(decode_attention_qkv, jit_k, jit_v)), "AOT cubin and JIT kernel disagree"
    assert torch.equal(eager_k, jit_k) and torch.equal(eager_v, jit_v)
    q, _, _ = qkv_rope(qkv, pos, cos, sin, h, kv, *norms, 1e-6, pos_offset=2)
    read_k = eager_k[anc, torch.arange(slots, device="cuda")][:, :3]  # each row's slots through its rows
    read_v = eager_v[anc, torch.arange(slots, device="cuda")][:, :3]
    truth = two_part_attention(q.double(), pk.double(), pv.double(), mask, read_k.double(), read_v.double(), None,
                               scale)
    ref = two_part_attention(q, pk, pv, mask, read_k, read_v, None, scale)
    assert (eager.double() - truth).abs().max() <= (ref.double() - truth).abs().max() + 1e-3
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(kernels.decode_attention_qkv, sk, sv)  # warm-up on the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = run(kernels.decode_attention_qkv, sk, sv)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(sk, eager_k)
    # a bucket with fewer new tokens has fewer suffix slots: the same compiled variant serves it
    few_k, few_v = sk[:, :2].contiguous(), sv[:, :2].contiguous()
    few_rows = torch.stack([anc[:, 0], own[:, 1]], 1).contiguous()  # before step 2: slot 1 is the row's own
    few = run(kernels.decode_attention_qkv, few_k, few_v, t=2, rows_of=few_rows)
    assert torch.equal(few, run(decode_attention_qkv, sk[:, :2].contiguous(), sv[:, :2].contiguous(), t=2,
                                rows_of=few_rows))


def test_segment_attention_in_a_cuda_graph(kernels) -> None:
    """The C++ launch of the segment-attention cubin: as accurate as the dense reference against
    float64 on a Score batch with prefixes, padding and a block that is no multiple of the tile, the
    same bytes as the Python launcher (the same kernel and tile, compiled JIT), and inside a CUDA
    graph together with the key ranges."""
    from kernels.attention import segment_key_ranges
    from kernels.segment_attention import segment_attention, segment_attention_ref

    g = torch.Generator().manual_seed(6)
    block, t = 300, 900  # 3 blocks: a prefix of 40 + samples of 7..90 rows; block 2 padding only
    seg, ctx = torch.full((t,), -1), torch.full((t,), -2)
    lengths = [40, 7, 90, 33, 64, 1]
    i = 0
    for s, n in enumerate(lengths):
        seg[i:i + n] = s
        ctx[i:i + n] = 0 if s else -2
        i += n
    seg[block:block + 250] = len(lengths)  # block 1: one sample of 250 rows, no prefix
    seg, ctx = seg.cuda(), ctx.cuda()
    # request 0: rows 0..299 (its prefix: the first 40), request 1: the rest (no prefix)
    request_rows = torch.tensor([0, block, t], device="cuda")
    prefix_rows = torch.tensor([40, 0], device="cuda")
    q = torch.randn(t, 14, 64, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(t, 2, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    scale = 0.125
    ranges = segment_key_ranges(seg, ctx, request_rows, prefix_rows)
    eager = kernels.segment_attention(q, k, v, ranges, scale)
    truth = segment_attention_ref(q.double(), k.double(), v.double(), ranges, scale)
    ref = segment_attention_ref(q, k, v, ranges, scale)
    assert (eager.double() - truth).abs().max() <= (ref.double() - truth).abs().max() + 1e-3
    assert not eager[seg.lt(0)].any()
    assert torch.equal(eager, segment_attention(q, k, v, ranges, scale))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.segment_attention(q, k, v, ranges, scale)  # warm-up on the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = kernels.segment_attention(q, k, v, segment_key_ranges(seg, ctx, request_rows, prefix_rows), scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    with pytest.raises(ValueError, match="key_ranges must be int32"):
        kernels.segment_attention(q, k, v, ranges.long(), scale)
