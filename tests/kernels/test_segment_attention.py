"""kernels.segment_attention (Triton): Score / BeamSearch-prefill attention in one kernel, against
the dense-mask reference and against what the ATen path computes from the batch's own masks
(a sample: causal within itself + its request's whole prefix, merged by log-sum-exp), on fresh
random batches packed by service/runtime/batch.py: prefixes or none, padding, samples straddling
tile boundaries, samples longer than a tile, requests that are not a multiple of the tile. Small
shapes: Triton's interpreter on the CPU (compiled on a GPU where there is one); GPU (marked gpu):
compiled, at the workloads' shapes, no less accurate than the varlen FlashAttention path it
replaces, and inside a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import masked_attention_ref, segment_bounds, segment_key_ranges
from kernels.decode_attention import Tile
from kernels.segment_attention import key_mask, segment_attention, segment_attention_ref
from service.artifact.buckets import ScoreBucket
from service.model.layers import two_part_attention
from service.runtime.batch import pack_score
from service.runtime.requests import ScoreRequest

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter takes CPU tensors only, a GPU build CUDA ones
LAYOUTS = {"qwen2.5-0.5b": (14, 2, 64), "qwen3": (16, 8, 128), "small": (4, 2, 16)}


def _score_batch(rng: random.Random, blocks: int, block: int, samples: list[int] | None = None,
                 prefix: int | None = None, requests: int | None = None) -> dict[str, torch.Tensor]:
    """A Score batch's inputs (pack_score): `requests` of the `blocks` blocks used (the rest padding),
    each with a prefix of `prefix` tokens (None: random, sometimes none) and the given sample lengths
    (None: random ones that fill most of the block)."""
    reqs = []
    for _ in range(blocks if requests is None else requests):
        p = rng.choice([0, 0, rng.randint(1, block // 3)]) if prefix is None else prefix
        lengths = list(samples) if samples is not None else []
        if samples is None:
            room = rng.randint(1, block - p)
            while room > 0:
                lengths.append(min(room, rng.choice([1, 2, 5, 17, 40, 70])))
                room -= lengths[-1]
        reqs.append(ScoreRequest(samples=tuple((1,) * n for n in lengths), label_ids=(0,), prefix_ids=(1,) * p))
    return pack_score(reqs, ScoreBucket(blocks * block, 4 * block, blocks), 1).inputs


def _aten_masks(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ATen path's visibility (service/runtime/nodes.py::score_masks): mask_self, mask_ctx [T, T]."""
    pos, seg, ctx = inputs["positions"], inputs["seg"], inputs["ctx"]
    mask_self = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return mask_self, ctx[:, None] == seg[None, :]


def _expected_ranges(seg: list[int], ctx: list[int] | None) -> list[list[int]]:
    """key_ranges built row by row on the host, from the layout's definition: a row's own segment is its run of
    equal ids; a sample's prefix is the run of rows whose id is its ctx."""
    t = len(seg)
    out = [[0] * t, [0] * t, [0] * t]
    for i in range(t):
        start = i
        while start > 0 and seg[start - 1] == seg[i]:
            start -= 1
        out[2][i] = start if seg[i] >= 0 else i + 1
        if ctx is not None and ctx[i] >= 0:
            b0 = seg.index(ctx[i])
            n = 0
            while b0 + n < t and seg[b0 + n] == ctx[i]:
                n += 1
            out[0][i], out[1][i] = b0, b0 + n
    return out


def _ranges(inputs: dict[str, torch.Tensor], ctx: torch.Tensor | None = None) -> torch.Tensor:
    """The masks node's key ranges (segment_key_ranges) of a packed Score batch, on DEVICE (or ctx's)."""
    ctx = inputs["ctx"].to(DEVICE) if ctx is None else ctx
    return segment_key_ranges(inputs["seg"].to(ctx.device), ctx, inputs["request_rows"].to(ctx.device),
                              inputs["prefix_rows"].to(ctx.device))


