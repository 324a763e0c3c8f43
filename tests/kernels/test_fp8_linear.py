"""kernels/fp8_linear.py on the CPU: the per-row e4m3 quantizer (round-trip error within e4m3's
rounding per channel against float64, zero rows, positive finite scales, saturation at 448) and the
emulated FP8 linear (against a float64 product of the same quantized operands, tightly; against
the unquantized linear, loosely); the one-kernel Triton quantizer against quantize_rows. On the GPU
(marked gpu): the Triton quantizer byte for byte, and the CUDA path (torch._scaled_mm) against float64
of the same quantized operands."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_linear import E4M3_MAX, FP8_DTYPE, fp8_linear, quantize_rows, uses_scaled_mm
from kernels.fp8_quant import quantize_rows_triton

F64 = torch.float64


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-6 .. 1e6), one row of zeros, one with a single non-zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(6 * torch.randn(rows, 1, generator=g)).clamp(1e-6, 1e6)
    w[3] = 0.0
    w[5] = 0.0
    w[5, 7] = -2.5
    return w


@pytest.mark.parametrize("rows,cols", [(64, 256), (17, 96)])
def test_round_trip_is_within_e4m3_rounding_per_channel(rows: int, cols: int) -> None:
    w = _weights(rows, cols, rows + cols)
    q, s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (rows,)
    back = q.to(F64) * s.to(F64).unsqueeze(1)
    err = (back - w.to(F64)).abs()
    amax = w.to(F64).abs().amax(1)
    # e4m3: 3 mantissa bits, so a normal value is within 2^-4 of itself; below 2^-6 (subnormals) the
    # spacing is 2^-9, half of it 2^-10, in units of the scale (+ float32's own rounding of the scale)
    bound = 2.0 ** -4 * w.to(F64).abs() + 2.0 ** -10 * s.to(F64).unsqueeze(1)
    assert (err <= bound * (1 + 1e-6)).all(), float((err / bound.clamp_min(1e-300)).max())
    # per channel: at most half the spacing at the top of the range (32 / 2 at 448), relative to the row's amax
    assert (err.amax(1) <= amax / 28 * (1 + 1e-6)).all()
    # and not trivially: the quantization does change values
    assert err.max() > 0


def test_zero_rows_get_scale_one_and_zeros() -> None:
    w = _weights(8, 32, 1)
    q, s = quantize_rows(w)
    assert s[3] == 1.0 and (q[3].float() == 0).all()
    assert s[5] == pytest.approx(2.5 / 448, rel=1e-7) and q[5, 7].float() == -E4M3_MAX


def test_scales_are_positive_and_finite_even_at_float32_extremes() -> None:
    w = _weights(32, 64, 2)
    w[0, 0] = 3.0e38  # near float32's max
    w[1] = 1e-40  # float32 subnormals
    w[2, :5] = torch.tensor([1e30, -1e-30, 0.0, 1.0, -1e30])  # a huge dynamic range within a row
    q, s = quantize_rows(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all()
    assert q[2, 1].float() == 0 and q[2, 3].float() == 0  # far below the row's range: flushed to zero
    assert q[2, 0].float() == E4M3_MAX and q[2, 4].float() == -E4M3_MAX


def test_saturation_at_448() -> None:
    """Each non-zero row's largest magnitude lands exactly on 448 (e4m3fn's largest finite number),
    also in the rows whose float32 quotient rounds past 448; no value is NaN or beyond it."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(512, 128, generator=g) * torch.exp(5 * torch.randn(512, 1, generator=g))
    q, s = quantize_rows(t)
    over = (t / s.unsqueeze(1)).abs().amax(1) > E4M3_MAX  # the division's rounding overshoots in some rows
    assert over.any(), "no row exercises the saturation"
    qf = q.float()
    assert not torch.isnan(qf).any()
    assert (qf.abs().amax(1) == E4M3_MAX).all()
    assert (qf.abs() <= E4M3_MAX).all()


def _operands(m: int, k: int, n: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))).to(dtype)
    x[1] = 0  # a zero token row
    w = torch.randn(n, k, generator=g) * 0.05
    bias = (0.1 * torch.randn(n, generator=g)).to(dtype)
    w_q, w_s = quantize_rows(w)
    return x, w, w_q, w_s, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_emulated_linear_matches_float64_of_the_same_operands(dtype: torch.dtype, with_bias: bool) -> None:
    m, k, n = 13, 384, 96
    x, _, w_q, w_s, bias = _operands(m, k, n, 7, dtype)
    b = bias if with_bias else None
    assert not uses_scaled_mm(x, w_q)  # the CPU runs the emulation
    y = fp8_linear(x, w_q, w_s, b)
    assert y.dtype == dtype and y.shape == (m, n)
    a_q, s_a = quantize_rows(x)
    exact = (a_q.to(F64) @ w_q.to(F64).T) * s_a.to(F64).unsqueeze(1) * w_s.to(F64).unsqueeze(0)
    if b is not None:
        exact = exact + b.to(F64)
    # float32 accumulation of exact products: k roundings of at most 2^-24 of the running |sum| (+ the
    # two scale products and the bias add); then one rounding to the output dtype
    magnitude = (a_q.to(F64).abs() @ w_q.to(F64).abs().T) * s_a.to(F64).unsqueeze(1) * w_s.to(F64).unsqueeze(0)
    acc = (k + 4) * 2.0 ** -24 * (magnitude + (b.to(F64).abs() if b is not None else 0))
    out_eps = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    err = (y.to(F64) - exact).abs()
    assert (err <= acc + out_eps * exact.abs() * 1.0001 + 1e-30).all(), float((err - acc).max())
    assert (y[1].to(F64) == (b.to(F64) if b is not None else 0)).all()  # a zero row: the bias alone


