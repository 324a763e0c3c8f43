"""Kernel micro-benchmarks at the workloads' shapes (BENCHMARKS.md), for the GPU machine.

  python -m ops.bench.bench_kernels [--only decode_attention ...] [--out DIR]

Every kernel is checked against its reference on the same inputs before it is timed. Times are
device times of CUDA-graph replays (CALLS back-to-back calls per graph, the median of REPS
replays, divided by CALLS), so Python's launch overhead is not in them, as in the executor.
Prints one line per measurement; --out DIR also writes DIR/bench_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.attention import masked_attention_ref
from kernels.decode_attention import Tile, decode_attention, decode_attention_qkv, decode_attention_ref
from kernels.qkv_rope import qkv_rope
from kernels.segment_attention import segment_attention
from ops.bench.workloads import WORKLOADS
from service.artifact.fp8_measure import device_time_ms
from service.model.layers import two_part_attention
from service.runtime.nodes import varlen_layer_attention

CALLS, REPS = 20, 30


# the workloads' shapes, from ops/bench/workloads.py (the model dimensions in the tables below are the models')
def _beam(name: str) -> tuple[int, int, int]:
    """A BeamSearch workload's (prompt tokens, beams, new tokens)."""
    w = WORKLOADS[name]
    return w["prompt"], w["beam"], w["new"]


def _score(name: str) -> list[int]:
    """A Score workload's request: [prefix tokens, then each sample's tokens]."""
    w = WORKLOADS[name]
    return [w["prefix"]] + [w["len"]] * w["samples"]


def _model(name: str) -> str:
    return WORKLOADS[name]["model"].removeprefix("embedded:")


def graph_time_ms(fn: Callable[[], Any], calls: int = CALLS, reps: int = REPS) -> float:
    """Device time of one fn() call: CALLS calls captured in one CUDA graph, median of REPS replays."""
    return device_time_ms(fn, calls, reps)


# --- decode attention (kernels/decode_attention.py) -------------------------------------------

# workload: (heads, kv heads, head dim, layers, requests, prompt tokens, beams, new tokens)
DECODE_SHAPES = {
    "W2x8": (14, 2, 64, 24, 8, *_beam("W2")),
    "W3x4": (14, 2, 64, 24, 4, *_beam("W3")),
    "W5x1": (16, 8, 128, 28, 1, *_beam("W5")),
    "W5x2": (16, 8, 128, 28, 2, *_beam("W5")),
    "W6x1": (16, 8, 128, 28, 1, *_beam("W6")),
}
DECODE_TILES = [None, Tile(64, 32, 4, 3), Tile(64, 64, 8, 3), Tile(64, 128, 4, 3), Tile(128, 64, 8, 3),
                Tile(64, 64, 4, 2)]


def decode_inputs(heads: int, kv_heads: int, dim: int, requests: int, prompt: int, beams: int, slots: int,
                  dtype: torch.dtype, seed: int = 0):
    """A decode step's buffers as beam_masks lays them out: prompts packed, a request's beams consecutive."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = requests * beams
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=dtype)
    q, sk, sv = rnd(rows, heads, dim), rnd(rows, slots, kv_heads, dim), rnd(rows, slots, kv_heads, dim)
    pk, pv = rnd(requests * prompt, kv_heads, dim), rnd(requests * prompt, kv_heads, dim)
    kv_start = (torch.arange(requests, device="cuda") * prompt).repeat_interleave(beams)
    kv_len = torch.full((rows,), prompt, dtype=torch.int64, device="cuda")
    return q, pk, pv, kv_start, kv_len, sk, sv


def _decode_workload(name: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    h, g, e, layers, r, p, b, new = DECODE_SHAPES[name]
    slots = new - 1
    args = decode_inputs(h, g, e, r, p, b, slots, dtype)
    q, pk, pv, kv_start, kv_len, sk, sv = args
    scale = e ** -0.5
    truth = decode_attention_ref(*(x.double() if x.is_floating_point() else x for x in args), slots, scale)
    keys = torch.arange(pk.shape[0], device="cuda")
    mask = (keys >= kv_start[:, None]) & (keys < (kv_start + kv_len)[:, None])  # beam_masks' mask_beam

    def aten(t: int) -> torch.Tensor:
        return two_part_attention(q, pk, pv, mask, sk[:, :t], sv[:, :t], None, scale)

    def triton_tile(tile: Tile | None) -> Callable[[int], torch.Tensor]:
        return lambda t: decode_attention(*args, t, scale, tile=tile)

    variants = {"aten": aten}
    for tile in DECODE_TILES:
        variants["triton" if tile is None else "triton_m{}n{}w{}s{}".format(*vars(tile).values())] = triton_tile(tile)
    # what the runtimes run: from the q/k/v GEMM's output, qkv_rope then the attention (before 2c7509d)
    # against the one kernel with qkv_rope's work in its prologue; their error column: against each other
    g_qkv = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(q.shape[0], (h + 2 * g) * e, generator=g_qkv, device="cuda", dtype=dtype)
    cos, sin = (torch.randn(p + new, e, generator=g_qkv, device="cuda", dtype=dtype) for _ in range(2))
    norms = tuple(1 + 0.1 * torch.randn(e, generator=g_qkv, device="cuda", dtype=dtype) for _ in range(2)) \
        if e == 128 else (None, None)  # qwen3's heads carry q/k norms (W5, W6)

    def two_kernels(t: int) -> torch.Tensor:
        q_t, _, _ = qkv_rope(qkv, kv_len, cos, sin, h, g, *norms, EPS, pos_offset=t - 1, k_out=sk[:, t - 1],
                             v_out=sv[:, t - 1])
        return decode_attention(q_t, pk, pv, kv_start, kv_len, sk, sv, t, scale)

    def one_kernel(t: int) -> torch.Tensor:
        return decode_attention_qkv(qkv, kv_len, t - 1, cos, sin, h, *norms, EPS, pk, pv, kv_start, kv_len, sk, sv,
                                    t, scale)

    ref_err = (aten(slots).double() - truth).abs().max().item()
    results = []
    qkv_err = (one_kernel(slots).double() - two_kernels(slots).double()).abs().max().item()
    from_qkv = {"qkv_rope+triton": two_kernels, "triton_from_qkv": one_kernel}
    for label, fn in {**variants, **from_qkv}.items():
        err = qkv_err if label in from_qkv else (fn(slots).double() - truth).abs().max().item()
        per_t = [graph_time_ms(lambda t=t, fn=fn: fn(t)) for t in range(1, slots + 1)]
        row = {"bench": "decode_attention", "workload": name, "variant": label, "dtype": str(dtype),
               "max_err_vs_fp64": err, "aten_max_err_vs_fp64": ref_err, "ms_per_call": per_t,
               "ms_per_batch": sum(per_t) * layers}
        print(f"decode_attention {name:5s} {label:22s} per call (t=1..{slots}) "
              f"{' '.join(f'{x * 1e3:7.1f}' for x in per_t)} us   per batch {row['ms_per_batch']:7.3f} ms   "
              f"err {err:.2e} (aten {ref_err:.2e})", flush=True)
        results.append(row)
    return results


def bench_decode_attention(dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """The one-kernel decode attention (default tile "triton", then other tiles) against the ATen
    path of kernels='aten' (dense-mask prompt part + suffix part + LSE merge), per call at each
    suffix length t, and per batch: the sum over the decode steps (t = 1 .. new tokens - 1) times
    the layers. Baseline at b258f99 (one program per beam row): 5.5 ms per W2x8 batch. Then, from
    the q/k/v GEMM's output, qkv_rope + the attention against the one kernel the runtimes now run
    (decode_attention_qkv; their err column is the one against the other: 0 in 16 bits)."""
    return [row for name in DECODE_SHAPES for row in _decode_workload(name, dtype)]


# --- the decoder layer's element-wise kernels (kernels/norm_act.py, kernels/qkv_rope.py) ----------

HBM_TB_S = 4.8  # the H200's HBM3e peak: the floor of a kernel is its bytes / this
# workload: (model, hidden, heads, kv heads, head dim, intermediate, layers, rows, q/k norm, decode)
LAYER_SHAPES = {
    # 8 x 15 samples x 64 tokens
    "W1x8": (_model("W1"), 1024, 16, 8, 128, 3072, 28, 8 * sum(_score("W1")), True, False),
    # 8 x 100 beams, step t = 3
    "W2x8-decode": (_model("W2"), 896, 14, 2, 64, 4864, 24, 8 * _beam("W2")[1], False, True),
}
EPS = 1e-6


@triton.jit
def _old_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # kernels/norm_act.py as of c579ef9: one program per row, n_cols a runtime value
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _old_silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    # as of c579ef9: one row x 1024 columns per program
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * inter + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def _old_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps, E: tl.constexpr,
                          HAS_NORM: tl.constexpr):
    # as of c579ef9: one (token, head) row per program, one warp, on a contiguous q or k
    pid = tl.program_id(0).to(tl.int64)
    token = pid // heads
    half = tl.arange(0, E // 2)
    x1 = tl.load(x_ptr + pid * E + half)
    x2 = tl.load(x_ptr + pid * E + E // 2 + half)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / E + eps)
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + E // 2 + half).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        x2 = (w2 * (f2 * inv).to(x2.dtype).to(tl.float32)).to(x2.dtype)
    c1 = tl.load(cos_ptr + token * E + half).to(tl.float32)
    c2 = tl.load(cos_ptr + token * E + E // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + token * E + half).to(tl.float32)
    s2 = tl.load(sin_ptr + token * E + E // 2 + half).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(x1.dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(x1.dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(x1.dtype).to(tl.float32)
    tl.store(out_ptr + pid * E + half, (a1 + b1).to(x1.dtype))
    tl.store(out_ptr + pid * E + E // 2 + half, (a2 + b2).to(x1.dtype))


def _old_rms_norm(x, w, residual=None):
    d = x.shape[-1]
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    _old_rms_norm_kernel[(x.numel() // d,)](x, residual if residual is not None else x, w, out, total, d, EPS,
                                            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d),
                                            num_warps=4 if d <= 1024 else 8)
    return (out, total) if residual is not None else out


def _old_silu_mul(gu):
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
    _old_silu_mul_kernel[(n, triton.cdiv(inter, 1024))](gu, out, inter, BLOCK=1024)
    return out


def _old_norm_rope(x, cos, sin, w):
    n, heads, e = x.shape
    out = torch.empty_like(x)
    _old_norm_rope_kernel[(n * heads,)](x, w if w is not None else x, cos, sin, out, heads, EPS, E=e,
                                        HAS_NORM=w is not None, num_warps=1)
    return out


def layer_inputs(d: int, h: int, g: int, e: int, inter: int, rows: int, qk_norm: bool, decode: bool,
                 dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """One layer's element-wise inputs: x and the previous layer's pending MLP output, the GEMMs'
    outputs (qkv, o_proj, gate/up) as they come, weights, RoPE tables, positions, suffix slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape, s=1.0: s * torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)
    num_pos = 2048
    angles = torch.arange(num_pos, device="cuda")[:, None] * (1e4 ** (-torch.arange(0, e, 2, device="cuda") / e))
    inp = {"x": rnd(rows, d), "pending": rnd(rows, d, s=0.5), "qkv": rnd(rows, (h + 2 * g) * e, s=2.0),
           "o": rnd(rows, d, s=0.5), "gu": rnd(rows, 2 * inter, s=2.0), "attn_norm": 1 + rnd(d, s=0.1),
           "mlp_norm": 1 + rnd(d, s=0.1), "q_norm": 1 + rnd(e, s=0.1) if qk_norm else None,
           "k_norm": 1 + rnd(e, s=0.1) if qk_norm else None,
           "cos": torch.cat([angles, angles], -1).cos(), "sin": torch.cat([angles, angles], -1).sin()}
    inp = {k: v.to(dtype) if v is not None else None for k, v in inp.items()}
    inp["positions"] = torch.randint(0, num_pos - 8, (rows,), generator=gen, device="cuda")
    inp.update(h=h, g=g, e=e, step=3 if decode else 0)
    if decode:  # suffix_k/v [rows, slots, G, E]: step t writes slot t - 1
        inp["suffix_k"], inp["suffix_v"] = (torch.zeros(rows, 4, g, e, device="cuda", dtype=dtype) for _ in range(2))
    return inp