def _qkv(g: torch.Generator, t: int, layout: str, dtype: torch.dtype, device: str):
    heads, kv_heads, dim = LAYOUTS[layout]
    return tuple(torch.randn(t, n, dim, generator=g).to(device, dtype) for n in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize("seed", range(4))
def test_key_ranges_follow_the_layout(seed: int) -> None:
    rng = random.Random(seed)
    block = rng.choice([40, 64, 96])
    inputs = _score_batch(rng, 3, block, requests=rng.choice([2, 3]))
    seg, ctx = inputs["seg"], inputs["ctx"]
    got = _ranges(inputs, ctx)
    assert got.dtype == torch.int32 and got.shape == (3, seg.shape[0])
    assert got.tolist() == _expected_ranges(seg.tolist(), ctx.tolist())
    # beam prefill: the prompts packed back to back, no prefix
    assert segment_key_ranges(seg).tolist() == _expected_ranges(seg.tolist(), None)
    # the visibility is the ATen path's on every real row; padding rows see nothing
    mask_self, mask_ctx = _aten_masks(inputs)
    real = seg.ge(0)
    assert torch.equal(key_mask(got)[real], (mask_self | mask_ctx)[real])
    assert not key_mask(got)[~real].any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", ["small", "qwen2.5-0.5b"])
@pytest.mark.parametrize("tile", [None, Tile(16, 16, 4, 2), Tile(32, 16, 4, 2)], ids=["default", "m16n16", "m32n16"])
def test_matches_reference_float32(seed: int, layout: str, tile: Tile | None) -> None:
    """Random Score batches (blocks of 40 or 72 rows: tiles straddle blocks and samples; samples up to
    70 rows: longer than a tile), float32: the reference and the ATen path's two parts + merge."""
    rng = random.Random(seed)
    block = rng.choice([40, 72])
    inputs = _score_batch(rng, 3, block, requests=rng.choice([2, 3]))
    seg, ctx = inputs["seg"].to(DEVICE), inputs["ctx"].to(DEVICE)
    ranges = _ranges(inputs, ctx)
    q, k, v = _qkv(torch.Generator().manual_seed(seed), seg.shape[0], layout, torch.float32, DEVICE)
    scale = q.shape[-1] ** -0.5
    got = segment_attention(q, k, v, ranges, scale, tile=tile)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, segment_attention_ref(q, k, v, ranges, scale), atol=2e-6, rtol=2e-6)
    mask_self, mask_ctx = (m.to(DEVICE) for m in _aten_masks(inputs))
    want = two_part_attention(q, k, v, mask_ctx, k, v, mask_self, scale)  # what the ATen path runs
    real = seg.ge(0)
    torch.testing.assert_close(got[real], want[real], atol=2e-6, rtol=2e-6)
    assert not got[~real].any()  # padding rows: 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["small", "qwen3"])
def test_no_less_accurate_than_the_reference_16bit(dtype: torch.dtype, layout: str) -> None:
    rng = random.Random(7)
    inputs = _score_batch(rng, 2, 72, prefix=20)
    seg, ctx = inputs["seg"].to(DEVICE), inputs["ctx"].to(DEVICE)
    ranges = _ranges(inputs, ctx)
    q, k, v = _qkv(torch.Generator().manual_seed(1), seg.shape[0], layout, dtype, DEVICE)
    scale = q.shape[-1] ** -0.5
    got = segment_attention(q, k, v, ranges, scale, tile=Tile(32, 16, 4, 2))
    assert got.dtype == dtype
    truth = segment_attention_ref(q.double(), k.double(), v.double(), ranges, scale)
    ref = segment_attention_ref(q, k, v, ranges, scale)
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= 2 * err_ref.max() and err_got.mean() <= 2 * err_ref.mean()


