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


def _check(device: str, dtype: torch.dtype, atol: float, seed: int, heads: int, kv_heads: int, dim: int,
           n: int, with_prefix: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=g).to(device, dtype)
    k = torch.randn(n, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(n, kv_heads, dim, generator=g).to(device, dtype)
    mask = _segments(g, n, with_prefix).to(device)
    scale = dim ** -0.5
    want, _ = masked_attention_ref(q, k, v, mask, scale)
    got = biased_attention(q, k, v, attention_bias(mask, dtype), scale)
    assert got.shape == want.shape == (n, heads, dim) and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_prefix", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (14, 2, 64)])
def test_biased_attention_matches_reference_cpu(seed: int, with_prefix: bool, heads: int, kv_heads: int,
                                                dim: int) -> None:
    _check("cpu", torch.float32, 2e-5, seed, heads, kv_heads, dim, 96, with_prefix)


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
    # bf16 inputs; the reference rounds its probabilities to bf16 before P@V, SDPA keeps them in
    # float32 on chip: differences of a few bf16 ulps of values |out| < ~3
    _check("cuda", torch.bfloat16, 3e-2, seed, heads, kv_heads, dim, n, with_prefix)
