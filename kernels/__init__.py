"""Triton/CUDA kernels, each beside its plain-torch reference."""

import os

# Every kernel is compiled without floating-point contraction (JIT launches and kernels/aot.py).
# Triton's default (enable_fp_fusion=True) lets LLVM fuse a multiply and an add into one FMA, which
# drops the rounding in between: LLVM first narrows `(a * b).to(bf16).to(f32) + c` to bf16
# arithmetic (exact), then contracts it to `fma.rn.bf16` (one rounding where torch's mul-then-add
# has two). Seen in norm_rope's PTX for sm_90; it made the compiled RoPE 1 bf16 ulp off torch while
# the CPU interpreter (no compiler) agreed. Without contraction Triton emits `mul.rn`/`add.rn`,
# which ptxas may not fuse either. In float32 the same fusion would break equality with torch's
# element-wise ops.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def interpreted() -> bool:
    """Whether kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1): the value of the
    kernels' INTERPRETED constexpr at a JIT launch (every AOT variant is compiled with False)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