@pytest.mark.parametrize("seed", range(2))
def test_beam_prefill_packed_prompts(seed: int) -> None:
    """BeamSearch prefill: prompts packed in one block (seg = the request), padding after them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [37, 3, 50, 1]
    seg = torch.tensor([r for r, n in enumerate(prompts) for _ in range(n)] + [-1] * 13, device=DEVICE)
    pos = torch.cat([torch.arange(n) for n in prompts] + [torch.zeros(13, dtype=torch.int64)]).to(DEVICE)
    ranges = segment_key_ranges(seg)
    q, k, v = _qkv(g, seg.shape[0], "small", torch.float32, DEVICE)
    got = segment_attention(q, k, v, ranges, 0.3, tile=Tile(16, 16, 4, 2))
    mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])  # nodes.py::beam_masks' mask_self
    want = masked_attention_ref(q, k, v, mask, 0.3)[0]
    real = seg.ge(0)
    torch.testing.assert_close(got[real], want[real], atol=2e-6, rtol=2e-6)
    assert not got[~real].any()


def test_refuses_bad_arguments() -> None:
    q, k, v = _qkv(torch.Generator().manual_seed(0), 20, "small", torch.float32, DEVICE)
    ranges = segment_key_ranges(torch.zeros(20, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="do not agree"):
        segment_attention(q[:, :3], k, v, ranges, 0.25)
    with pytest.raises(ValueError, match="int32"):
        segment_attention(q, k, v, ranges.long(), 0.25)
    with pytest.raises(ValueError, match="int32"):
        segment_attention(q, k, v, ranges[:, :10], 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        segment_attention(q, k, v, ranges.t().contiguous().t(), 0.25)


# the workloads at full size on the GPU: (layout, blocks, block rows, prefix, sample lengths, requests)
GPU_CASES = {
    "W1x8": ("qwen3", 8, 1024, 0, [64] * 15, 8),
    "W4x8": ("qwen3", 8, 768, 384, [24] * 15, 8),
    "W2-prefix": ("qwen2.5-0.5b", 4, 1024, 300, [45] * 15, 3),  # one padding block
    "W1-r1-long": ("qwen3", 1, 3000, 100, [700, 900, 1200], 1),  # a block that is no multiple of a tile
}


def _gpu_case(case: str, dtype: torch.dtype, seed: int = 0):
    layout, blocks, block, prefix, samples, requests = GPU_CASES[case]
    inputs = _score_batch(random.Random(seed), blocks, block, samples, prefix, requests)
    seg = inputs["seg"].cuda()
    ranges = _ranges(inputs, inputs["ctx"].cuda())
    q, k, v = _qkv(torch.Generator().manual_seed(seed), seg.shape[0], layout, dtype, "cuda")
    return inputs, seg, ranges, q, k, v


def _varlen_path(inputs: dict[str, torch.Tensor], q, k, v, max_rows: int, scale: float) -> torch.Tensor:
    """The path the kernel replaces: the runtimes' varlen FlashAttention calls + lerp merge (the
    masks node's buffers as service/runtime/nodes.py::score_masks makes them)."""
    from service.runtime.nodes import varlen_layer_attention

    seg, ctx = inputs["seg"].cuda(), inputs["ctx"].cuda()
    r, s = inputs["prefix_rows"].shape[0], inputs["last"].shape[0]
    env = {"cu_self": segment_bounds(seg, s + r + seg.shape[0] // max_rows + 1, max_rows),
           "cu_blocks": inputs["request_rows"].cuda().int(), "prefix_len": inputs["prefix_rows"].cuda().int(),
           "has_ctx": ctx.ge(0).unsqueeze(1)}
    return varlen_layer_attention(q, k, v, env, "score", scale, max_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_cuda_16bit_no_less_accurate_than_flash(case: str, dtype: torch.dtype) -> None:
    inputs, seg, ranges, q, k, v = _gpu_case(case, dtype)
    scale = q.shape[-1] ** -0.5
    real = seg.ge(0)
    got = segment_attention(q, k, v, ranges, scale)
    truth = segment_attention_ref(q.double(), k.double(), v.double(), ranges, scale)
    flash = _varlen_path(inputs, q, k, v, max(GPU_CASES[case][2], 2048), scale)
    err_got, err_flash = (got.double() - truth)[real].abs(), (flash.double() - truth)[real].abs()
    assert err_got.max() <= err_flash.max() + 1e-3 and err_got.mean() <= err_flash.mean() + 1e-4
    assert not got[~real].any()
    assert torch.equal(got, segment_attention(q, k, v, ranges, scale))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["W4x8", "W1-r1-long"])
def test_cuda_float32_is_not_tf32(case: str) -> None:
    """float32 must compute in float32: TF32 products (10-bit mantissa) would be ~1e-3 off here."""
    _, seg, ranges, q, k, v = _gpu_case(case, torch.float32, seed=1)
    scale = q.shape[-1] ** -0.5
    got = segment_attention(q, k, v, ranges, scale)
    truth = segment_attention_ref(q.double(), k.double(), v.double(), ranges, scale)
    assert (got.double() - truth).abs().max() < 2e-5


@pytest.mark.gpu
def test_key_ranges_and_kernel_in_a_cuda_graph() -> None:
    """The masks node's key ranges and the kernel replay in a CUDA graph (no host sync), as the
    runtimes capture them, on the device's own copy of a batch's inputs."""
    inputs, _, _, q, k, v = _gpu_case("W4x8", torch.bfloat16)
    inputs = {name: x.cuda() for name, x in inputs.items()}  # the runtimes' device copy: no host copy in the capture
    ctx = torch.full_like(inputs["ctx"], -2)  # filled after the capture
    scale = q.shape[-1] ** -0.5
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        segment_attention(q, k, v, _ranges(inputs, ctx), scale)  # compile and warm up
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            ranges = _ranges(inputs, ctx)
            out = segment_attention(q, k, v, ranges, scale)
    ctx.copy_(inputs["ctx"])
    graph.replay()
    torch.cuda.synchronize()
    want = _ranges(inputs, ctx)
    assert torch.equal(ranges, want)
    assert torch.equal(out, segment_attention(q, k, v, want, scale))