def _qkv_parts(inp):
    n, h, g, e = inp["qkv"].shape[0], inp["h"], inp["g"], inp["e"]
    q, k, v = inp["qkv"].split([h * e, g * e, g * e], dim=-1)
    return q.reshape(n, h, e), k.reshape(n, g, e), v.reshape(n, g, e)


def _rope_rows(inp):
    t = inp["step"]
    rows = inp["positions"] + (t - 1) if t else inp["positions"]
    return inp["cos"].index_select(0, rows), inp["sin"].index_select(0, rows)


def layer_aten(inp) -> dict[str, torch.Tensor]:
    """kernels='aten' around the GEMMs and the attention (service.model.layers' torch ops)."""
    from service.model.layers import apply_rope, rms_norm

    x = inp["x"] + inp["pending"]  # the previous layer's last residual add
    h = rms_norm(x, inp["attn_norm"], EPS)
    q, k, v = _qkv_parts(inp)
    if inp["q_norm"] is not None:
        q, k = rms_norm(q, inp["q_norm"], EPS), rms_norm(k, inp["k_norm"], EPS)
    cos, sin = _rope_rows(inp)
    q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()
    if inp["step"]:
        inp["suffix_k"][:, inp["step"] - 1] = k
        inp["suffix_v"][:, inp["step"] - 1] = v
    y = x + inp["o"]
    h2 = rms_norm(y, inp["mlp_norm"], EPS)
    gate, up = inp["gu"].chunk(2, dim=-1)
    return {"h": h, "q": q, "k": k, "v": v, "y": y, "h2": h2, "act": F.silu(gate) * up}


def layer_triton_before(inp) -> dict[str, torch.Tensor]:
    """kernels='triton' as of c579ef9: RMSNorm kernel, contiguous q/k copies, gathered cos/sin,
    norm_rope per tensor, v copy, residual add + norm kernel, SiLU*up kernel, the final add in ATen."""
    x = inp["x"] + inp["pending"]
    h = _old_rms_norm(x, inp["attn_norm"])
    q, k, v = _qkv_parts(inp)
    cos, sin = _rope_rows(inp)
    q = _old_norm_rope(q.contiguous(), cos, sin, inp["q_norm"])
    k = _old_norm_rope(k.contiguous(), cos, sin, inp["k_norm"])
    v = v.contiguous()
    if inp["step"]:
        inp["suffix_k"][:, inp["step"] - 1] = k
        inp["suffix_v"][:, inp["step"] - 1] = v
    h2, y = _old_rms_norm(inp["o"], inp["mlp_norm"], residual=x)
    return {"h": h, "q": q, "k": k, "v": v, "y": y, "h2": h2, "act": _old_silu_mul(inp["gu"])}


def layer_triton(inp) -> dict[str, torch.Tensor]:
    """kernels='triton' (a Score's, a prefill's; a decode step's before 2c7509d, when its RoPE moved
    into the attention): pending add + norm, qkv_rope (k/v into the suffix slot when decoding),
    residual add + norm, SiLU*up: four launches."""
    from kernels.norm_act import rms_norm, silu_mul

    h, x = rms_norm(inp["pending"], inp["attn_norm"], EPS, residual=inp["x"])
    t = inp["step"]
    slots = {"k_out": inp["suffix_k"][:, t - 1], "v_out": inp["suffix_v"][:, t - 1]} if t else {}
    q, k, v = qkv_rope(inp["qkv"], inp["positions"], inp["cos"], inp["sin"], inp["h"], inp["g"], inp["q_norm"],
                       inp["k_norm"], EPS, max(t - 1, 0), **slots)
    h2, y = rms_norm(inp["o"], inp["mlp_norm"], EPS, residual=x)
    return {"h": h, "q": q, "k": k, "v": v, "y": y, "h2": h2, "act": silu_mul(inp["gu"])}


