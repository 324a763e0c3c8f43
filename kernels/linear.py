"""A GEMM for the decoder layer's projections at the row counts of beam decode (x @ W^T, W [N, K]).

cuBLAS is tuned for large GEMMs; at 100-800 rows (a beam batch's decode step, a short prefill)
it picks tiles that leave most SMs idle or read the weights twice (a 96-row tile over 100 rows),
and splits K with a separate reduce kernel. Here each program owns one [BLOCK_M, BLOCK_N] output
tile and the whole K loop (no split, so the sum's order is fixed: deterministic), and the grid is
sized by BLOCK_N so that enough SMs stream the weights.

- `linear`: y = x @ W^T (+ bias, added to the float32 accumulator: one rounding, as cuBLASLt's
  bias epilogue does).
- `linear_silu_mul`: the MLP's gate/up projection with SiLU(gate) * up in the epilogue: W [2I, K]
  (gate rows first), y [M, I]. Rounded as the unfused path is: gate and up to the dtype (the GEMM's
  output), SiLU to the dtype, then the product (kernels/norm_act.py::silu_mul_kernel).

The accumulation order differs from cuBLAS's, so the result is within float rounding of
`F.linear`, not equal to it; both runtimes launch the same cubin (kernels/aot.py), so they stay
byte-identical. Float32 activations never come here (tl.dot would use TF32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS


@triton.jit
def linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_rows,
                  K: tl.constexpr, N: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    # x [num_rows, K], w [N, K] (SILU_MUL: [2N, K], gate rows then up rows), out [num_rows, N]
    pid_m = tl.program_id(0)  # the fast grid axis: programs reading one weight tile run together (L2)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    col_ok = cols < N
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
        b = tl.load(w_tile + k, mask=col_ok[:, None], other=0.0)
        if INTERPRETED:  # Triton 3.6's interpreter multiplies bf16 operands as their raw bits
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        if SILU_MUL:
            u = tl.load(w_tile + N * K + k, mask=col_ok[:, None], other=0.0)
            if INTERPRETED:
                u = u.to(tl.float32)
            acc_up = tl.dot(a, tl.trans(u), acc_up)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if SILU_MUL:
        gf = y.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(dtype)  # F.silu's output, in the dtype
        y = (s.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, y, mask=row_ok[:, None] & col_ok[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
Config = tuple[int, int, int, int, int]


def default_config(rows: int, n: int, k: int, silu_mul: bool = False) -> Config:
    """The tile for a [rows, k] x [n, k]^T product (measured on the H200: ops/bench_kernels.py
    --only linear)."""
    block_m = 64 if rows <= 64 else 128
    block_n = 64 if n >= 4096 else 32
    if silu_mul:
        block_n = 32
    return block_m, block_n, 128, 4, 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
           config: Config | None = None) -> torch.Tensor:
    """x [M, K] contiguous, weight [N, K] (silu_mul: [2I, K]) contiguous, bias [N] or None
    -> [M, N] (silu_mul: [M, I]) in x's dtype."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    if not (x.is_contiguous() and weight.is_contiguous()) or x.dtype != weight.dtype:
        raise ValueError("linear: x and weight must be contiguous and of one dtype")
    if x.dtype == torch.float32:
        raise ValueError("linear: 16-bit activations only (float32 stays on ATen: tl.dot would use TF32)")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if silu_mul and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("linear: silu_mul needs a [2I, K] weight and no bias")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias must be [{n}], got {list(bias.shape)}")
    block_m, block_n, block_k, warps, stages = config or default_config(m, n, k, silu_mul)
    if k % block_k:
        raise ValueError(f"linear: K={k} is not a multiple of BLOCK_K={block_k}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    linear_kernel[grid](x, weight, bias if bias is not None else x, out, m, K=k, N=n, HAS_BIAS=bias is not None,
                        SILU_MUL=silu_mul, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
                        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps, **COMPILE_OPTIONS)
    return out


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               silu_mul: bool = False) -> torch.Tensor:
    """The unfused path: F.linear, then SiLU(gate) * up as the decoder layer computes it."""
    y = torch.nn.functional.linear(x, weight, bias)
    if not silu_mul:
        return y
    gate, up = y.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up
