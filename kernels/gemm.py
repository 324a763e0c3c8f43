"""Skinny GEMMs of a decode step (M = beam rows, 100-1,600) with the layer's element-wise work in
their epilogues: the candidate for replacing cuBLAS + separate element-wise kernels there.

`linear(a, w, bias=None, config)`: a [M, K] @ w[N, K]^T (+ bias), the nn.Linear layout, in three
output forms, chosen by the config:
- plain: out [M, N] in a's dtype; the bias is added to the float32 accumulator before the one
  rounding (as cuBLASLt's bias epilogue does);
- split-K (`split_k` > 1): out [split_k, M, N] float32 partial sums, program k over its K/split_k
  slice; whoever reads them sums the parts in order 0..split_k-1 (`sum_parts`, or the next
  RMSNorm: kernels/norm_act.py `rms_norm_parts`), so the result is deterministic;
- SiLU*up (`silu`): w is the fused gate/up weight [2I, K] (gate rows first) and out [M, I] =
  silu(gate) * up with torch's roundings (gate and up rounded to the dtype as the GEMM's output
  would be, silu rounded, then the product), so the [M, 2I] gate/up output never exists.

Program (n tile, m tile, k part): BLOCK_M rows x BLOCK_N columns over K/split_k; consecutive
programs share an A tile (N tiles vary fastest), so A comes from L2 and the weights are read once
per M tile. float32 inputs multiply as IEEE float32 (never TF32).

The reference is torch (`F.linear`, `F.silu`); tests/kernels/test_gemm.py compares them on fresh
random inputs. Whether these beat cuBLAS at our shapes is measured by
`python -m ops.bench.bench_kernels --only gemm` on the H200.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS, interpreted


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def check(self, n: int, k: int) -> None:
        if n % self.block_n or k % (self.block_k * self.split_k):
            raise ValueError(f"gemm: N={n} must be a multiple of block_n={self.block_n} and K={k} of "
                             f"block_k*split_k={self.block_k * self.split_k}")


@triton.jit
def _mma(a, b, acc, INTERPRETED: tl.constexpr):
    """acc + a @ b in float32, float32 inputs as IEEE float32 (never TF32). Triton 3.6's interpreter
    multiplies bfloat16 operands as their raw bits: there, the same exact products from float32."""
    if INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit(do_not_specialize=["num_rows"])  # as kernels/aot.py compiles it: any row count
def gemm_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, num_rows,
                N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                INTERPRETED: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    k_part: tl.constexpr = K // SPLIT_K
    ks = pid_k * k_part + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * K + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k_part, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = _mma(a, tl.trans(w), acc, INTERPRETED)
        if SILU:  # the up rows of the fused weight, N rows further
            wu = tl.load(w_ptrs + N * K)
            acc_up = _mma(a, tl.trans(wu), acc_up, INTERPRETED)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = row_ok[:, None]
    if SPLIT_K > 1:  # float32 partials [SPLIT_K, num_rows, N]
        part = out_ptr + pid_k.to(tl.int64) * num_rows * N
        tl.store(part + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        dt = a_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        if SILU:  # F.silu(gate) * up on the rounded GEMM outputs, each step rounded as torch does
            g = acc.to(dt).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            y = (s * acc_up.to(dt).to(tl.float32)).to(dt)
        else:
            y = acc.to(dt)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)


def _check(a: torch.Tensor, w: torch.Tensor, silu: bool) -> tuple[int, int, int]:
    if a.dim() != 2 or w.dim() != 2 or not a.is_contiguous() or not w.is_contiguous():
        raise ValueError(f"gemm: a [M, K] and w [N, K] must be contiguous 2-D, got {list(a.shape)}, {list(w.shape)}")
    if a.shape[1] != w.shape[1] or a.dtype != w.dtype:
        raise ValueError(f"gemm: a {list(a.shape)} {a.dtype} and w {list(w.shape)} {w.dtype} do not multiply")
    if silu and w.shape[0] % 2:
        raise ValueError(f"gemm: a fused gate/up weight has an even row count, got {w.shape[0]}")
    m, k = a.shape
    return m, (w.shape[0] // 2 if silu else w.shape[0]), k


def linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: GemmConfig = GemmConfig(),
           silu: bool = False) -> torch.Tensor:
    """a [M, K] @ w[N, K]^T (+ bias): [M, N] in a's dtype; with config.split_k > 1 the float32
    partials [split_k, M, N]; with silu, w is [2I, K] and the result silu(gate) * up [M, I]."""
    m, n, k = _check(a, w, silu)
    config.check(n, k)
    if config.split_k > 1 and (silu or bias is not None):
        raise ValueError("gemm: split-K partials take no bias or SiLU epilogue (their reader adds them)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemm: bias must be [{n}], got {list(bias.shape)}")
    if config.split_k > 1:
        out = torch.empty(config.split_k, m, n, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (n // config.block_n, triton.cdiv(m, config.block_m), config.split_k)
    gemm_kernel[grid](a, w, bias if bias is not None else a, out, m, N=n, K=k, BLOCK_M=config.block_m,
                      BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
                      HAS_BIAS=bias is not None, SILU=silu, INTERPRETED=interpreted(),
                      num_warps=config.num_warps, num_stages=config.num_stages, **COMPILE_OPTIONS)
    return out


def sum_parts(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The split-K partials [S, M, N] summed in order 0..S-1 in float32, rounded once to dtype:
    the reference for every reader of them."""
    total = parts[0].clone()
    for i in range(1, parts.shape[0]):
        total += parts[i]
    return total.to(dtype)
