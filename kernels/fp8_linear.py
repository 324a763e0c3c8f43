"""FP8 (e4m3) linear layers: the per-row quantizer and the linear over quantized operands (issue 29).

- `quantize_rows(t)`: t [M, K] -> (q [M, K] float8_e4m3fn, scale [M] float32) with
  scale[m] = amax|t[m, :]| / 448 (a row of zeros: 1) and q = (t / scale).clamp(-448, 448), all in
  float32. The weights are quantized with it once, per output channel (`slmrank build --fp8`), and
  the activations per token at every call.
- kernels/fp8_quant.py: the same quantizer in Triton, alone (`quantize_rows_triton`) and as the end
  of the kernels that produce an FP8 GEMM's activations; byte-identical to `quantize_rows` on the GPU.
- `fp8_linear(x, w_q, w_scale, bias)`: x [M, K] (the activation dtype), w_q [N, K] e4m3, w_scale [N]
  float32 -> [M, N] in x's dtype:
      a_q, s_a = quantize_rows(x)
      y = (a_q.float() @ w_q.float().T) * s_a[:, None] * s_w[None, :]   (float32)
      y = (y + bias).to(x.dtype)
  On the CPU (and wherever the CUDA path does not apply) this is an emulation in float32: every e4m3
  product is exact in float32 (3 + 3 mantissa bits), so only the float32 accumulation rounds. It is
  the reference; cpp_dag/layer_ops.cpp::fp8_linear runs the same ATen ops in the same order, so the
  two runtimes agree byte for byte.
  On CUDA with bfloat16 activations and K, N multiples of 16 it calls `scaled_linear`:
  torch._scaled_mm with rowwise scales (bfloat16 out, then the bias added in bfloat16); it needs an
  sm_89+ device (Hopper, the default build target). tests/kernels/test_fp8_linear.py checks it
  against float64 on the GPU (marked gpu).
- On the fused path (kernels="triton") the kernel that produces an FP8 GEMM's activations quantizes
  them itself (kernels/norm_act.py's rms_norm_fp8 and silu_mul_fp8, or fp8_quant.py's quantizer after
  the attention and before the LM head), and the GEMM is `scaled_linear` on its (q, scale): the
  same bytes as quantize_rows of the unquantized output, without ~6 ATen launches per GEMM.

The clamp makes the saturation at +-448 explicit: after the division's rounding t / scale can exceed
448 by an ulp (about one row in twelve of random data), which the cast rounds to 448 anyway; a cast of
a value past e4m3's range is not the same everywhere (torch 2.13's CPU cast saturates, older c10
conversions gave NaN: float8_e4m3fn has no infinity), so the quotient never reaches it.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_DTYPE = torch.float8_e4m3fn


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, K] -> (e4m3 [M, K], float32 scale [M]): per row, scale = amax / 448 (zero row: 1)."""
    tf = t.float()
    amax = tf.abs().amax(-1, keepdim=True)  # [M, 1]
    # divided by a tensor, not a Python number: CUDA turns a division by a CPU scalar into a product
    # with its reciprocal (one rounding more), and the scale would then differ between devices
    scale = torch.where(amax.gt(0), amax.div(torch.full_like(amax, E4M3_MAX)), torch.ones_like(amax))
    q = tf.div(scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale.squeeze(-1)


def uses_scaled_mm(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """The CUDA path (torch._scaled_mm, rowwise scales, bfloat16 out) applies to activations like x
    (their dtype and device) and the weight w_q [N, K]: cpp_dag/layer_ops.cpp decides the same way."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")
            and w_q.shape[1] % 16 == 0 and w_q.shape[0] % 16 == 0)


def scaled_linear(a_q: torch.Tensor, s_a: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA FP8 GEMM: e4m3 rows a_q [M, K] with their scales s_a [M] @ w_q [N, K] (scales
    w_scale [N]) -> [M, N] bfloat16 (float32 accumulation), + bias in bfloat16."""
    y = torch._scaled_mm(a_q, w_q.t(), scale_a=s_a.unsqueeze(1), scale_b=w_scale.unsqueeze(0),
                         out_dtype=torch.bfloat16)
    return y if bias is None else y.add(bias)


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the e4m3 weight w_q [N, K] (per-output-channel scale w_scale [N] float32), + bias
    [N] -> [M, N] in x.dtype; the activations quantized per row at this call (module docstring)."""
    a_q, s_a = quantize_rows(x)
    if uses_scaled_mm(x, w_q):
        return scaled_linear(a_q, s_a, w_q, w_scale, bias)
    y = torch.mm(a_q.float(), w_q.float().t()).mul(s_a.unsqueeze(1)).mul(w_scale.unsqueeze(0))
    if bias is not None:
        y = y.add(bias.float())
    return y.to(x.dtype)
