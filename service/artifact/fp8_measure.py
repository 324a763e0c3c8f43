"""`slmrank build --fp8 auto` (issue 29's measured policy): which linear layers go to FP8, and from
how many activation rows, decided by timing them on this machine's GPU at the rows the artifact's
buckets run.

For each part (FP8_PARTS) and each row count its GEMMs run at (row_tiers: a Score bucket's tokens,
a beam bucket's prompt tokens and beam rows; for the head a Score bucket's samples, a beam bucket's
requests and beam rows), the part's GEMMs are timed in bf16 and in FP8, each with the kernel that
produces its activations on the fused path (docs/operations.md, FP8 linear layers): the norm before
q/k/v and gate/up (rms_norm / rms_norm_fp8), SiLU*up before down (silu_mul / silu_mul_fp8), the
one-kernel quantizer before o and the head. CUDA graphs of CALLS calls, the median of REPS replays.
Weights are random of the model's shapes (the time does not depend on the values).

choose_floors then keeps a part where FP8 is faster at the largest rows, with the floor at the
fewest rows from which it is faster at every larger count too (`--fp8 PART:ROWS`); a part FP8 is
faster for at every count runs in FP8 always; the others stay in the model dtype. The timings go
into the manifest (weights.fp8_measured), the choice into weights.fp8 / fp8_min_rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..model.config import ModelConfig
from ..model.fp8_policy import FP8_PARTS
from ..siblings import sibling
from .buckets import BeamBucket, BucketTable

CALLS, REPS = 20, 15


def device_time_ms(fn: Callable[[], Any], calls: int = CALLS, reps: int = REPS) -> float:
    """Device time of one fn() call on the current CUDA device: `calls` calls captured in one CUDA
    graph, the median of `reps` replays (ops/bench/bench_kernels.py times every kernel so)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compiles (Triton JIT) and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def producer_chains(kind: str, a: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                    gen: torch.Generator) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(bf16, FP8) of one GEMM with the kernel that produces its activations on the fused path, for
    activations like a [M, K] (module docstring); kind: qkv, o, gate_up, down, head. w [N, K] bf16,
    w_q / w_s its e4m3 rows and scales. ops/bench/bench_kernels.py --only fp8 times these too."""
    norm_act, fp8_quant = sibling("kernels.norm_act"), sibling("kernels.fp8_quant")
    scaled_linear = sibling("kernels.fp8_linear").scaled_linear
    m, k = a.shape
    if kind == "down":  # SiLU*up over a gate/up output twice as wide, then the GEMM
        gu = torch.randn(m, 2 * k, generator=gen, device=a.device, dtype=a.dtype)
        return (lambda: F.linear(norm_act.silu_mul(gu), w),
                lambda: scaled_linear(*norm_act.silu_mul_fp8(gu), w_q, w_s))
    if kind in ("qkv", "gate_up"):  # the norm before, with its residual add
        res = torch.randn(m, k, generator=gen, device=a.device, dtype=a.dtype)
        nw = 1 + 0.1 * torch.randn(k, generator=gen, device=a.device, dtype=a.dtype)
        return (lambda: F.linear(norm_act.rms_norm(a, nw, 1e-6, residual=res)[0], w),
                lambda: scaled_linear(*norm_act.rms_norm_fp8(a, nw, 1e-6, residual=res)[:2], w_q, w_s))
    # o (after the attention) and the head (after the final norm): the quantizer alone
    return lambda: F.linear(a, w), lambda: scaled_linear(*fp8_quant.quantize_rows_triton(a), w_q, w_s)


def row_tiers(buckets: BucketTable) -> dict[str, list[int]]:
    """Each part's activation row counts over the artifact's buckets: the decoder layers' (mlp,
    attn) and the head's."""
    layers, head = set(), set()
    for b in (*buckets.score, *buckets.beam):
        if isinstance(b, BeamBucket):
            layers |= {b.max_prompt_tokens, b.max_rows}
            head |= {b.max_requests, b.max_rows}
        else:
            layers.add(b.max_tokens)
            head.add(b.max_samples)
    return {"mlp": sorted(layers), "attn": sorted(layers), "head": sorted(head)}