def test_emulated_linear_is_near_the_unquantized_linear() -> None:
    m, k, n = 32, 512, 128
    x, w, w_q, w_s, bias = _operands(m, k, n, 8, torch.float32)
    y = fp8_linear(x, w_q, w_s, bias)
    ref = torch.nn.functional.linear(x.to(F64), w.to(F64), bias.to(F64))
    rel = float((y.to(F64) - ref).norm() / ref.norm())
    # two e4m3 operands, each within 2^-4 (about 3% RMS): the product within a few percent, and not exact
    assert 1e-4 < rel < 0.08, rel


def _e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at |v| (3 mantissa bits; subnormals below 2^-6 spaced 2^-9)."""
    exp = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(exp - 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (17, 896), (64, 1100)])  # ROWS a program: tails; a partial block
def test_triton_quantizer_is_quantize_rows(device: str, dtype: torch.dtype, rows: int, cols: int) -> None:
    """On the GPU byte for byte (both divisions correctly rounded, the cast rounds to nearest even
    and saturates); on the CPU as assert_quantized_as allows."""
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.exp(4 * torch.randn(rows, 1, generator=g))).to(dtype)
    if rows > 1:
        x[1] = 0  # a zero row: scale 1
    x = x.to(device)
    q, s = quantize_rows_triton(x)
    assert_quantized_as(q, s, *quantize_rows(x))


def assert_quantized_as(q: torch.Tensor, s: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor) -> None:
    """A Triton kernel's (e4m3, scale) against quantize_rows': on the GPU byte for byte; under
    Triton's CPU interpreter, whose e4m3 cast rounds its own way (ties away from zero, and a mantissa
    carry into the exponent lost), exact scales and every value within one e4m3 step, or half of the
    reference's where it rounded up to a power of two."""
    assert q.dtype == FP8_DTYPE and q.shape == want_q.shape and s.dtype == torch.float32 and s.shape == want_s.shape
    assert torch.equal(s, want_s)
    if q.is_cuda:
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        return
    got, want = q.float(), want_q.float()
    near = (got - want).abs() <= _e4m3_step(want)
    carry = (torch.frexp(want).mantissa.abs() == 0.5) & (got == want / 2)
    assert (near | carry).all()
    assert (got.abs() <= E4M3_MAX).all() and not torch.isnan(got).any()
    assert (got == want).float().mean() > 0.9  # the interpreter's cast differs in a few values only


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(2, 896, 1152), (100, 896, 9728), (400, 1024, 151936 // 8), (2048, 3072, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_mm_path_matches_float64_of_the_same_operands(m: int, k: int, n: int, with_bias: bool) -> None:
    """The CUDA path: bfloat16 activations on the GPU take torch._scaled_mm (rowwise scales, float32
    accumulation, bfloat16 out, the bias added in bfloat16): within the accumulation's rounding and
    two bfloat16 roundings of the float64 product of the same quantized operands."""
    x, _, w_q, w_s, bias = _operands(m, k, n, m + n, torch.bfloat16)
    x, w_q, w_s, bias = x.cuda(), w_q.cuda(), w_s.cuda(), bias.cuda()
    b = bias if with_bias else None
    assert uses_scaled_mm(x, w_q)
    y = fp8_linear(x, w_q, w_s, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    a_q, s_a = quantize_rows(x)
    assert torch.equal(a_q.cpu().view(torch.uint8), quantize_rows(x.cpu())[0].view(torch.uint8))  # CPU == GPU
    exact = (a_q.to(F64) @ w_q.to(F64).T) * s_a.to(F64).unsqueeze(1) * w_s.to(F64).unsqueeze(0)
    magnitude = (a_q.to(F64).abs() @ w_q.to(F64).abs().T) * s_a.to(F64).unsqueeze(1) * w_s.to(F64).unsqueeze(0)
    acc = (k + 4) * 2.0 ** -24 * magnitude
    if b is not None:
        exact = exact + b.to(F64)
    err = (y.to(F64) - exact).abs()
    # the product rounded to bf16, then (with a bias) the sum rounded again
    bound = acc + 2.0 ** -8 * (exact.abs() + (b.to(F64).abs() if b is not None else 0)) * (2 if b is not None else 1)
    assert (err <= bound * 1.0001 + 1e-30).all(), float((err - bound).max())
    assert err.max() > 0  # bf16 output: not the float64 product itself
