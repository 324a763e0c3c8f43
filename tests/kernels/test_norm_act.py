"""kernels.norm_act (Triton) against the torch references on fresh random inputs: on a CPU through
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on the GPU compiled (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_linear import quantize_rows
from kernels.norm_act import rms_norm, rms_norm_fp8, silu_mul, silu_mul_fp8
from service.model.layers import rms_norm as rms_norm_ref
from tests.kernels.test_fp8_linear import assert_quantized_as

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at the reference's magnitude."""
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return float(((got.float() - want.float()).abs() / spacing).max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 896), (33, 128), (9, 1024)])  # ROWS rows a program: tails
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, rows: int, dim: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + dim)
    x = (3 * torch.randn(rows, dim, generator=g)).to(device, dtype)
    w = (1 + 0.3 * torch.randn(dim, generator=g)).to(device, dtype)
    got = rms_norm(x, w, 1e-6)
    want = rms_norm_ref(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    # float32: reduction order only; bf16: at most one rounding step apart
    assert _ulps(got, want) <= (8 if dtype == torch.float32 else 2), _ulps(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_returns_the_sum_too(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(2, 5, 96, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(96, generator=g)).to(device, dtype)
    out, total = rms_norm(x, w, 1e-5, residual=r)
    if device == "cuda" or dtype == torch.float32:
        assert torch.equal(total, x + r), "the sum is rounded exactly as torch's add"
    else:  # Triton's CPU interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even)
        assert _ulps(total, x + r) <= 1
    assert _ulps(out, rms_norm_ref(total, w, 1e-5)) <= (8 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(3, 64), (5, 1100)])  # 1100: a partial column block
def test_silu_mul_matches_reference(device: str, dtype: torch.dtype, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gu = (4 * torch.randn(rows, 2 * inter, generator=g)).to(device, dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = silu_mul(gu)
    assert got.shape == want.shape and got.dtype == dtype
    assert _ulps(got, want) <= (8 if dtype == torch.float32 else 2), _ulps(got, want)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"\[N, 2I\]"):
        silu_mul(torch.randn(2, 7))



@pytest.mark.parametrize("device", DEVICES)
# (512, 1024): qwen3-0.6b's rows, enough of them that a sum of squares taken in another order than
# the plain kernel's shows (it did on the H200 before the sum went to float64)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 896), (33, 1024), (512, 1024)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_norm_quantized(device: str, rows: int, dim: int, with_residual: bool) -> None:
    """The FP8 norm equals quantize_rows of the bf16 norm kernel's output (and its sum, with a
    residual, is the plain kernel's): the FP8 GEMM reads what the unfused path would quantize."""
    g = torch.Generator().manual_seed(rows + dim)
    x, r = ((3 * torch.randn(rows, dim, generator=g)).to(device, torch.bfloat16) for _ in range(2))
    w = (1 + 0.3 * torch.randn(dim, generator=g)).to(device, torch.bfloat16)
    if with_residual:
        q, s, total = rms_norm_fp8(x, w, 1e-6, residual=r)
        h, want_total = rms_norm(x, w, 1e-6, residual=r)
        assert torch.equal(total, want_total)
    else:
        q, s = rms_norm_fp8(x, w, 1e-6)
        h = rms_norm(x, w, 1e-6)
    assert_quantized_as(q, s, *quantize_rows(h))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,inter", [(3, 64), (5, 1100), (9, 4864)])  # 4864: Qwen2.5-0.5B's, a row of 8192 lanes
def test_silu_mul_fp8_is_the_product_quantized(device: str, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(inter + 1)
    gu = (4 * torch.randn(rows, 2 * inter, generator=g)).to(device, torch.bfloat16)
    gu[0] = 0  # a zero row: scale 1
    q, s = silu_mul_fp8(gu)
    assert_quantized_as(q, s, *quantize_rows(silu_mul(gu)))
    assert s[0] == 1
