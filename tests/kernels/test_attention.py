"""kernels.attention: the fused CUDA-path attention (biased_attention over attention_bias) equals
the dense-mask reference (masked_attention_ref) on fresh random inputs and random packed-segment
masks, on the CPU (float32) and on the GPU (bfloat16, marked gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import attention_bias, biased_attention, masked_attention_ref


def _segments(g: torch.Generator, n: int, with_prefix: bool) -> torch.Tensor:
    """A Score-style visibility mask over n packed tokens: random segments, causal within each;
    with_prefix: every other segment also sees the segment before it (its shared prefix)."""
    seg = torch.empty(n, dtype=torch.int64)
    pos = torch.empty(n, dtype=torch.int64)
    i, s = 0, 0
    while i < n:
        length = int(torch.randint(1, 40, (1,), generator=g))
        seg[i:i + length] = s
        pos[i:i + length] = torch.arange(min(length, n - i))
        i, s = i + length, s + 1
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    if with_prefix:
        ctx = torch.where(seg % 2 == 1, seg - 1, torch.full_like(seg, -2))
        mask |= ctx[:, None] == seg[None, :]
    return mask


def _inputs(device: str, dtype: torch.dtype, seed: int, heads: int, kv_heads: int, dim: int, n: int,
            with_prefix: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g).to(device, dtype)
    k = torch.randn(n, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(n, kv_heads, dim, generator=g).to(device, dtype)
    return q, k, v, _segments(g, n, with_prefix).to(device)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (14, 2, 64)])
def test_biased_attention_matches_reference_cpu(seed: int, with_prefix: bool, heads: int, kv_heads: int,
                                                dim: int) -> None:
    q, k, v, mask = _inputs("cpu", torch.float32, seed, heads, kv_heads, dim, 96, with_prefix)
    want, _ = masked_attention_ref(q, k, v, mask, dim ** -0.5)
    got = biased_attention(q, k, v, attention_bias(mask, torch.float32), dim ** -0.5)
    assert got.shape == want.shape == (96, heads, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("seed", range(2))
def test_block_diagonal_attention_matches_reference_cpu(seed: int) -> None:
    """R blocks of N rows (Score's request blocks): a bias [R, 1, N, N] equals the dense reference
    under the block-diagonal [R*N, R*N] mask."""
    r, n, heads, kv_heads, dim = 4, 48, 4, 2, 16
    g = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(r * n, heads, dim, generator=g)
    k = torch.randn(r * n, kv_heads, dim, generator=g)
    v = torch.randn(r * n, kv_heads, dim, generator=g)
    blocks = torch.stack([_segments(g, n, with_prefix=bool(i % 2)) for i in range(r)])  # [R, N, N]
    dense = torch.block_diag(*blocks.unbind(0)).bool()
    want, _ = masked_attention_ref(q, k, v, dense, dim ** -0.5)
    got = biased_attention(q, k, v, attention_bias(blocks, torch.float32), dim ** -0.5)
    assert attention_bias(blocks, torch.float32).shape == (r, 1, n, n)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_bias_is_zero_where_visible_and_minus_inf_elsewhere() -> None:
    mask = torch.tensor([[True, False], [True, True]])
    bias = attention_bias(mask, torch.bfloat16)
    assert bias.shape == (1, 1, 2, 2) and bias.dtype == torch.bfloat16
    assert bias[0, 0].tolist() == [[0.0, float("-inf")], [0.0, 0.0]]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim,n", [(14, 2, 64, 512), (16, 8, 128, 1024)])
def test_biased_attention_matches_reference_cuda(seed: int, with_prefix: bool, heads: int, kv_heads: int,
                                                 dim: int, n: int) -> None:
    """In bf16 neither is exact: the reference rounds its probabilities to bf16 before P@V, SDPA
    keeps them in float32 on chip. Both are measured against the float64 result on the same bf16
    inputs; the fused kernel must be no less accurate than the reference (up to 1e-3)."""
    q, k, v, mask = _inputs("cuda", torch.bfloat16, seed, heads, kv_heads, dim, n, with_prefix)
    scale = dim ** -0.5
    truth, _ = masked_attention_ref(q.double(), k.double(), v.double(), mask, scale)
    ref, _ = masked_attention_ref(q, k, v, mask, scale)
    got = biased_attention(q, k, v, attention_bias(mask, torch.bfloat16), scale)
    assert got.shape == ref.shape == (n, heads, dim) and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= err_ref.max() + 1e-3, (err_got.max().item(), err_ref.max().item())
    assert err_got.mean() <= err_ref.mean() + 1e-4, (err_got.mean().item(), err_ref.mean().item())


@pytest.mark.gpu
def test_block_diagonal_attention_cuda() -> None:
    """The request-block layout on the GPU in bf16: no less accurate than the bf16 reference."""
    r, n, heads, kv_heads, dim = 8, 128, 16, 8, 128
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(r * n, h, dim, generator=g).to("cuda", torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    blocks = torch.stack([_segments(g, n, with_prefix=bool(i % 2)) for i in range(r)]).cuda()
    dense = torch.block_diag(*blocks.unbind(0)).bool()
    truth, _ = masked_attention_ref(q.double(), k.double(), v.double(), dense, dim ** -0.5)
    ref, _ = masked_attention_ref(q, k, v, dense, dim ** -0.5)
    got = biased_attention(q, k, v, attention_bias(blocks, torch.bfloat16), dim ** -0.5)
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= err_ref.max() + 1e-3 and err_got.mean() <= err_ref.mean() + 1e-4
