"""The compiled kernels keep torch's roundings: no FMA contraction (kernels/__init__.py's
COMPILE_OPTIONS), checked in the PTX that kernels/aot.py compiles for sm_90 on this CPU machine.

With Triton's default (enable_fp_fusion=True) LLVM contracts RoPE's `round(x * cos) + round(x2 * sin)`
into one `fma.rn.bf16`, so the compiled kernel is 1 bf16 ulp off torch where the CPU interpreter
(no compiler) agrees: this test shows that failure mode and that the options remove it. (Bit
equality on the device: tests/kernels/test_qkv_rope.py and test_aot_launch.py, marked gpu.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# compiles each element-wise kernel variant of a qwen3-0.6b-shaped model as kernels/aot.py does and
# with Triton's default options, and counts FMA instructions in the PTX (in a subprocess: this
# session's kernels are defined under the interpreter)
SCRIPT = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.aot import _compile, model_kernel_specs

# the kernels that must round as torch's op-by-op (the FP8 ones: bf16 only, then quantize_rows' arithmetic)
ELEMENTWISE = ("rms_norm.", "qkv_rope.", "silu_mul.", "rms_norm_fp8.", "silu_mul_fp8.", "quantize_rows.")

out = {}
for dtype in ("bfloat16", "float32"):
    for spec in model_kernel_specs(1024, 128, 3072, 16, 8, dtype=dtype):
        if not spec.variant.startswith(ELEMENTWISE):
            continue
        out[spec.variant] = _compile(spec, 90).asm["ptx"].count("fma.")  # what the cubins get
        src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs)
        default = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": spec.num_warps})
        out[spec.variant + "/triton-default"] = default.asm["ptx"].count("fma.")
print(json.dumps(out))
"""


def test_no_fma_in_the_elementwise_kernels() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fmas = json.loads(proc.stdout.strip().splitlines()[-1])
    # the failure mode is real: Triton's default contracts RoPE's products and sums
    assert fmas["qkv_rope.h16.g8.e128.norm0.bf16/triton-default"] > 0
    assert fmas["qkv_rope.h16.g8.e128.norm0.fp32/triton-default"] > 0
    # and kernels/aot.py compiles every element-wise kernel without an FMA
    compiled = {k: v for k, v in fmas.items() if not k.endswith("/triton-default")}
    assert len(compiled) == 15 and {k: v for k, v in compiled.items() if v} == {}
    assert {"rms_norm_fp8.n1024.res1.bf16", "silu_mul_fp8.i3072.bf16", "quantize_rows.n2048.bf16"} <= set(compiled)
