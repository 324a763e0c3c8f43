"""FP8 (e4m3) activations quantized by Triton kernels (issue 29): kernels/fp8_linear.py's
`quantize_rows` (per row scale = amax / 448, a zero row 1; the quotient clamped to +-448, cast to
e4m3) as the end of a kernel's tile (`quantize_tile`) and as one kernel alone (`quantize_rows_triton`).

Byte-identical to `quantize_rows` on the GPU: both divisions are correctly rounded (`div_rn`, as
ATen's), and the cast rounds to nearest even and saturates (`cvt.rn.satfinite`, as torch's after the
clamp). Triton's CPU interpreter casts its own way (ties away from zero, a mantissa carry into the
exponent lost), so under it the values may differ by an e4m3 step (tests/kernels/test_fp8_linear.py).
`quantize_rows` is ~6 ATen launches; this is one, or none inside the producing kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS
from .fp8_linear import FP8_DTYPE


@triton.jit
def row_tile(num_rows, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS whole rows of a contiguous [num_rows, D] tensor: (rows, cols, mask, offs)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < D)
    return rows, cols, mask, rows[:, None] * D + cols[None, :]


TILE_ELEMENTS = 4096  # elements one program handles: 16-32 per thread, enough loads in flight


def row_tile_config(d: int) -> dict[str, int]:
    """The tile of a kernel over whole rows of d elements (the quantizer, the RMSNorms): ROWS rows of
    BLOCK_D (d rounded up to a power of two) per program."""
    block_d = triton.next_power_of_2(d)
    return {"BLOCK_D": block_d, "ROWS": max(1, TILE_ELEMENTS // block_d), "num_warps": 4 if block_d <= 2048 else 8}


@triton.jit
def quantize_tile(t, q_ptr, scale_ptr, rows, offs, mask, num_rows):
    """Stores a [ROWS, BLOCK] tile of whole rows (zero past each row's end) as e4m3 at q_ptr + offs
    and each row's scale at scale_ptr + rows: quantize_rows' arithmetic (the kernels that produce an
    FP8 GEMM's activations end with it: kernels/norm_act.py's _fp8 variants)."""
    tf = t.to(tl.float32)
    amax = tl.max(tl.abs(tf), axis=1)  # [ROWS]
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = tl.math.div_rn(tf, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < num_rows)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_rows, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         ROWS: tl.constexpr):
    # x [num_rows, D] -> q [num_rows, D] e4m3, scale [num_rows] float32; tile [ROWS, BLOCK_D]
    rows, cols, mask, offs = row_tile(num_rows, D, BLOCK_D, ROWS)
    quantize_tile(tl.load(x_ptr + offs, mask=mask, other=0.0), q_ptr, scale_ptr, rows, offs, mask, num_rows)


def fp8_rows(m: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a quantizing kernel: e4m3 [m, d] and a float32 scale a row [m]."""
    return (torch.empty(m, d, dtype=FP8_DTYPE, device=device),
            torch.empty(m, dtype=torch.float32, device=device))


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] contiguous -> (e4m3 [M, K], float32 scale [M]): quantize_rows in one kernel."""
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"quantize_rows_triton: x must be a contiguous [M, K], got {list(x.shape)}")
    m, d = x.shape
    q, scale = fp8_rows(m, d, x.device)
    cfg = row_tile_config(d)
    quantize_rows_kernel[(triton.cdiv(m, cfg["ROWS"]),)](x, q, scale, m, D=d, BLOCK_D=cfg["BLOCK_D"],
                                                         ROWS=cfg["ROWS"], num_warps=cfg["num_warps"],
                                                         **COMPILE_OPTIONS)
    return q, scale
