"""Ahead-of-time compilation of the Triton kernels into cubins for the C++ executor (no GPU needed).

`compile_kernels(specs, out_dir)` writes one `<variant>.cubin` per kernel variant and a
`kernels.json` manifest (and the same as `kernels.msgpack` for the C++ loader): for each variant
the cubin file and its SHA-256, the function name, the launch parameters in order (name and C
type; constexpr arguments are baked in and absent, and the two trailing scratch pointers of
Triton >= 3.3/3.5 are listed), `num_warps` (block = 32 x num_warps threads), dynamic shared
memory bytes, and the scratch sizes: the launch ABI that cpp_dag/triton_kernels.cpp checks and uses;
and, read from the cubin, the registers a thread and the local-memory bytes (register spills).
`model_kernel_specs(...)` lists the variants one model needs.

  python -m kernels.aot --shape '{"hidden_size": 896, ...}' --out DIR [--arch 90] [--dtype bfloat16]

(service.runtime.fused.kernel_shape gives a model's shape; this package imports nothing from service/.)
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from . import COMPILE_OPTIONS

C_TYPES = {"i1": "int8_t", "i32": "int32_t", "i64": "int64_t", "fp32": "float"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class KernelSpec:
    variant: str  # unique file stem, derivable from the call's shapes (the C++ side looks it up by name)
    fn: Any  # the @triton.jit function
    signature: dict[str, str]  # every argument in order: "*bf16", "i32", "fp32", "constexpr", ...
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    # pointer arguments the caller guarantees 16-byte aligned (the launcher checks): Triton's JIT
    # assumes it of every aligned pointer; without it loads are scalar and registers spill
    divisible_by_16: tuple[str, ...] = ()
    grid: str = ""  # how the C++ side sizes the grid, for the manifest reader
    extra: dict[str, Any] = field(default_factory=dict)


def _compile(spec: KernelSpec, arch: int):
    unknown = set(spec.constexprs) - {n for n, t in spec.signature.items() if t == "constexpr"}
    if unknown:
        raise ValueError(f"{spec.variant}: constexprs {sorted(unknown)} are not constexpr in the signature")
    if not isinstance(spec.fn, JITFunction):
        raise RuntimeError(f"{spec.variant}: the kernel was defined under TRITON_INTERPRET=1; compile in a process "
                           "without it")
    names = list(spec.signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible_by_16}
    src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": spec.num_warps, "num_stages": spec.num_stages, **COMPILE_OPTIONS})


def resource_usage(cubin: bytes) -> dict[str, int]:
    """The cubin's registers a thread, and its stack and local-memory bytes (local memory: register
    spills), read by the cuobjdump that Triton ships ({} when it has none)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out))
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), "local_bytes": int(found["LOCAL"])} \
        if len(found) == 3 else {}


def _params(spec: KernelSpec) -> list[dict[str, str]]:
    params = []
    for name, ty in spec.signature.items():
        if ty == "constexpr":
            continue
        params.append({"name": name, "type": "CUdeviceptr" if ty.startswith("*") else C_TYPES[ty], "triton": ty,
                       "divisible_by_16": name in spec.divisible_by_16})
    params.append({"name": "global_scratch", "type": "CUdeviceptr", "triton": "scratch"})
    params.append({"name": "profile_scratch", "type": "CUdeviceptr", "triton": "scratch"})
    return params


# the specs of the compile in progress, for the worker processes (forked: a spec's @triton.jit
# function does not pickle, so a worker takes its spec by index from the memory it inherited)
_SPECS: list[KernelSpec] = []