def _layer_kernels(inp) -> dict[str, tuple[Callable[[], Any], int]]:
    """Each new kernel alone with the bytes it must move (its floor)."""
    from kernels.norm_act import rms_norm, silu_mul
    from kernels.qkv_rope import qkv_rope

    s = inp["x"].element_size()
    n, d = inp["x"].shape
    inter = inp["gu"].shape[1] // 2
    h, g, e, t = inp["h"], inp["g"], inp["e"], inp["step"]
    slots = {"k_out": inp["suffix_k"][:, t - 1], "v_out": inp["suffix_v"][:, t - 1]} if t else {}
    qkv_bytes = 2 * n * (h + 2 * g) * e * s + 2 * n * e * s + 8 * n  # read + write; cos/sin rows; positions
    return {
        "rms_norm+pending": (lambda: rms_norm(inp["pending"], inp["attn_norm"], EPS, residual=inp["x"]), 4 * n * d * s),
        "qkv_rope": (lambda: qkv_rope(inp["qkv"], inp["positions"], inp["cos"], inp["sin"], h, g, inp["q_norm"],
                                      inp["k_norm"], EPS, max(t - 1, 0), **slots), qkv_bytes),
        "silu_mul": (lambda: silu_mul(inp["gu"]), 3 * n * inter * s),
    }