def choose_floors(timings: dict[str, list[dict[str, float]]]) -> tuple[tuple[str, ...], dict[str, int]]:
    """timings: part -> [{"rows", "bf16_ms", "fp8_ms"}] -> (the parts in FP8, their row floors).

    A part is kept when FP8 is faster at its largest row count; its floor is the fewest rows from
    which FP8 is faster at every larger count; no floor when that is every count."""
    parts, floors = [], {}
    for part in FP8_PARTS:
        rows = sorted(timings.get(part, []), key=lambda r: r["rows"])
        gains = [r["fp8_ms"] < r["bf16_ms"] for r in rows]
        if not gains or not gains[-1]:
            continue
        first = len(gains)
        while first > 0 and gains[first - 1]:
            first -= 1
        parts.append(part)
        if first > 0:
            floors[part] = int(rows[first]["rows"])
    return tuple(parts), floors


def measure(cfg: ModelConfig, buckets: BucketTable, device: torch.device,
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Times every part at every row count of row_tiers (module docstring) on a CUDA device in
    bfloat16. Returns {"device", "parts": {part: [{"rows", "bf16_ms", "fp8_ms"}]}}."""
    if device.type != "cuda":
        raise ValueError(f"--fp8 auto times the GEMMs on a CUDA device, and this build runs on {device.type}: "
                         "build on the GPU that will serve, or name the parts (--fp8 mlp:2048,attn:2048)")
    quantize_rows = sibling("kernels.fp8_linear").quantize_rows
    gen = torch.Generator(device=device).manual_seed(29)
    d, inter = cfg.hidden_size, cfg.intermediate_size

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) / k ** 0.5
        return (w, *quantize_rows(w))

    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, d), "o": (d, cfg.q_size), "gate_up": (2 * inter, d),
              "down": (d, inter), "head": (cfg.num_labels if cfg.has_cls_head else cfg.vocab_size, d)}
    kinds = {"attn": ("qkv", "o"), "mlp": ("gate_up", "down"), "head": ("head",)}
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "parts": {}}
    for part, tiers in row_tiers(buckets).items():
        if any(n % 16 or k % 16 for n, k in (shapes[kind] for kind in kinds[part])):
            continue  # torch._scaled_mm's condition: such a part would run emulated, never faster
        rows_out = []
        weights = {kind: weight(*shapes[kind]) for kind in kinds[part]}
        for m in tiers:
            bf16 = fp8 = 0.0
            for kind in kinds[part]:
                w, w_q, w_s = weights[kind]
                a = torch.randn(m, w.shape[1], generator=gen, device=device, dtype=torch.bfloat16)
                plain, quant = producer_chains(kind, a, w, w_q, w_s, gen)
                bf16 += device_time_ms(plain)
                fp8 += device_time_ms(quant)
            rows_out.append({"rows": m, "bf16_ms": round(bf16, 5), "fp8_ms": round(fp8, 5)})
            progress(f"{part} {m} rows: bf16 {bf16 * 1e3:.1f} us, fp8 {fp8 * 1e3:.1f} us")
        out["parts"][part] = rows_out
        del weights
        torch.cuda.empty_cache()
    return out


def format_table(measured: dict[str, Any], parts: Sequence[str], floors: dict[str, int]) -> str:
    """The timings and the choice, as the build prints them."""
    lines = [f"fp8 auto on {measured['device']}: bf16 / FP8 device time of each part's GEMMs (with their producers)"]
    for part, rows in measured["parts"].items():
        cells = " ".join(f"{r['rows']}:{r['bf16_ms'] / r['fp8_ms']:.2f}x" for r in rows)
        choice = (f"FP8 from {floors[part]} rows" if part in floors else "FP8 always") if part in parts else "bf16"
        lines.append(f"  {part:4s} -> {choice:20s} (bf16/FP8 by rows: {cells})")
    return "\n".join(lines)