def _compile_entry(index: int, arch: int) -> tuple[bytes, dict[str, Any]]:
    """One variant's cubin and manifest entry (less the file name and hash, which the caller adds)."""
    spec = _SPECS[index]
    t0 = time.perf_counter()
    compiled = _compile(spec, arch)
    md = compiled.metadata
    if md.num_ctas != 1 or md.launch_cooperative_grid or md.launch_pdl:
        raise ValueError(f"{spec.variant}: needs cuLaunchKernelEx (num_ctas={md.num_ctas}, "
                         f"cooperative={md.launch_cooperative_grid}, pdl={md.launch_pdl})")
    cubin = compiled.asm["cubin"]
    return cubin, {
        "function": md.name, "num_warps": md.num_warps, "shared_bytes": md.shared,
        "global_scratch_size": md.global_scratch_size, "profile_scratch_size": md.profile_scratch_size,
        "params": _params(spec), "constexprs": {k: v for k, v in spec.constexprs.items()},
        "grid": spec.grid, **spec.extra, **resource_usage(cubin),
        "compile_ms": round((time.perf_counter() - t0) * 1e3, 1)}


def default_jobs() -> int:
    """Worker processes for compile_kernels: SLMRANK_AOT_JOBS, else the CPUs this process may use
    (each compile is one CPU's work: Triton's passes, then ptxas)."""
    env = os.environ.get("SLMRANK_AOT_JOBS", "")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"SLMRANK_AOT_JOBS: a positive whole number of worker processes, got {env!r}")
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


