"""Kernel micro-benchmarks at the workloads' shapes (BENCHMARKS.md), for the GPU machine.

  python ops/bench_kernels.py [--only decode_attention ...] [--out DIR]

Every kernel is checked against its reference on the same inputs before it is timed. Times are
device times of CUDA-graph replays (CALLS back-to-back calls per graph, the median of REPS
replays, divided by CALLS), so Python's launch overhead is not in them, as in the executor.
Prints one line per measurement; --out DIR also writes DIR/bench_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.decode_attention import Tile, decode_attention, decode_attention_ref
from service.model.layers import two_part_attention

CALLS, REPS = 20, 30


def graph_time_ms(fn: Callable[[], Any], calls: int = CALLS, reps: int = REPS) -> float:
    """Device time of one fn() call: CALLS calls captured in one CUDA graph, median of REPS replays."""
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


# --- decode attention (kernels/decode_attention.py) -------------------------------------------

# workload: (heads, kv heads, head dim, layers, requests, prompt tokens, beams, new tokens)
DECODE_SHAPES = {
    "W2x8": (14, 2, 64, 24, 8, 128, 100, 5),
    "W3x4": (14, 2, 64, 24, 4, 480, 100, 5),
    "W5x1": (16, 8, 128, 28, 1, 480, 400, 5),
    "W5x2": (16, 8, 128, 28, 2, 480, 400, 5),
    "W6x1": (16, 8, 128, 28, 1, 1000, 256, 3),
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
    ref_err = (aten(slots).double() - truth).abs().max().item()
    results = []
    for label, fn in variants.items():
        err = (fn(slots).double() - truth).abs().max().item()
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
    the layers. Baseline at b258f99 (one program per beam row): 5.5 ms per W2x8 batch."""
    return [row for name in DECODE_SHAPES for row in _decode_workload(name, dtype)]


BENCHES: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "decode_attention": bench_decode_attention,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(BENCHES), help="these benchmarks only (default: all)")
    p.add_argument("--out", help="write DIR/bench_kernels.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels: needs a CUDA GPU")
    results = {name: BENCHES[name]() for name in (args.only or BENCHES)}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_kernels.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