def _check_layer(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> float:
    """Largest error relative to each output's magnitude; refuses a variant that is not the layer."""
    worst = 0.0
    for name, ref in want.items():
        err = (got[name].float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)
        if err > 2 ** -5:  # a few bf16 roundings; a mis-wired kernel is off by O(1)
            raise AssertionError(f"layer {label}: {name} is off the ATen path by {err:.3e} of its scale")
        worst = max(worst, err)
    return worst


def _layer_workload(name: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    model, d, h, g, e, inter, layers, rows, qk_norm, decode = LAYER_SHAPES[name]
    inp = layer_inputs(d, h, g, e, inter, rows, qk_norm, decode, dtype)
    want = layer_aten(inp)
    launches = {"aten": None, "triton_before": 11 + 3 * decode, "triton": 4}  # element-wise launches a layer
    results = []
    for label, fn in (("aten", layer_aten), ("triton_before", layer_triton_before), ("triton", layer_triton)):
        err = _check_layer(fn(inp), want, label)
        ms = graph_time_ms(lambda fn=fn: fn(inp))
        row = {"bench": "layer_kernels", "workload": name, "model": model, "variant": label, "dtype": str(dtype),
               "rows": rows, "launches_per_layer": launches[label], "ms_per_layer": ms, "ms_per_batch": ms * layers,
               "max_rel_err_vs_aten": err}
        print(f"layer_kernels {name:11s} {label:14s} {ms * 1e3:8.1f} us/layer  {ms * layers:7.3f} ms/batch "
              f"({layers} layers)  launches/layer {launches[label] or '-'}  err {err:.1e}", flush=True)
        results.append(row)
    for kernel, (fn, nbytes) in _layer_kernels(inp).items():
        ms = graph_time_ms(fn)
        floor_ms = nbytes / (HBM_TB_S * 1e12) * 1e3
        row = {"bench": "layer_kernels", "workload": name, "model": model, "variant": f"kernel:{kernel}",
               "dtype": str(dtype), "rows": rows, "bytes": nbytes, "ms": ms, "floor_ms": floor_ms,
               "of_floor": floor_ms / ms, "ms_per_batch": ms * layers}
        print(f"layer_kernels {name:11s} {kernel:16s} {ms * 1e3:8.1f} us  {nbytes / 1e6:7.1f} MB  floor "
              f"{floor_ms * 1e3:6.1f} us ({floor_ms / ms:5.1%} of it)  {ms * layers:7.3f} ms/batch", flush=True)
        results.append(row)
    return results


def bench_layer_kernels(dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """A decoder layer's work around its GEMMs and attention, three ways, checked against the ATen
    path first: "aten" (kernels='aten'), "triton_before" (the Triton path as of c579ef9: 11 element-
    wise launches a layer, 14 in a decode step) and "triton" (now: 4), per layer and per batch (x
    layers); then each new kernel alone against its bandwidth floor (bytes / 4.8 TB/s). W1x8: 7,680
    tokens of qwen3-0.6b (Score); W2x8-decode: 800 beam rows of qwen2.5-0.5b, a decode step.
    Baseline at b258f99, W1x8 profile: norm_rope 3.4 ms, silu_mul 1.2 ms, 144 other element-wise
    launches 4.5 ms per batch."""
    return [row for name in LAYER_SHAPES for row in _layer_workload(name, dtype)]


# --- the beam step (kernels/beam_topk.py; service/runtime/nodes.py beam_init / beam_step) ---------

# workload: (model, layers, kv heads, head dim, requests, beams, new tokens); vocabulary 151,936
BEAM_SHAPES = {
    "W2x1": (_model("W2"), 24, 2, 64, 1, *_beam("W2")[1:]),
    "W2x2": (_model("W2"), 24, 2, 64, 2, *_beam("W2")[1:]),
    "W2x8": (_model("W2"), 24, 2, 64, 8, *_beam("W2")[1:]),
    "W3x4": (_model("W3"), 24, 2, 64, 4, *_beam("W3")[1:]),
    "W5x1": (_model("W5"), 28, 8, 128, 1, *_beam("W5")[1:]),
    "W5x2": (_model("W5"), 28, 8, 128, 2, *_beam("W5")[1:]),
    "W5x4": (_model("W5"), 28, 8, 128, 4, *_beam("W5")[1:]),
    "W6x1": (_model("W6"), 28, 8, 128, 1, *_beam("W6")[1:]),
}
VOCAB = 151936


def _beam_env(layers: int, g: int, e: int, r: int, b: int, n: int, fused: bool, seed: int = 0) -> dict[str, Any]:
    """A decode step's beam_step inputs as the runtimes lay them out: logits [rows, V] of the packed
    beam rows as the LM head gives them (bf16 for the fused path, float32 for ATen), beam scores
    with (from two requests on) a request narrower than the bucket (dead beams), beam_slot /
    beam_src as pack_beam makes them, the suffix K/V (one buffer + views when fused)."""
    from service.artifact.buckets import BeamBucket
    from service.runtime.batch import pack_beam
    from kernels.decode_attention import own_suffix_rows
    from service.runtime.nodes import set_beam_suffix
    from service.runtime.requests import BeamRequest

    gen = torch.Generator(device="cuda").manual_seed(seed)
    widths = [b] * (r - 1) + [max(1, b // 2) if r > 1 else b]  # one request alone fills its bucket
    rows = sum(widths)
    packed = pack_beam([BeamRequest((0,), w, n) for w in widths], BeamBucket(n, r, r, b, rows)).inputs
    logits = 4 * torch.randn(rows, VOCAB, generator=gen, device="cuda")
    scores = -3 * torch.rand(r, b, generator=gen, device="cuda").sort(-1, descending=True).values
    if r > 1:
        scores[-1, b // 2:] = float("-inf")
    env = {"logits": logits.to(torch.bfloat16) if fused else logits, "beam_scores": scores,
           "beam_width": torch.tensor(widths, device="cuda"),
           "beam_seqs": torch.randint(0, VOCAB, (r, b, n), generator=gen, device="cuda"),
           "beam_slot": packed["beam_slot"].cuda(), "beam_src": packed["beam_src"].cuda()}
    kv = torch.randn(layers, 2, rows, max(n - 1, 1), g, e, generator=gen, device="cuda").to(torch.bfloat16)
    if fused:
        set_beam_suffix(env, kv)
        env["suffix_rows"] = own_suffix_rows(rows, kv.shape[3], "cuda")
    else:
        env.update({f"suffix_{'kv'[j]}.{i}": kv[i, j].clone() for i in range(layers) for j in range(2)})
    return env


def _beam_workload(name: str, paths: Sequence[str] = ("aten", "fused")) -> list[dict[str, Any]]:
    from kernels import beam_topk
    from service.artifact.dag import Node
    from service.runtime.fused import JitKernels
    from service.runtime.nodes import NodeContext, beam_init, beam_step

    model, layers, g, e, r, b, n = BEAM_SHAPES[name]
    suffix = ("suffix_kv", "suffix_rows") + tuple(f"suffix_{kv}.{i}" for i in range(layers) for kv in "kv")  # as the DAG
    outs = ("beam_tokens", "beam_scores", "beam_seqs", "beam_parents")
    ins = ("logits", "beam_scores", "beam_seqs", "beam_width", "beam_slot", "beam_src")
    ctx = {"aten": NodeContext(None, {}, [], torch.empty(0), torch.empty(0), None),  # type: ignore[arg-type]
           "fused": NodeContext(None, {}, [], torch.empty(0), torch.empty(0), JitKernels())}  # type: ignore[arg-type]
    # the fused layout always (its parts are timed below); the ATen one only when its path runs
    envs = {label: _beam_env(layers, g, e, r, b, n, label == "fused") for label in ctx if label in (*paths, "fused")}
    # check first: the fused selection's beams equal the reference's (its scores within float32 rounding),
    # on R x B rows of logits (the kernels' own layout: every request B wide)
    full = (4 * torch.randn(r * b, VOCAB, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
            ).to(torch.bfloat16)
    got = beam_topk.beam_topk(full, envs["fused"]["beam_scores"], b)
    want = beam_topk.beam_topk_ref(full, envs["fused"]["beam_scores"], b)
    fin = want[0].isfinite()
    err = (got[0][fin] - want[0][fin]).abs().max().item()
    same = ((got[1] == want[1]) & (got[2] == want[2])).float().mean().item()
    if err > 1e-4 or same < 0.99:
        raise AssertionError(f"beam_topk {name}: scores off by {err:.2e}, {same:.1%} of (parent, token) equal")
    results = []
    one_read = envs["fused"]["logits"].numel() * 2  # the bf16 logits, once: the floor of the selection
    for label in paths:
        env = envs[label]
        per_step = []
        for t in range(1, n):
            node = Node(f"step{t}.beam_step", "beam_step", ins + suffix, outs + suffix, {"step": t})
            per_step.append(graph_time_ms(lambda node=node: beam_step(ctx[label], node, dict(env))))
        init_env = {"logits": env["logits"][:r].contiguous(), "beam_width": env["beam_width"],
                    "beam_seqs": torch.zeros(r, b, n, dtype=torch.int64, device="cuda"), "beam_slot": env["beam_slot"]}
        init = graph_time_ms(lambda: beam_init(ctx[label], Node("beam_init", "beam_init",
                                                                 ("logits", "beam_width", "beam_seqs", "beam_slot"),
                                                                 outs),
                                               dict(init_env)))
        row = {"bench": "beam_step", "workload": name, "model": model, "variant": label,
               "rows": env["logits"].shape[0],
               "ms_beam_init": init, "ms_per_step": per_step, "ms_per_batch": init + sum(per_step),
               "floor_ms_per_step": one_read / (HBM_TB_S * 1e12) * 1e3, "max_score_err": err, "same_beams": same}
        print(f"beam_step {name:5s} {label:6s} init {init * 1e3:7.1f} us  steps (t=1..{n - 1}) "
              f"{' '.join(f'{x * 1e3:7.1f}' for x in per_step)} us  per batch {row['ms_per_batch']:7.3f} ms  "
              f"(floor {row['floor_ms_per_step'] * 1e3:.1f} us a step)", flush=True)
        results.append(row)
    # the fused step's parts: the selection kernels (two passes over the logits), the merge, the reorder
    env = envs["fused"]
    flat = env["beam_scores"].reshape(-1).contiguous()
    slot, src = env["beam_slot"], env["beam_src"]  # the packed rows (the last request half as wide)

    def candidates(logits: torch.Tensor = env["logits"]) -> torch.Tensor:
        return beam_topk.beam_candidates(logits, flat, b, b, None, slot, src)

    rows = env["logits"].shape[0]
    parts = {"candidates": (candidates, 2 * one_read),
             "candidates+merge": (lambda: beam_topk.merge_candidates(candidates(), r, b, VOCAB), 2 * one_read),
             # the copy of every layer's suffix K/V a step made before suffix_rows (2026-12-06): for comparison
             "suffix_gather (replaced)": (lambda: env["suffix_kv"].index_select(2, torch.arange(rows, device="cuda")),
                                          2 * env["suffix_kv"].numel() * 2)}
    keys = candidates()
    # each launch of the selection alone: the select first, while the collect's counters are those of one
    # pass (replaying the collect alone keeps adding to them)
    _, launches = beam_topk.candidate_launches(env["logits"], flat, b, b, None, slot, src)
    for _, launch in launches:
        launch()
    launch_bytes = {"stats": one_read, "threshold": 0, "collect": one_read, "select": 0}
    for kernel, launch in launches[-1:] + launches[:-1]:
        parts[f"kernel:{kernel}"] = (launch, launch_bytes[kernel])
    for parts_a_row in (8, 16):  # the streaming kernels' programs a row (the default: beam_topk.NUM_PARTS)
        parts[f"candidates@{parts_a_row}"] = (lambda n=parts_a_row: _with_parts(n, candidates), 2 * one_read)
    # the merge alone: torch's top-k (the merge before edbbe74; merge_candidates now runs beam_merge's
    # rounds, timed above with the candidates and by --only beam_merge) against a full sort of the unique keys
    # and a top-k in two stages (the B best of each of C slices of a request's parent rows at once,
    # then of those C x B), on these keys and on those of near-uniform logits (a random checkpoint's:
    # close scores share their high bits, which a radix select pays for)
    flat_logits = (env["logits"].float() * 0.01).to(env["logits"].dtype)
    close = candidates(flat_logits)
    chunks = max(c for c in (1, 2, 4, 8, 16) if b % c == 0)
    for label, k in (("", keys), (":near-uniform", close)):
        parts[f"merge:topk{label}"] = (lambda k=k: k.view(r, -1).topk(b, dim=-1).values, k.numel() * 8)
        parts[f"merge:sort{label}"] = (lambda k=k: k.view(r, -1).sort(dim=-1, descending=True).values[:, :b],
                                       k.numel() * 8)
        parts[f"merge:chunked{chunks}{label}"] = (
            lambda k=k: k.view(r * chunks, -1).topk(b, dim=-1, sorted=False).values.view(r, -1).topk(b, dim=-1).values,
            k.numel() * 8)
        want = parts[f"merge:topk{label}"][0]()
        for other in (f"merge:sort{label}", f"merge:chunked{chunks}{label}"):
            if not torch.equal(want, parts[other][0]()):
                raise AssertionError(f"beam_step {name}: {other} disagrees with top-k on unique keys")
    for part, (fn, nbytes) in parts.items():
        ms = graph_time_ms(fn)
        row = {"bench": "beam_step", "workload": name, "variant": f"fused:{part}", "ms": ms, "bytes": nbytes,
               "gb_s": nbytes / ms / 1e6, "of_peak": nbytes / ms / 1e9 / HBM_TB_S}
        print(f"beam_step {name:5s} fused:{part:16s} {ms * 1e3:7.1f} us  {nbytes / 1e6:7.1f} MB moved  "
              f"{row['gb_s']:7.0f} GB/s ({row['of_peak']:5.1%} of {HBM_TB_S} TB/s)", flush=True)
        results.append(row)
    cast = graph_time_ms(lambda: envs["fused"]["logits"].float())
    print(f"beam_step {name:5s} aten:lm_head_cast {cast * 1e3:7.1f} us (the float32 copy the fused path drops)",
          flush=True)
    results.append({"bench": "beam_step", "workload": name, "variant": "aten:lm_head_cast", "ms": cast})
    return results


def _with_parts(num_parts: int, fn: Callable[[], Any]) -> Any:
    """fn() with beam_topk's streaming kernels at num_parts programs a row (JIT launches only)."""
    from kernels import beam_topk

    default, beam_topk.NUM_PARTS = beam_topk.NUM_PARTS, num_parts
    try:
        return fn()
    finally:
        beam_topk.NUM_PARTS = default


def bench_beam_step(shapes: Sequence[str] = tuple(BEAM_SHAPES), paths: Sequence[str] = ("aten", "fused")
                    ) -> list[dict[str, Any]]:
    """The beam bookkeeping of a BeamSearch batch, ATen (float32 log-softmax over [rows, V], top-k
    over B x V per request, every layer's suffix K/V index_select'ed) against the fused path
    (kernels/beam_topk.py on the bf16 logits, top-B of B x B keys, the bookkeeping kernel handing on
    each row's suffix_rows: no copy of the suffix K/V since 2026-12-06, whose old gather is timed
    among the parts for comparison), through the nodes themselves (service/runtime/nodes.py), per step
    and per batch (beam_init + the decode steps); then the fused parts against 4.8 TB/s.
    Baseline at b258f99, W2x8: beam_step 12.1 ms a batch."""
    return [row for name in shapes for row in _beam_workload(name, paths)]


# --- Score / BeamSearch-prefill attention: by request block (SDPA + bias) vs by sample (varlen) ---

# workload: (heads, kv heads, head dim, layers, block tokens, requests a block, [prefix, sample lengths...] a request)
# Score: one block per request (prefix, then its samples, then padding); BeamSearch prefill: one
# block for the whole batch (the prompts packed, then padding), a prompt being one "sample".
PREFILL_SHAPES = {
    "W1x8": (16, 8, 128, 28, 1024, 1, _score("W1"), 8),
    "W4x8": (16, 8, 128, 28, 768, 1, _score("W4"), 8),
    "W2x8-prefill": (14, 2, 64, 24, 1024, 8, [0, _beam("W2")[0]], 1),
    "W3x4-prefill": (14, 2, 64, 24, 2048, 4, [0, _beam("W3")[0]], 1),
    "W5x1-prefill": (16, 8, 128, 28, 512, 1, [0, _beam("W5")[0]], 1),
    "W5x2-prefill": (16, 8, 128, 28, 1024, 2, [0, _beam("W5")[0]], 1),
}


# the fused kernel's tiles: the default (what kernels/aot.py compiles) first, then candidates
SEGMENT_TILES = [None, Tile(64, 64, 4, 3), Tile(64, 32, 4, 2), Tile(64, 32, 4, 4), Tile(64, 16, 4, 3), Tile(128, 64, 8, 3)]


def prefill_layout(block: int, per_block: int, lengths: list[int], blocks: int):
    """Host-side layout of one bucket: runs [(start, length, kind)] with kind 'prefix', 'sample' or
    'pad' (a block's tail), and prefix_of[t]: the start/length of the prefix a sample token sees."""
    runs, prefix_of = [], {}
    for r in range(blocks):
        t = r * block
        for _ in range(per_block):
            prefix, samples = lengths[0], lengths[1:]
            p0 = t
            if prefix:
                runs.append((t, prefix, "prefix"))
                t += prefix
            for s in samples:
                runs.append((t, s, "sample"))
                prefix_of.update({i: (p0, prefix) for i in range(t, t + s)} if prefix else {})
                t += s
        if t < (r + 1) * block:
            runs.append((t, (r + 1) * block - t, "pad"))
        if t > (r + 1) * block:
            raise ValueError(f"{lengths} x {per_block} does not fit a block of {block}")
    return runs, prefix_of


def _visible(block: int, blocks: int, runs, prefix_of, device: str) -> torch.Tensor:
    """[blocks, block, block] bool: causal within a run (padding too: a row sees at least itself),
    plus a sample token's request prefix."""
    vis = torch.zeros(blocks, block, block, dtype=torch.bool)
    for start, length, _ in runs:
        r, i = divmod(start, block)
        vis[r, i:i + length, i:i + length] = torch.ones(length, length, dtype=torch.bool).tril()
    for t, (p0, plen) in prefix_of.items():
        r, i = divmod(t, block)
        vis[r, i, p0 - r * block:p0 - r * block + plen] = True
    return vis.to(device)


def _lse_rows(lse: torch.Tensor, t: int, h: int) -> torch.Tensor:
    """The op's log-sum-exp as [T, H] (FlashAttention's varlen layout is [H, T]; checked, not assumed)."""
    if lse.shape == (h, t):
        return lse.t()
    if lse.shape == (t, h):
        return lse
    raise RuntimeError(f"_flash_attention_forward returned lse {list(lse.shape)}, expected [{h}, {t}] or [{t}, {h}]")


def _prefill_workload(name: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    h, g, e, layers, block, per_block, lengths, blocks = PREFILL_SHAPES[name]
    runs, prefix_of = prefill_layout(block, per_block, lengths, blocks)
    t = block * blocks
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, n, e, generator=gen, device="cuda", dtype=dtype) for n in (h, g, g))
    scale = e ** -0.5
    vis = _visible(block, blocks, runs, prefix_of, "cuda")
    real = torch.zeros(t, dtype=torch.bool, device="cuda")
    for start, length, kind in runs:
        real[start:start + length] = kind != "pad"

    def dense(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:  # the CPU path's reference
        return torch.cat([masked_attention_ref(qq[r * block:(r + 1) * block], kk[r * block:(r + 1) * block],
                                               vv[r * block:(r + 1) * block], vis[r], scale)[0]
                          for r in range(blocks)])

    # before: SDPA over each block with an additive bias (kernels/attention.py at b258f99)
    bias = torch.zeros(vis.shape, dtype=dtype, device="cuda").masked_fill(~vis, float("-inf")).unsqueeze(1)

    def by_block() -> torch.Tensor:
        q4 = q.view(blocks, block, h, e).transpose(1, 2)
        k4, v4 = (x.repeat_interleave(h // g, dim=1).view(blocks, block, h, e).transpose(1, 2) for x in (k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale)
        return out.transpose(1, 2).reshape(t, h, e)

    # after: varlen flash attention, causal within each run; every block also against its first prefix_len keys
    # (a second, non-causal call; zero keys without a prefix), merged by one lerp on the LSE difference
    cu_self = torch.tensor([s for s, _, _ in runs] + [t], dtype=torch.int32, device="cuda")
    cu_blocks = torch.arange(0, t + 1, block, dtype=torch.int32, device="cuda")
    prefix_len = torch.full((blocks,), lengths[0] if per_block == 1 else 0, dtype=torch.int32, device="cuda")
    has_ctx = torch.zeros(t, 1, dtype=torch.bool, device="cuda")
    for i in prefix_of:
        has_ctx[i] = True

    env = {"cu_self": cu_self, "cu_blocks": cu_blocks, "prefix_len": prefix_len, "has_ctx": has_ctx}

    def by_sample() -> torch.Tensor:  # what the runtimes run (service/runtime/nodes.py), prefix call included
        return varlen_layer_attention(q, k, v, env, "score", scale, block)

    # the fused path: one Triton kernel, each row's prefix and own-segment key ranges (kernels/segment_attention.py),
    # built here from the layout (the masks node computes them on the device: segment_key_ranges)
    ranges = [[0] * t, [0] * t, [0] * t]
    for start, length, kind in runs:
        for i in range(start, start + length):
            ranges[2][i] = start if kind != "pad" else i + 1
            if i in prefix_of:
                ranges[0][i], ranges[1][i] = prefix_of[i][0], prefix_of[i][0] + prefix_of[i][1]
    ranges = torch.tensor(ranges, dtype=torch.int32, device="cuda")

    def segment(tile: Tile | None) -> Callable[[], torch.Tensor]:
        return lambda: segment_attention(q, k, v, ranges, scale, tile=tile)

    lse_shape = list(torch.ops.aten._flash_attention_forward(q, k, v, cu_self, cu_self, block, block, 0.0, True,
                                                             False, scale=scale)[1].shape)
    truth = dense(q.double(), k.double(), v.double())
    ref_err = (dense(q, k, v).double() - truth)[real].abs().max().item()
    useful = sum(s * (s + 1) / 2 + (prefix_of[st][1] * s if st in prefix_of else 0) for st, s, kind in runs
                 if kind != "pad") * 4 * h * e  # FLOPs: causal within a sample + its prefix
    # the floor of one layer's attention: q, k, v of the real rows read once, out written once, at 4.8 TB/s
    n_real = int(real.sum())
    nbytes = (n_real * (h + 2 * g) * e + t * h * e) * q.element_size()
    floor_ms = nbytes / (HBM_TB_S * 1e12) * 1e3
    variants = [("by_block_sdpa_bias", by_block), ("by_sample_varlen", by_sample)]
    variants += [("segment_triton" if tile is None else f"segment_m{tile.block_m}n{tile.block_n}w{tile.num_warps}"
                  f"s{tile.num_stages}", segment(tile)) for tile in SEGMENT_TILES]
    results = []
    for label, fn in variants:
        err = (fn().double() - truth)[real].abs().max().item()
        ms = graph_time_ms(fn)
        row = {"bench": "prefill_attention", "workload": name, "variant": label, "dtype": str(dtype),
               "max_err_vs_fp64": err, "dense_ref_max_err_vs_fp64": ref_err, "ms_per_layer": ms,
               "ms_per_batch": ms * layers, "useful_tflops": useful / ms / 1e9, "flash_lse_shape": lse_shape,
               "bytes": nbytes, "floor_ms": floor_ms, "of_floor": floor_ms / ms}
        print(f"prefill_attention {name:13s} {label:21s} {ms * 1e3:8.1f} us a layer  {ms * layers:7.3f} ms a batch  "
              f"{row['useful_tflops']:6.1f} useful TFLOP/s  floor {floor_ms * 1e3:6.1f} us ({floor_ms / ms:5.1%} of "
              f"it)  err {err:.2e} (dense ref {ref_err:.2e})", flush=True)
        results.append(row)
    return results


def bench_prefill_attention(dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Score and BeamSearch-prefill attention, one layer: by request block (torch SDPA over each
    block with an additive bias, as at b258f99) vs by sample (ATen's varlen FlashAttention:
    causal within each sample; a shared prefix through a second call merged by log-sum-exp, what
    the ATen path runs) vs the fused path's one Triton kernel (kernels/segment_attention.py, its
    default tile and candidates), each checked against the dense-mask reference in float64 on the
    real rows; the floor is q, k, v of the real rows read and out written once at 4.8 TB/s."""
    return [row for name in PREFILL_SHAPES for row in _prefill_workload(name, dtype)]

# --- a decode step's GEMMs (kernels/gemm.py) against cuBLAS ---------------------------------------

# model: (hidden, heads, kv heads, head dim, intermediate, layers)
GEMM_MODELS = {"qwen2.5-0.5b": (896, 14, 2, 64, 4864, 24), "qwen3-0.6b": (1024, 16, 8, 128, 3072, 28)}
GEMM_ROWS = (100, 200, 400, 800, 1600)  # beam rows: one W2 request .. 16 of them / four W5 ones
GEMM_PEAK_TFLOPS = 700  # the bf16 dense GEMM ceiling measured at large shapes (BENCHMARKS.md)


def gemm_configs(kind: str) -> list[Any]:
    """The tiles tried for one GEMM of the layer (invalid ones for a shape are skipped)."""
    from kernels.gemm import GemmConfig as C

    base = [C(16, 64, 128), C(32, 64, 128), C(64, 64, 64), C(64, 32, 128), C(64, 128, 64, num_stages=3),
            C(128, 64, 64), C(128, 128, 64, num_warps=8, num_stages=3), C(64, 64, 128, num_stages=3)]
    if kind in ("o", "down"):  # the residual's partials: split-K
        base += [C(b.block_m, b.block_n, b.block_k, s, b.num_warps, b.num_stages)
                 for b in (C(32, 64, 128), C(64, 64, 64), C(128, 64, 64), C(64, 128, 64, num_stages=3))
                 for s in (2, 4, 8)]
    return base


def _gemm_shapes(model: str) -> dict[str, tuple[int, int, bool, bool]]:
    """kind: (N of the output, K, bias, SiLU epilogue) of one decoder layer."""
    d, h, g, e, inter, _ = GEMM_MODELS[model]
    return {"qkv": ((h + 2 * g) * e, d, model.startswith("qwen2"), False), "o": (d, h * e, False, False),
            "gate_up": (inter, d, False, True), "down": (d, inter, False, False)}


def _warm_gemms(jobs: list[tuple[int, int, bool, bool, Any]]) -> None:
    """Compiles every (shape, config) once per worker process into Triton's disk cache, 8 at a time,
    so the timing process finds them compiled."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=8, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_warm_gemm_job, [jobs[i::8] for i in range(8)]))


def _warm_gemm_job(jobs: list[tuple[int, int, bool, bool, Any]]) -> None:
    from kernels.gemm import linear

    for n, k, bias, silu, cfg in jobs:
        a = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((2 if silu else 1) * n, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias and cfg.split_k == 1 else None
        try:
            linear(a, w, b, cfg, silu=silu)
        except ValueError:
            pass


def _gemm_floor_ms(m: int, n: int, k: int) -> float:
    nbytes = 2 * (n * k + m * k + m * n)
    return max(nbytes / (HBM_TB_S * 1e12), 2 * m * n * k / (GEMM_PEAK_TFLOPS * 1e12)) * 1e3


def bench_gemm() -> list[dict[str, Any]]:
    """A decode step's four GEMMs per layer at M = 100..1,600 beam rows, for both embedded models:
    cuBLAS (F.linear; gate/up then the SiLU*up kernel) against kernels/gemm.py in every tile of
    gemm_configs (split-K ones write float32 partials that the next RMSNorm sums: their time here
    is the GEMM's alone, the chain below has the norm). Each is checked against float64 first. Then
    the layer's chain without attention and q/k/v RoPE, both ways, with each GEMM's best tile:
    cuBLAS: norm+residual, qkv, o, norm+residual, gate/up, SiLU*up, down (7 launches);
    Triton: norm+parts, qkv, o (partials), norm+parts, gate/up+SiLU, down (partials) (6 launches)."""
    from kernels.gemm import linear
    from kernels.norm_act import silu_mul

    jobs = [(n, k, bias, silu, cfg) for model in GEMM_MODELS for kind, (n, k, bias, silu) in _gemm_shapes(model).items()
            for cfg in gemm_configs(kind)]
    t0 = time.monotonic()
    _warm_gemms(jobs)
    print(f"gemm: {len(jobs)} variants compiled in {time.monotonic() - t0:.1f} s", flush=True)
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, (d, h, g, e, inter, layers) in GEMM_MODELS.items():
        shapes = _gemm_shapes(model)
        weights = {kind: torch.randn((2 if silu else 1) * n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                   / k ** 0.5 for kind, (n, k, _, silu) in shapes.items()}
        bias = torch.randn(shapes["qkv"][0], generator=gen, device="cuda", dtype=torch.bfloat16)
        norm_w = 1 + 0.1 * torch.randn(d, generator=gen, device="cuda", dtype=torch.bfloat16)
        for m in GEMM_ROWS:
            best: dict[str, tuple[float, Any]] = {}
            for kind, (n, k, has_bias, silu) in shapes.items():
                a = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                w, b = weights[kind], bias if has_bias else None
                truth = F.linear(a.double(), w.double(), b.double() if b is not None else None)
                if silu:
                    gate, up = truth.chunk(2, dim=-1)
                    truth = F.silu(gate) * up
                    cublas = lambda a=a, w=w: silu_mul(F.linear(a, w))
                else:
                    cublas = lambda a=a, w=w, b=b: F.linear(a, w, b)
                floor = _gemm_floor_ms(m, (2 if silu else 1) * n, k)
                base_ms = graph_time_ms(cublas)
                base_err = _rel_err(cublas(), truth)
                row = {"bench": "gemm", "model": model, "kind": kind, "rows": m, "n": n, "k": k, "variant": "cublas",
                       "ms": base_ms, "floor_ms": floor, "rel_err": base_err}
                results.append(row)
                tried = []
                for cfg in gemm_configs(kind):
                    try:
                        fn = (lambda a=a, w=w, b=b, cfg=cfg: linear(a, w, b if cfg.split_k == 1 else None, cfg,
                                                                    silu=silu))
                        out = fn()
                    except ValueError:
                        continue
                    got = out if cfg.split_k == 1 else (out.sum(0) + (b.float() if b is not None else 0))
                    err = _rel_err(got, truth)
                    if err > max(2 ** -5, 2 * base_err):  # a few bf16 roundings; mis-wired is O(1)
                        raise AssertionError(f"gemm {model} {kind} M={m} {cfg}: off float64 by {err:.3e}")
                    ms = graph_time_ms(fn)
                    tried.append((ms, cfg))
                    results.append({**row, "variant": "triton", "config": vars(cfg), "ms": ms, "rel_err": err})
                ms, cfg = min(tried, key=lambda t: t[0])
                best[kind] = (ms, cfg)
                print(f"gemm {model:13s} M={m:5d} {kind:8s} N={n:6d} K={k:5d}  cublas {base_ms * 1e3:7.1f} us  "
                      f"best triton {ms * 1e3:7.1f} us ({base_ms / ms:4.2f}x) {_cfg_str(cfg)}  floor "
                      f"{floor * 1e3:6.1f} us", flush=True)
            results.append(_gemm_chain(model, m, shapes, weights, bias, norm_w, best, layers))
    return results


def _cfg_str(cfg: Any) -> str:
    return f"m{cfg.block_m}n{cfg.block_n}k{cfg.block_k}s{cfg.split_k}w{cfg.num_warps}p{cfg.num_stages}"


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _gemm_chain(model: str, m: int, shapes: dict[str, Any], weights: dict[str, torch.Tensor], bias: torch.Tensor,
                norm_w: torch.Tensor, best: dict[str, tuple[float, Any]], layers: int) -> dict[str, Any]:
    """One layer's GEMMs and norms both ways (module docstring of bench_gemm), per layer and per
    decode step (x layers)."""
    from kernels.gemm import linear
    from kernels.norm_act import rms_norm, rms_norm_parts, silu_mul

    d = norm_w.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(m, shapes["o"][1], generator=gen, device="cuda", dtype=torch.bfloat16)
    pending = torch.randn(m, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    cfg = {kind: c for kind, (_, c) in best.items()}

    def cublas():
        hh, xx = rms_norm(pending, norm_w, EPS, residual=x)
        F.linear(hh, weights["qkv"], bias if shapes["qkv"][2] else None)
        o = F.linear(attn, weights["o"])
        h2, _ = rms_norm(o, norm_w, EPS, residual=xx)
        return F.linear(silu_mul(F.linear(h2, weights["gate_up"])), weights["down"])

    def parts_of(out: torch.Tensor) -> torch.Tensor:
        return out if out.dtype == torch.float32 else out.float()[None]

    down0 = parts_of(linear(torch.randn(m, shapes["down"][1], device="cuda", dtype=torch.bfloat16),
                            weights["down"], None, cfg["down"]))

    def triton_chain():
        hh, xx = rms_norm_parts(x, down0, norm_w, EPS)
        linear(hh, weights["qkv"], bias if shapes["qkv"][2] else None, cfg["qkv"])
        o = linear(attn, weights["o"], None, cfg["o"])
        h2, _ = rms_norm_parts(xx, parts_of(o), norm_w, EPS) if o.dtype == torch.float32 else \
            rms_norm(o, norm_w, EPS, residual=xx)
        return linear(linear(h2, weights["gate_up"], None, cfg["gate_up"], silu=True), weights["down"], None,
                      cfg["down"])

    base, fused = graph_time_ms(cublas), graph_time_ms(triton_chain)
    print(f"gemm chain {model:13s} M={m:5d}  cublas {base * 1e3:7.1f} us/layer  triton {fused * 1e3:7.1f} us/layer "
          f"({base / fused:4.2f}x)  per step: {base * layers:6.3f} -> {fused * layers:6.3f} ms", flush=True)
    return {"bench": "gemm_chain", "model": model, "rows": m, "cublas_ms_per_layer": base,
            "triton_ms_per_layer": fused, "layers": layers, "configs": {k: vars(c) for k, c in cfg.items()}}


FP8_ROWS = (16, 100, 200, 400, 800, 1600, 2048, 4096, 8192)  # beam rows, Score heads, prefill tokens
FP8_HEAD_ROWS = 1600  # the LM head runs at most at the beam rows (a Score batch: its label rows)
VOCAB = 151936


def bench_fp8() -> list[dict[str, Any]]:
    """bf16 against FP8 (e4m3, rowwise scales) for every GEMM shape a decoder layer and the LM head
    run (both embedded models; M = FP8_ROWS: beam rows, Score label rows, prefill tokens): cuBLAS
    bf16 (F.linear); torch._scaled_mm alone on operands quantized beforehand (the GEMM's own gain);
    with the activations quantized by the ATen ops both runtimes use today (kernels/fp8_linear.py
    quantize_rows: what a layer pays now); with the one-kernel quantizer (quantize_rows_triton). The
    FP8 product is checked against float64 of the same quantized operands first. Then each GEMM with
    the kernel that produces its input, as the fused path runs them: bf16 (rms_norm / silu_mul /
    nothing, then F.linear) against FP8 (rms_norm_fp8 / silu_mul_fp8 / quantize_rows_triton, then
    _scaled_mm)."""
    from kernels.fp8_linear import quantize_rows
    from kernels.fp8_quant import quantize_rows_triton
    from service.artifact.fp8_measure import producer_chains

    results = []
    gen = torch.Generator(device="cuda").manual_seed(29)
    for model, (d, h, g, e, inter, layers) in GEMM_MODELS.items():
        shapes = {"qkv": ((h + 2 * g) * e, d), "o": (d, h * e), "gate_up": (2 * inter, d), "down": (d, inter),
                  "head": (VOCAB, d)}
        for kind, (n, k) in shapes.items():
            w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            w_q, w_s = quantize_rows(w)
            for m in FP8_ROWS:
                if kind == "head" and m > FP8_HEAD_ROWS:
                    continue
                a = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
                a_q, a_s = quantize_rows(a)
                t_q, t_s = quantize_rows_triton(a)
                if not (torch.equal(t_q.view(torch.uint8), a_q.view(torch.uint8)) and torch.equal(t_s, a_s)):
                    raise AssertionError(f"fp8 {model} {kind} M={m}: the Triton quantizer's bytes differ")

                def mm(q=a_q, s=a_s):
                    return torch._scaled_mm(q, w_q.t(), scale_a=s.unsqueeze(1), scale_b=w_s.unsqueeze(0),
                                            out_dtype=torch.bfloat16)

                exact = (a_q.double() @ w_q.double().t()) * a_s.double()[:, None] * w_s.double()[None, :]
                err = _rel_err(mm(), exact)
                if err > 2 ** -6:  # bf16 output rounding; mis-scaled is O(1)
                    raise AssertionError(f"fp8 {model} {kind} M={m}: _scaled_mm off float64 by {err:.3e}")
                bf16 = graph_time_ms(lambda: F.linear(a, w))
                alone = graph_time_ms(mm)
                aten = graph_time_ms(lambda: mm(*quantize_rows(a)))
                fused = graph_time_ms(lambda: mm(*quantize_rows_triton(a)))
                chain_bf16, chain_fp8 = producer_chains(kind, a, w, w_q, w_s, gen)  # as `build --fp8 auto` times
                c_bf16, c_fp8 = graph_time_ms(chain_bf16), graph_time_ms(chain_fp8)
                row = {"bench": "fp8", "model": model, "kind": kind, "rows": m, "n": n, "k": k, "bf16_ms": bf16,
                       "fp8_gemm_ms": alone, "fp8_aten_quant_ms": aten, "fp8_triton_quant_ms": fused,
                       "chain_bf16_ms": c_bf16, "chain_fp8_ms": c_fp8, "rel_err_vs_f64": err, "layers": layers}
                results.append(row)
                print(f"fp8 {model:13s} {kind:8s} M={m:5d} N={n:6d} K={k:5d}  bf16 {bf16 * 1e3:7.1f} us  "
                      f"fp8 gemm {alone * 1e3:7.1f} ({bf16 / alone:4.2f}x)  +aten quant {aten * 1e3:7.1f} "
                      f"({bf16 / aten:4.2f}x)  +triton quant {fused * 1e3:7.1f} ({bf16 / fused:4.2f}x)  "
                      f"with its producer: {c_bf16 * 1e3:7.1f} -> {c_fp8 * 1e3:7.1f} us ({c_bf16 / c_fp8:4.2f}x)",
                      flush=True)
    return results


QUANT_ROWS = (16, 100, 400, 1600, 8192)
QUANT_TILES = ((1, 4), (1, 8), (2, 4), (4, 4), (4, 8), (8, 8))  # (rows a program, warps)


def bench_quant() -> list[dict[str, Any]]:
    """The one-kernel FP8 quantizer (kernels/fp8_quant.py quantize_rows_kernel) over every activation
    width it quantizes (o's and the head's input: each model's q_size and hidden size; the norms' and
    SiLU*up's widths beside), at each tile (rows a program, warps) beside its default
    (row_tile_config), and the bf16 RMSNorm kernel of the same rows as the floor of a one-pass row
    kernel. Measured 2026-12-05 inside `--only fp8`: ~2.6 us at K 1,024 / 2,048 but ~6.5 us at K 896
    even at 16 rows, with PTX of the same shape; this sweep is to say why. Each tile's bytes are
    checked equal to the default's first."""
    from kernels import COMPILE_OPTIONS
    from kernels.fp8_quant import fp8_rows, quantize_rows_kernel, quantize_rows_triton, row_tile_config
    from kernels.norm_act import rms_norm

    results = []
    widths = sorted({k for d, h, g, e, inter, _ in GEMM_MODELS.values() for k in (d, h * e, inter)})
    for k in widths:
        block = row_tile_config(k)["BLOCK_D"]
        for m in QUANT_ROWS:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want_q, want_s = quantize_rows_triton(a)
            row = {"bench": "quant", "k": k, "rows": m, "default": row_tile_config(k),
                   "default_ms": graph_time_ms(lambda: quantize_rows_triton(a)),
                   "rms_norm_ms": graph_time_ms(lambda: rms_norm(a, torch.ones(k, device="cuda", dtype=a.dtype), 1e-6)),
                   "tiles": {}}
            for rows_per, warps in QUANT_TILES:
                q, s = fp8_rows(m, k, a.device)

                def run(q=q, s=s, rows_per=rows_per, warps=warps):
                    quantize_rows_kernel[(triton.cdiv(m, rows_per),)](a, q, s, m, D=k, BLOCK_D=block, ROWS=rows_per,
                                                                      num_warps=warps, **COMPILE_OPTIONS)

                run()
                if not (torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)):
                    raise AssertionError(f"quant K={k} M={m} tile {rows_per}x{warps}: other bytes than the default's")
                row["tiles"][f"{rows_per}x{warps}"] = graph_time_ms(run)
            results.append(row)
            best = min(row["tiles"].items(), key=lambda kv: kv[1])
            print(f"quant K={k:5d} M={m:5d}: default {row['default']['ROWS']}x{row['default']['num_warps']} "
                  f"{row['default_ms'] * 1e3:6.2f} us, best {best[0]} {best[1] * 1e3:6.2f} us, "
                  f"rms_norm {row['rms_norm_ms'] * 1e3:6.2f} us", flush=True)
    return results


def bench_beam_merge() -> list[dict[str, Any]]:
    """The beam step's merge (top-B of each request's B x B unique keys, kernels/beam_topk.py): one
    torch top-k slice a request (merge_keys, what the runtimes ran before) against beam_merge's rounds
    of Triton programs, at the bookkeeping shapes of the default buckets (R requests x B ranks),
    checked equal first."""
    from kernels.beam_topk import beam_merge, merge_keys

    results = []
    for r, b in [(1, 100), (8, 128), (8, 96), (8, 48), (1, 400), (2, 400), (3, 400), (8, 400)]:
        keys = torch.randperm(r * b * b, device="cuda").mul((1 << 24) + 7).sub(1 << 40).view(r * b, b)
        if not torch.equal(beam_merge(keys, r, b), merge_keys(keys, r, b)):
            raise AssertionError(f"beam_merge R={r} B={b}: the Triton merge is not torch's top-k")
        one = graph_time_ms(lambda: merge_keys(keys, r, b))
        rounds = graph_time_ms(lambda: beam_merge(keys, r, b))
        print(f"beam_merge R={r} B={b:3d}: torch top-k {one * 1e3:7.1f} us   Triton rounds {rounds * 1e3:7.1f} us "
              f"({one / rounds:4.2f}x)", flush=True)
        results.append({"bench": "beam_merge", "requests": r, "beams": b, "topk_ms": one, "triton_ms": rounds})
    return results


BENCHES: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "decode_attention": bench_decode_attention,
    "prefill_attention": bench_prefill_attention,
    "layer_kernels": bench_layer_kernels,
    "beam_step": bench_beam_step,
    "gemm": bench_gemm,
    "beam_merge": bench_beam_merge,
    "fp8": bench_fp8,
    "quant": bench_quant,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(BENCHES), help="these benchmarks only (default: all)")
    p.add_argument("--beam-shapes", help=f"beam_step at these shapes only (comma list of {', '.join(BEAM_SHAPES)})")
    p.add_argument("--beam-fused-only", action="store_true",
                   help="beam_step without the ATen path (its W2x8 steps take ~3.7 ms each, seconds of replays)")
    p.add_argument("--out", help="write DIR/bench_kernels.json")
    args = p.parse_args()
    benches = dict(BENCHES)
    shapes = args.beam_shapes.split(",") if args.beam_shapes else list(BEAM_SHAPES)
    if unknown := [s for s in shapes if s not in BEAM_SHAPES]:
        p.error(f"--beam-shapes: unknown {', '.join(unknown)} (known: {', '.join(BEAM_SHAPES)})")
    paths = ("fused",) if args.beam_fused_only else ("aten", "fused")
    benches["beam_step"] = lambda: bench_beam_step(shapes, paths)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU")
    results = {name: benches[name]() for name in (args.only or benches)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