def compile_kernels(specs: list[KernelSpec], out_dir: str | Path, arch: int = 90, jobs: int | None = None) -> dict[str, Any]:
    """Compiles every spec (in `jobs` forked worker processes, default_jobs(); 1: in this one) and
    writes the cubins and the manifest, its entries in the order of `specs` whatever finished first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if jobs is not None and jobs < 1:
        raise ValueError(f"jobs: at least 1 worker process, got {jobs}")
    jobs = max(1, min(default_jobs() if jobs is None else jobs, len(specs)))
    _SPECS[:] = specs
    try:
        if jobs == 1:
            results = [_compile_entry(i, arch) for i in range(len(specs))]
        else:
            # fork before this process compiles anything (no compiler threads yet to inherit)
            with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                results = list(pool.map(_compile_entry, range(len(specs)), itertools.repeat(arch)))
    finally:
        _SPECS.clear()
    entries = []
    for spec, (cubin, entry) in zip(specs, results):
        (out / f"{spec.variant}.cubin").write_bytes(cubin)
        entries.append({"variant": spec.variant, "cubin": f"{spec.variant}.cubin",
                        "sha256": hashlib.sha256(cubin).hexdigest(), **entry})
    manifest = {"triton_version": triton.__version__, "target": f"sm_{arch}a" if arch >= 90 else f"sm_{arch}",
                "kernels": entries}
    (out / "kernels.json").write_text(json.dumps(manifest, indent=1))
    (out / "kernels.msgpack").write_bytes(msgpack.packb(manifest))  # what cpp_dag/triton_kernels.cpp reads
    return manifest


def variant_name(kernel: str, dt: str, **dims: int) -> str:
    """e.g. rms_norm.n896.res1.bf16, segment_attention.h14.g2.e64.bf16 (cpp_dag/triton_kernels.cpp
    builds the same names from a call's shapes)."""
    return ".".join([kernel, *(f"{k}{v}" for k, v in dims.items()), dt])


def model_kernel_specs(hidden_size: int, head_dim: int, intermediate_size: int, num_heads: int,
                       num_kv_heads: int, dtype: str = "bfloat16") -> list[KernelSpec]:
    """The kernel variants one model needs, for `dtype` activations."""
    from . import decode_attention, segment_attention
    from .norm_act import rms_norm_config, rms_norm_kernel, silu_mul_config, silu_mul_kernel
    from .qkv_rope import qkv_rope_config, qkv_rope_kernel

    dt = DTYPES[dtype]
    specs = []
    norm = rms_norm_config(hidden_size)
    for res in (False, True):
        specs.append(KernelSpec(
            variant_name("rms_norm", dt, n=hidden_size, res=int(res)), rms_norm_kernel,
            {"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "sum_ptr": f"*{dt}",
             "num_rows": "i32", "eps": "fp32", "D": "constexpr", "BLOCK_D": "constexpr", "ROWS": "constexpr",
             "HAS_RESIDUAL": "constexpr"},
            {"D": hidden_size, "BLOCK_D": norm["BLOCK_D"], "ROWS": norm["ROWS"], "HAS_RESIDUAL": res},
            num_warps=norm["num_warps"], divisible_by_16=("x_ptr", "res_ptr", "w_ptr", "out_ptr", "sum_ptr"),
            grid="(cdiv(rows, ROWS), 1, 1)"))
    rope = qkv_rope_config(num_kv_heads, head_dim)
    for has_norm in (False, True):
        specs.append(KernelSpec(
            variant_name("qkv_rope", dt, h=num_heads, g=num_kv_heads, e=head_dim, norm=int(has_norm)),
            qkv_rope_kernel,
            {"qkv_ptr": f"*{dt}", "pos_ptr": "*i64", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "qw_ptr": f"*{dt}",
             "kw_ptr": f"*{dt}", "q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "num_tokens": "i32",
             "pos_offset": "i32", "kv_stride8": "i32", "eps": "fp32", "H": "constexpr", "G": "constexpr",
             "E": "constexpr", "HB": "constexpr", "BLOCK_T": "constexpr", "QK_NORM": "constexpr"},
            {"H": num_heads, "G": num_kv_heads, "E": head_dim, "HB": rope["HB"], "BLOCK_T": rope["BLOCK_T"],
             "QK_NORM": has_norm},
            num_warps=rope["num_warps"],
            divisible_by_16=("qkv_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "q_ptr", "k_ptr",
                             "v_ptr"),
            grid="(cdiv(tokens, BLOCK_T), (H + 2 * G) / HB, 1)"))
    act = silu_mul_config(intermediate_size)
    specs.append(KernelSpec(
        variant_name("silu_mul", dt, i=intermediate_size), silu_mul_kernel,
        {"gu_ptr": f"*{dt}", "out_ptr": f"*{dt}", "num_rows": "i32", "INTER": "constexpr", "BLOCK": "constexpr",
         "ROWS": "constexpr"},
        {"INTER": intermediate_size, "BLOCK": act["BLOCK"], "ROWS": act["ROWS"]}, num_warps=act["num_warps"],
        divisible_by_16=("gu_ptr", "out_ptr"), grid="(cdiv(rows, ROWS), cdiv(INTER, BLOCK), 1)"))
    if dtype == "bfloat16":  # FP8 GEMMs (`slmrank build --fp8`) take bf16 activations only
        specs += fp8_specs(dt, hidden_size, intermediate_size, num_heads * head_dim)
    tile = decode_attention.default_tile(head_dim, dtype == "float32")
    for has_norm in (False, True):  # the runtimes' form: from the q/k/v GEMM's output (decode_attention_qkv)
        specs.append(KernelSpec(
            variant_name("decode_attention", dt, h=num_heads, g=num_kv_heads, e=head_dim, norm=int(has_norm)),
            decode_attention.decode_attention_kernel,
            {"q_ptr": f"*{dt}", "pk_ptr": f"*{dt}", "pv_ptr": f"*{dt}", "start_ptr": "*i64", "len_ptr": "*i64",
             "sk_ptr": f"*{dt}", "sv_ptr": f"*{dt}", "sr_ptr": "*i64", "out_ptr": f"*{dt}", "pos_ptr": "*i64",
             "cos_ptr": f"*{dt}",
             "sin_ptr": f"*{dt}", "qw_ptr": f"*{dt}", "kw_ptr": f"*{dt}", "num_rows": "i32", "num_slots": "i32",
             "num_suffix": "i32", "pos_offset": "i32", "scale": "fp32", "eps": "fp32", "H": "constexpr",
             "G": "constexpr", "E": "constexpr", "QPG": "constexpr", "BEAMS": "constexpr", "BLOCK_M": "constexpr",
             "BLOCK_N": "constexpr", "BLOCK_B": "constexpr", "ROPE": "constexpr", "QK_NORM": "constexpr",
             "INTERPRETED": "constexpr"},
            decode_attention.kernel_constexprs(num_heads, num_kv_heads, head_dim, tile, rope=True, qk_norm=has_norm),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
            divisible_by_16=("q_ptr", "pk_ptr", "pv_ptr", "start_ptr", "len_ptr", "sk_ptr", "sv_ptr", "sr_ptr",
                             "out_ptr", "pos_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr"),
            grid="(cdiv(rows, BEAMS), num_kv_heads, 1)"))
    tile = segment_attention.default_tile(head_dim, dtype == "float32")
    specs.append(KernelSpec(
        variant_name("segment_attention", dt, h=num_heads, g=num_kv_heads, e=head_dim),
        segment_attention.segment_attention_kernel,
        {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "ranges_ptr": "*i32", "out_ptr": f"*{dt}",
         "num_rows": "i32", "scale": "fp32", "H": "constexpr", "G": "constexpr", "E": "constexpr",
         "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "INTERPRETED": "constexpr"},
        segment_attention.kernel_constexprs(num_heads, num_kv_heads, head_dim, tile),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        divisible_by_16=("q_ptr", "k_ptr", "v_ptr", "ranges_ptr", "out_ptr"),
        grid="(num_heads, cdiv(rows, BLOCK_M), 1)"))
    return specs + beam_topk_specs(dt) + trie_specs()


def trie_specs() -> list[KernelSpec]:
    """A catalog trie's lookups (kernels/trie.py): integer kernels, one variant for every model and
    catalog (named fp32 as the beam step's float-only ones are, whatever the model's dtype)."""
    from . import trie

    specs = [KernelSpec(
        variant_name("trie_allowed", "fp32", cols=cols), trie.trie_allowed_kernel,
        {"trie_ptr": "*i64", "offsets_ptr": "*i64", "tokens_ptr": "*i64", "cols_ptr": "*i64", "words_ptr": "*i32",
         "num_words": "i32", "BLOCK_K": "constexpr", "BLOCK_W": "constexpr", "HAS_COLS": "constexpr"},
        {"BLOCK_K": trie.BLOCK_K, "BLOCK_W": trie.BLOCK_W, "HAS_COLS": bool(cols)}, grid="(rows, 1, 1)")
        for cols in (0, 1)]
    specs.append(KernelSpec(
        variant_name("trie_advance", "fp32"), trie.trie_advance_kernel,
        {"trie_ptr": "*i64", "next_ptr": "*i64", "offsets_ptr": "*i64", "tokens_ptr": "*i64", "child_ptr": "*i64",
         "out_ptr": "*i64", "BLOCK_K": "constexpr"}, {"BLOCK_K": trie.BLOCK_K}, grid="(n, 1, 1)"))
    return specs


def fp8_specs(dt: str, hidden_size: int, intermediate_size: int, q_size: int) -> list[KernelSpec]:
    """The kernels that end in an FP8 GEMM's activation (e4m3 rows and a float32 scale each): the
    norms before q/k/v and gate/up, SiLU*up before down, the quantizer alone before o (the
    attention's output) and the LM head (the final norm's output)."""
    from .fp8_quant import quantize_rows_kernel, row_tile_config
    from .norm_act import rms_norm_config, rms_norm_fp8_kernel, silu_mul_fp8_config, silu_mul_fp8_kernel

    out = {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}  # every one's outputs: e4m3 rows, a scale a row
    specs = []
    norm = rms_norm_config(hidden_size)
    for res in (False, True):
        specs.append(KernelSpec(
            variant_name("rms_norm_fp8", dt, n=hidden_size, res=int(res)), rms_norm_fp8_kernel,
            {"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", **out,
             "sum_ptr": f"*{dt}", "num_rows": "i32", "eps": "fp32", "D": "constexpr", "BLOCK_D": "constexpr",
             "ROWS": "constexpr", "HAS_RESIDUAL": "constexpr"},
            {"D": hidden_size, "BLOCK_D": norm["BLOCK_D"], "ROWS": norm["ROWS"], "HAS_RESIDUAL": res},
            num_warps=norm["num_warps"], divisible_by_16=("x_ptr", "res_ptr", "w_ptr", "q_ptr", "sum_ptr"),
            grid="(cdiv(rows, ROWS), 1, 1)"))

    def rows_only(name: str, fn: Any, source: str, constexprs: dict[str, int], num_warps: int) -> KernelSpec:
        # a kernel of one input (`source`) and the e4m3 outputs, over rows: its constexprs in signature order
        signature = {source: f"*{dt}", **out, "num_rows": "i32", **dict.fromkeys(constexprs, "constexpr")}
        return KernelSpec(name, fn, signature, constexprs, num_warps=num_warps, divisible_by_16=(source, "q_ptr"),
                          grid="(cdiv(rows, ROWS), 1, 1)")

    act = silu_mul_fp8_config(intermediate_size)
    specs.append(rows_only(variant_name("silu_mul_fp8", dt, i=intermediate_size), silu_mul_fp8_kernel, "gu_ptr",
                           {"INTER": intermediate_size, "BLOCK": act["BLOCK"], "ROWS": act["ROWS"]}, act["num_warps"]))
    for d in sorted({hidden_size, q_size}):
        cfg = row_tile_config(d)
        specs.append(rows_only(variant_name("quantize_rows", dt, n=d), quantize_rows_kernel, "x_ptr",
                               {"D": d, "BLOCK_D": cfg["BLOCK_D"], "ROWS": cfg["ROWS"]}, cfg["num_warps"]))
    return specs


def beam_topk_specs(dt: str, max_sort: int = 512) -> list[KernelSpec]:
    """The beam step's selection kernels (kernels/beam_topk.py) for `dt` logits: the streaming ones
    per group count, the threshold and select ones per sort width KP = 2, 4, ..., max_sort (beam
    widths up to max_sort), each without (mask0) and with (mask1) an allowed-token bitmask: catalogs."""
    from . import beam_topk

    widths = [1 << i for i in range(1, max_sort.bit_length()) if 1 << i <= max_sort]
    logits = {"x_ptr": f"*{dt}"}
    row = {"vocab": "i32", "stride_x": "i32", "words": "i32"}
    # 16-byte aligned buffers, and logits rows of a multiple of 16 elements (cpp_dag checks the stride)
    aligned = ("x_ptr", "s_ptr", "slot_ptr", "allowed_ptr", "stride_x")
    specs = []
    for ng, mask in itertools.product(sorted({beam_topk.sizes(k)["NG"] for k in widths}), (0, 1)):
        parts = {"NUM_PARTS": beam_topk.NUM_PARTS, "NG": ng, "HAS_MASK": bool(mask), "INTERPRETED": False}
        specs.append(KernelSpec(
            variant_name("beam_stats", dt, g=ng, mask=mask), beam_topk.beam_stats_kernel,
            {**logits, "s_ptr": "*fp32", "slot_ptr": "*i64", "allowed_ptr": "*i32", "pmax_ptr": "*fp32",
             "psum_ptr": "*fp32", "gpart_ptr": "*fp32", **row, "num_ranks": "i32",
             **dict.fromkeys(parts, "constexpr")}, parts,
            divisible_by_16=aligned + ("pmax_ptr", "psum_ptr", "gpart_ptr"), grid="(rows, NUM_PARTS, 1)"))
        specs.append(KernelSpec(
            variant_name("beam_collect", dt, g=ng, mask=mask), beam_topk.beam_collect_kernel,
            {**logits, "allowed_ptr": "*i32", "stats_ptr": "*fp32", "count_ptr": "*i32", "buf_ptr": "*i32", **row,
             "cap": "i32", **dict.fromkeys(parts, "constexpr")}, parts,
            divisible_by_16=("x_ptr", "allowed_ptr", "stride_x", "stats_ptr", "count_ptr", "buf_ptr"),
            grid="(rows, NUM_PARTS, 1)"))
    for kp in widths:
        sz = beam_topk.sizes(kp)
        consts = {"NUM_PARTS": beam_topk.NUM_PARTS, "NG": sz["NG"], "KP": kp, "INTERPRETED": False}
        specs.append(KernelSpec(
            variant_name("beam_threshold", "fp32", g=sz["NG"], k=kp), beam_topk.beam_threshold_kernel,
            {"s_ptr": "*fp32", "slot_ptr": "*i64", "pmax_ptr": "*fp32", "psum_ptr": "*fp32", "gpart_ptr": "*fp32",
             "stats_ptr": "*fp32", "count_ptr": "*i32", "num_candidates": "i32", "num_ranks": "i32",
             **dict.fromkeys(consts, "constexpr")},
            consts, grid="(rows, 1, 1)",
            divisible_by_16=("s_ptr", "slot_ptr", "pmax_ptr", "psum_ptr", "gpart_ptr", "stats_ptr", "count_ptr")))
        for mask in (0, 1):
            consts = {"NG": sz["NG"], "KP": kp, "CAP": sz["CAP"], "HAS_MASK": bool(mask), "INTERPRETED": False}
            specs.append(KernelSpec(
                variant_name("beam_select", dt, k=kp, mask=mask), beam_topk.beam_select_kernel,
                {**logits, "allowed_ptr": "*i32", "stats_ptr": "*fp32", "count_ptr": "*i32", "buf_ptr": "*i32",
                 "src_ptr": "*i64", "out_ptr": "*i64", **row, "num_candidates": "i32", "num_parents": "i32",
                 "num_rows": "i32", **dict.fromkeys(consts, "constexpr")},
                consts, num_warps=sz["select_warps"],
                divisible_by_16=("x_ptr", "allowed_ptr", "stride_x", "stats_ptr", "count_ptr", "buf_ptr", "src_ptr",
                                 "out_ptr"), grid="(ranks, 1, 1)"))
    for kp in widths:  # the merge of a request's keys: integer work, one variant a sort width (named fp32 as above)
        sz = beam_topk.merge_sizes(kp)
        specs.append(KernelSpec(
            variant_name("beam_merge", "fp32", k=kp), beam_topk.beam_merge_kernel,
            {"in_ptr": "*i64", "out_ptr": "*i64", "n_in": "i32", "n_out": "i32", "num_beams": "i32",
             "KP": "constexpr", "CHUNK": "constexpr", "INTERPRETED": "constexpr"},
            {"KP": kp, "CHUNK": sz["CHUNK"], "INTERPRETED": False}, num_warps=sz["num_warps"],
            grid="(requests, cdiv(keys a request, CHUNK), 1)"))
    i64 = ("top_ptr", "seqs_ptr", "widths_ptr", "slot_ptr", "src_ptr", "codes_ptr", "seqs_out_ptr")
    for codes in (0, 1):  # the bookkeeping: integer work, one variant for every model (named fp32 as above)
        specs.append(KernelSpec(
            variant_name("beam_commit", "fp32", codes=codes), beam_topk.beam_commit_kernel,
            {**dict.fromkeys(i64, "*i64"), "scores_out_ptr": "*fp32", "parents_out_ptr": "*i64",
             "tokens_out_ptr": "*i64", "row_tokens_ptr": "*i64", "parent_rows_ptr": "*i64", "rows_in_ptr": "*i64",
             "rows_out_ptr": "*i64",
             **dict.fromkeys(("num_ranks", "num_beams", "seq_len", "step", "vocab", "num_rows", "rank_programs",
                              "is_step", "num_slots"), "i32"), "BLOCK": "constexpr", "HAS_CODES": "constexpr"},
            {"BLOCK": beam_topk.COMMIT_BLOCK, "HAS_CODES": bool(codes)},
            grid="(cdiv(ranks, BLOCK) + cdiv(rows, BLOCK), 1, 1)"))
    return specs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True,
                   help="JSON: hidden_size, head_dim, intermediate_size, num_heads, num_kv_heads "
                        "(service/runtime/fused.py derives it from an artifact)")
    p.add_argument("--out", required=True)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: SLMRANK_AOT_JOBS, else the CPUs this process may use)")
    args = p.parse_args()
    shape = json.loads(args.shape)
    specs = model_kernel_specs(**shape, dtype=args.dtype)
    manifest = compile_kernels(specs, args.out, args.arch, args.jobs)
    for k in manifest["kernels"]:
        print(f"{k['variant']:36s} {k['function']:28s} warps {k['num_warps']} shared {k['shared_bytes']:6d} B "
              f"registers {k.get('registers', '?'):>3} spills {k.get('local_bytes', '?'):>4} B "
              f"{k['compile_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
