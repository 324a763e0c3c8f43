"""Fused element-wise Triton kernels of the decoder layer, with Hugging Face Qwen numerics.

- `rms_norm`: y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), computed in float32 per row;
  with `residual`, x + residual first (rounded to x.dtype, as torch's add) and that sum is
  returned too (it is the next residual stream). ROWS rows per program.
- `rms_norm_parts`: the same with the residual given as a split-K GEMM's float32 partials
  [S, rows, D] (kernels/gemm.py): summed in order 0..S-1, rounded to the dtype (the GEMM's
  output), added to x and rounded, then normalised: the reduce and the norm in one pass.
- `silu_mul`: silu(gate) * up of a fused [N, 2I] gate/up projection, rounded as torch does
  (silu to the dtype, then the product): replaces chunk + silu + mul.
- `rms_norm_fp8`, `silu_mul_fp8`: the same, ending in the next FP8 GEMM's activation instead of
  the dtype's rows: e4m3 rows and a float32 scale each (kernels/fp8_quant.py), equal to
  `quantize_rows` of the plain kernel's output; one kernel where the unfused path has ~7 launches.

The references are `service.model.layers.rms_norm` and torch's `F.silu(gate) * up`;
tests/kernels/test_norm_act.py checks them on fresh random inputs (on a CPU through Triton's
interpreter). The row length D and the intermediate size are constexprs (one AOT variant per
model shape), so every load and store is a 16-byte vector where the tensors are 16-byte aligned
(the C++ launchers check it; kernels/aot.py promises it to the compiler).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS
from .fp8_quant import TILE_ELEMENTS, fp8_rows, quantize_tile, row_tile, row_tile_config

# the RMSNorm kernels' tile for rows of d elements: ROWS rows of BLOCK_D (d rounded up to a power of
# two) per program
rms_norm_config = row_tile_config


@triton.jit
def _normed(x, w_ptr, cols, eps, D: tl.constexpr):
    """A [ROWS, BLOCK_D] tile of rows (zero past D) -> w * (x * rsqrt(mean(x^2) + eps)).to(dtype).

    The sum of squares is taken in float64: the order of a reduction follows the tile's layout, which
    Triton chooses per kernel from all its loads and stores (the _fp8 variants' 1-byte stores take
    another than the plain kernel's), and a float32 sum in another order moves a row's norm by an ulp
    now and then (qwen3-0.6b's q/k/v input, measured on the H200: one row in 256 took other e4m3
    bytes). The squares are exact in float64; for a bf16 row their float64 sum is exact too, in any
    order, unless the squares span more than ~2^27; otherwise (float32 rows, wider spans) orders
    differ in float64's last bits only, which the rounding to float32 hides but for ~1 row in 2^29."""
    xf = x.to(tl.float32)
    xd = x.to(tl.float64)
    inv = tl.rsqrt(tl.sum(xd * xd, axis=1).to(tl.float32) / D + eps)  # [ROWS]
    y = (xf * inv[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    return (w[None, :].to(tl.float32) * y.to(tl.float32)).to(x.dtype)


@triton.jit
def _with_residual(x_ptr, res_ptr, sum_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # torch's add: the float32 sum rounded to the dtype, which the norm then reads
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offs, x, mask=mask)
    return x


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_rows, eps,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # tile [ROWS, BLOCK_D] of x [num_rows, D]
    rows, cols, mask, offs = row_tile(num_rows, D, BLOCK_D, ROWS)
    x = _with_residual(x_ptr, res_ptr, sum_ptr, offs, mask, HAS_RESIDUAL)
    tl.store(out_ptr + offs, _normed(x, w_ptr, cols, eps, D), mask=mask)


@triton.jit
def rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, sum_ptr, num_rows, eps,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    # rms_norm_kernel whose output is the next FP8 GEMM's activation: e4m3 q [num_rows, D] and a
    # float32 scale a row, quantize_rows of the normed rows in the dtype
    rows, cols, mask, offs = row_tile(num_rows, D, BLOCK_D, ROWS)
    x = _with_residual(x_ptr, res_ptr, sum_ptr, offs, mask, HAS_RESIDUAL)
    quantize_tile(_normed(x, w_ptr, cols, eps, D), q_ptr, scale_ptr, rows, offs, mask, num_rows)


@triton.jit
def rms_norm_parts_kernel(x_ptr, parts_ptr, w_ptr, out_ptr, sum_ptr, num_rows, eps,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PARTS: tl.constexpr):
    rows, cols, mask, offs = row_tile(num_rows, D, BLOCK_D, ROWS)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    p = tl.load(parts_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, PARTS):
        p += tl.load(parts_ptr + i * num_rows * D + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + p.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(sum_ptr + offs, x, mask=mask)
    tl.store(out_ptr + offs, _normed(x, w_ptr, cols, eps, D), mask=mask)


def silu_mul_config(inter: int) -> dict[str, int]:
    """Tile of the SiLU*up kernel: ROWS rows x BLOCK columns of the [N, I] output per program."""
    block = min(1024, triton.next_power_of_2(inter))
    return {"BLOCK": block, "ROWS": max(1, TILE_ELEMENTS // block), "num_warps": 4}


@triton.jit
def _silu_times_up(g, u):
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # F.silu's output, in the dtype
    return (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, num_rows, INTER: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # gate_up [num_rows, 2 * INTER] (gate first) -> out [num_rows, INTER]; tile [ROWS, BLOCK]
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < INTER)
    src = gu_ptr + rows[:, None] * (2 * INTER) + cols[None, :]
    act = _silu_times_up(tl.load(src, mask=mask, other=0.0), tl.load(src + INTER, mask=mask, other=0.0))
    tl.store(out_ptr + rows[:, None] * INTER + cols[None, :], act, mask=mask)


def silu_mul_fp8_config(inter: int) -> dict[str, int]:
    """Tile of the FP8 SiLU*up kernel: whole rows (a row's scale needs all of it), ROWS of them."""
    block = triton.next_power_of_2(inter)
    return {"BLOCK": block, "ROWS": max(1, TILE_ELEMENTS // block), "num_warps": 4 if block <= 2048 else 8}


@triton.jit
def silu_mul_fp8_kernel(gu_ptr, q_ptr, scale_ptr, num_rows, INTER: tl.constexpr, BLOCK: tl.constexpr,
                        ROWS: tl.constexpr):
    # silu_mul_kernel whose output is the down projection's FP8 activation: e4m3 q [num_rows, INTER]
    # and a float32 scale a row (quantize_rows of the product in the dtype); tile [ROWS, BLOCK >= INTER]
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < INTER)
    src = gu_ptr + rows[:, None] * (2 * INTER) + cols[None, :]
    act = _silu_times_up(tl.load(src, mask=mask, other=0.0), tl.load(src + INTER, mask=mask, other=0.0))
    quantize_tile(act, q_ptr, scale_ptr, rows, rows[:, None] * INTER + cols[None, :], mask, num_rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] contiguous; weight [D]. Returns y, or (y, x + residual) with a residual."""
    if not x.is_contiguous() or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())):
        raise ValueError("rms_norm: x (and residual) must be contiguous and of one shape")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must be [{d}], got {list(weight.shape)}")
    rows = x.numel() // d
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    cfg = rms_norm_config(d)
    rms_norm_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
        x, residual if residual is not None else x, weight, out, total, rows, eps, D=d, BLOCK_D=cfg["BLOCK_D"],
        ROWS=cfg["ROWS"], HAS_RESIDUAL=residual is not None, num_warps=cfg["num_warps"], **COMPILE_OPTIONS)
    return (out, total) if residual is not None else out


def rms_norm_parts(x: torch.Tensor, parts: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, D] contiguous; parts [S, rows, D] float32. Returns (norm(x + sum(parts)), that sum)."""
    if x.dim() != 2 or not x.is_contiguous() or parts.shape[1:] != x.shape or parts.dtype != torch.float32 \
            or not parts.is_contiguous():
        raise ValueError(f"rms_norm_parts: x [rows, D] and float32 parts [S, rows, D], both contiguous; got "
                         f"{list(x.shape)} and {list(parts.shape)} {parts.dtype}")
    rows, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"rms_norm_parts: weight must be [{d}], got {list(weight.shape)}")
    out, total = torch.empty_like(x), torch.empty_like(x)
    cfg = rms_norm_config(d)
    rms_norm_parts_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
        x, parts, weight, out, total, rows, eps, D=d, BLOCK_D=cfg["BLOCK_D"], ROWS=cfg["ROWS"],
        PARTS=parts.shape[0], num_warps=cfg["num_warps"], **COMPILE_OPTIONS)
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] contiguous (gate first) -> silu(gate) * up: [N, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: gate_up must be a contiguous [N, 2I], got {list(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    cfg = silu_mul_config(inter)
    silu_mul_kernel[(triton.cdiv(n, cfg["ROWS"]), triton.cdiv(inter, cfg["BLOCK"]))](
        gate_up, out, n, INTER=inter, BLOCK=cfg["BLOCK"], ROWS=cfg["ROWS"], num_warps=cfg["num_warps"],
        **COMPILE_OPTIONS)
    return out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, ...]:
    """rms_norm whose output is quantized for an FP8 GEMM in the same kernel: x [rows, D] -> (e4m3
    q [rows, D], float32 scale [rows]), or with a residual (q, scale, x + residual); equal to
    kernels/fp8_linear.py's quantize_rows of rms_norm's output."""
    if x.dim() != 2 or not x.is_contiguous() or (residual is not None and (residual.shape != x.shape
                                                                           or not residual.is_contiguous())):
        raise ValueError("rms_norm_fp8: x [rows, D] (and residual) must be contiguous and of one shape")
    rows, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"rms_norm_fp8: weight must be [{d}], got {list(weight.shape)}")
    q, scale = fp8_rows(rows, d, x.device)
    total = torch.empty_like(x) if residual is not None else x
    cfg = rms_norm_config(d)
    rms_norm_fp8_kernel[(triton.cdiv(rows, cfg["ROWS"]),)](
        x, residual if residual is not None else x, weight, q, scale, total, rows, eps, D=d,
        BLOCK_D=cfg["BLOCK_D"], ROWS=cfg["ROWS"], HAS_RESIDUAL=residual is not None, num_warps=cfg["num_warps"],
        **COMPILE_OPTIONS)
    return (q, scale, total) if residual is not None else (q, scale)


def silu_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_mul quantized for the down projection's FP8 GEMM in the same kernel: gate_up [N, 2I]
    -> (e4m3 q [N, I], float32 scale [N]), equal to quantize_rows(silu_mul(gate_up))."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul_fp8: gate_up must be a contiguous [N, 2I], got {list(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = fp8_rows(n, inter, gate_up.device)
    cfg = silu_mul_fp8_config(inter)
    silu_mul_fp8_kernel[(triton.cdiv(n, cfg["ROWS"]),)](gate_up, q, scale, n, INTER=inter, BLOCK=cfg["BLOCK"],
                                                         ROWS=cfg["ROWS"], num_warps=cfg["num_warps"],
                                                         **COMPILE_OPTIONS)
    return q, scale
