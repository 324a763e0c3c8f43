"""Which kernels the decoder layers run: "aten" (plain torch / ATen ops, the default) or "triton"
(the fused Triton kernels of kernels/: residual add + RMSNorm, the q/k/v split with q/k norm + RoPE,
SiLU(gate)*up, one-kernel Score / prefill attention, one-kernel decode attention; before an FP8
GEMM, the norm and SiLU*up quantizing their output, and the one-kernel quantizer).

With "triton" on a GPU both runtimes launch the very same ahead-of-time compiled cubins
(kernels/aot.py, compiled once per model shape into the cache) through the extension
(cpp_dag._core.TritonKernels), so they stay byte-identical. On a CPU the C++ runtime has no
Triton path; the Python runtime can run the kernels through Triton's interpreter
(TRITON_INTERPRET=1), which is how CI checks the wiring against Hugging Face.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..artifact.artifact import Artifact
from ..model import progress
from ..model.config import ModelConfig
from ..artifact.resolve import cache_dir
from ..siblings import IMPORT_ROOT, ROOT, module_name, sibling

KERNEL_CHOICES = ("aten", "triton")


class JitKernels:
    """The Triton launchers of kernels/ behind the interface of cpp_dag._core.TritonKernels.

    kernels/ is imported here, not at module load: Triton reads TRITON_INTERPRET when a kernel is
    defined, and the plain-torch path should not pay for importing Triton at all."""

    def __init__(self) -> None:
        beam_topk, decode_attention, fp8_quant, norm_act, qkv_rope, segment_attention, trie = (
            sibling(f"kernels.{m}") for m in ("beam_topk", "decode_attention", "fp8_quant", "norm_act", "qkv_rope",
                                              "segment_attention", "trie"))

        self.silu_mul = norm_act.silu_mul
        self.silu_mul_fp8 = norm_act.silu_mul_fp8
        self.quantize_rows = fp8_quant.quantize_rows_triton
        self._rms_norm_fp8 = norm_act.rms_norm_fp8
        self._trie_allowed, self.trie_advance = trie.trie_allowed, trie.trie_advance
        self.segment_attention = segment_attention.segment_attention
        self.decode_attention_qkv = decode_attention.decode_attention_qkv
        self.beam_candidates, self.beam_merge, self.beam_commit = (beam_topk.beam_candidates, beam_topk.beam_merge,
                                                                beam_topk.beam_commit)
        self._rms_norm, self._qkv_rope = norm_act.rms_norm, qkv_rope.qkv_rope

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def rms_norm_residual(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm(x, weight, eps, residual=residual)

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rms_norm_fp8(x, weight, eps)

    def rms_norm_residual_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._rms_norm_fp8(x, weight, eps, residual=residual)

    def trie_allowed(self, trie: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor, cols: torch.Tensor | None,
                     num_words: int) -> torch.Tensor:
        return self._trie_allowed(trie, offsets, tokens, num_words, cols)

    def qkv_rope(self, qkv: torch.Tensor, positions: torch.Tensor, pos_offset: int, cos: torch.Tensor,
                 sin: torch.Tensor, num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, k_out: torch.Tensor | None = None,
                 v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._qkv_rope(qkv, positions, cos, sin, num_heads, num_kv_heads, q_norm, k_norm, eps, pos_offset,
                              k_out, v_out)


def resolve_kernels(kernels: str, device: str) -> str:
    """"auto": the fused Triton kernels on a Hopper GPU (the fast path; kernels/aot.py compiles them
    for sm_90a only), ATen elsewhere (the CPU, older GPUs)."""
    if kernels == "auto":
        on_hopper = str(device).startswith("cuda") and torch.cuda.get_device_capability(torch.device(device)) >= (9, 0)
        return "triton" if on_hopper else "aten"
    check_choice(kernels)
    return kernels


def check_choice(kernels: str) -> None:
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels: {kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")


def kernel_shape(cfg: ModelConfig) -> dict[str, int]:
    """The model shapes the kernel variants depend on: `python -m kernels.aot --shape` (JSON)."""
    return dict(hidden_size=cfg.hidden_size, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)


def kernels_dir(artifact: Artifact, dtype: torch.dtype, cache: Path | None = None) -> Path:
    """The AOT cubins for this model's shapes and dtype, compiled on first use into the cache
    (keyed by the shapes, the dtype, the Triton version and the kernels' sources)."""
    import triton

    dtype_name = str(dtype).removeprefix("torch.")
    shape = json.dumps(kernel_shape(artifact.config), sort_keys=True)
    sources = sorted((ROOT / "kernels").glob("*.py"))
    key = hashlib.sha256("\n".join([triton.__version__, dtype_name, shape,
                                    *(hashlib.sha256(p.read_bytes()).hexdigest() for p in sources)])
                         .encode()).hexdigest()[:16]
    if cache is None:
        cache = cache_dir()
    out = cache / "kernels" / key
    if (out / "kernels.msgpack").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real
    progress.note(f"compiling the Triton kernels for {dtype_name} {shape} into {out} (once per model shape)")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", module_name("kernels.aot"), "--shape", shape, "--out", str(tmp),
                           "--dtype", dtype_name], cwd=IMPORT_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the Triton kernels for {artifact.path} failed:\n{proc.stderr[-3000:]}")
    try:
        tmp.rename(out)  # atomic; another process may have won the race: its copy is as good
    except OSError:
        if not (out / "kernels.msgpack").is_file():
            raise
    progress.note(f"compiled the Triton kernels in {time.monotonic() - t0:.1f} s")
    return out


def python_kernels(kernels: str, artifact: Artifact, device: torch.device, dtype: torch.dtype) -> Any:
    """What the Python runtime's NodeContext.fused gets for a kernels choice."""
    check_choice(kernels)
    if kernels == "aten":
        return None
    if device.type == "cuda":
        return sibling("cpp_dag._core").TritonKernels(str(kernels_dir(artifact, dtype)), str(device))
    if os.environ.get("TRITON_INTERPRET") == "1":
        return JitKernels()
    raise ValueError("kernels='triton' on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, "
                     "for tests); use kernels='aten'")
