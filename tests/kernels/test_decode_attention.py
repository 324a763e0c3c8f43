"""kernels.decode_attention (Triton) against its plain-torch reference and against the parts + LSE
merge the runtimes use without the kernel (service.model.layers.two_part_attention), on fresh
random inputs: the prompts of several requests packed, each request's beams consecutive rows,
padding rows with no prompt, tiles that straddle two requests. CPU: Triton's interpreter; GPU:
compiled (marked gpu), at the head layouts and sizes of W2/W3 (qwen2.5-0.5b), W5 (qwen3-0.6b)
and W6 (qwen3-1.7b)."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import Tile, decode_attention, decode_attention_qkv, decode_attention_ref
from kernels.qkv_rope import qkv_rope
from service.model.layers import two_part_attention

LAYOUTS = {"qwen2.5-0.5b": (14, 2, 64), "qwen3": (16, 8, 128), "mha": (4, 4, 16)}
# These run the kernel on CPU tensors through Triton's interpreter, which tests/conftest.py turns on
# only where there is no GPU (it is read when a kernel is defined, for the whole process). On a GPU
# machine the kernels compile for CUDA and take CUDA tensors: the gpu-marked tests below cover them.
interpreted = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's CPU interpreter is off on a GPU "
                                 "machine; the gpu-marked tests run the compiled kernel")


def _case(seed: int, dtype: torch.dtype, device: str, heads: int, kv_heads: int, dim: int,
          prompts: list[int], beams: int, slots: int):
    g = torch.Generator().manual_seed(seed)
    p_total = sum(prompts) + 5  # 5 padding tokens at the end of the packed prompts
    rows = len(prompts) * beams + beams  # one more request slot of padding (no prompt)
    q = torch.randn(rows, heads, dim, generator=g)
    pk, pv = (torch.randn(p_total, kv_heads, dim, generator=g) for _ in range(2))
    sk, sv = (torch.randn(rows, slots, kv_heads, dim, generator=g) for _ in range(2))
    starts = torch.tensor([0] + prompts[:-1]).cumsum(0).tolist()
    kv_start = torch.tensor([s for s in starts for _ in range(beams)] + [1] * beams)  # as beam_masks pads
    kv_len = torch.tensor([n for n in prompts for _ in range(beams)] + [0] * beams)
    seg = torch.full((p_total,), -1)
    for r, (s, n) in enumerate(zip(starts, prompts)):
        seg[s:s + n] = r
    beam_req = torch.arange(len(prompts) + 1).repeat_interleave(beams)
    mask = beam_req[:, None] == seg[None, :]

    def to(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, dtype)

    return (to(q), to(pk), to(pv), kv_start.to(device), kv_len.to(device), to(sk), to(sv), mask.to(device))


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tile", [None, Tile(64, 32, 4, 3)], ids=["default", "m64"])
@interpreted
def test_decode_attention_matches_reference_cpu_float32(seed: int, t: int, layout: str, tile: Tile | None) -> None:
    heads, kv_heads, dim = LAYOUTS[layout]
    # 5 beams a request: tiles of 2 (float32's 16 rows, 7 heads a group) or 9 beams straddle the requests
    q, pk, pv, start, length, sk, sv, mask = _case(seed, torch.float32, "cpu", heads, kv_heads, dim,
                                                   prompts=[7, 70, 1, 33], beams=5, slots=4)
    scale = dim ** -0.5
    got = decode_attention(q, pk, pv, start, length, sk, sv, t, scale, tile=tile)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, decode_attention_ref(q, pk, pv, start, length, sk, sv, t, scale),
                               atol=2e-6, rtol=2e-6)
    want = two_part_attention(q, pk, pv, mask, sk[:, :t], sv[:, :t], None, scale)  # what the aten path runs
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
@interpreted
def test_decode_attention_matches_reference_cpu_bfloat16(layout: str) -> None:
    heads, kv_heads, dim = LAYOUTS[layout]
    q, pk, pv, start, length, sk, sv, _ = _case(3, torch.bfloat16, "cpu", heads, kv_heads, dim,
                                                prompts=[40, 9], beams=6, slots=3)
    scale = dim ** -0.5
    got = decode_attention(q, pk, pv, start, length, sk, sv, 3, scale, tile=Tile(64, 16, 4, 3))
    assert got.dtype == torch.bfloat16
    truth = decode_attention_ref(*(x.double() for x in (q, pk, pv)), start, length, sk.double(), sv.double(), 3, scale)
    ref = decode_attention_ref(q, pk, pv, start, length, sk, sv, 3, scale)
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= 2 * err_ref.max() and err_got.mean() <= 2 * err_ref.mean()


@pytest.mark.parametrize("seed", range(2))
@interpreted
def test_any_row_layout_is_correct(seed: int) -> None:
    """Rows need not be grouped by request: each row keys only its own range (any ranges, overlapping,
    empty, a row's range spanning the tile's others); grouping only makes it fast."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, rows, p_total, slots = 4, 2, 16, 23, 90, 2
    q = torch.randn(rows, heads, dim, generator=g)
    pk, pv = (torch.randn(p_total, kv_heads, dim, generator=g) for _ in range(2))
    sk, sv = (torch.randn(rows, slots, kv_heads, dim, generator=g) for _ in range(2))
    start = torch.randint(0, p_total, (rows,), generator=g)
    length = torch.minimum(torch.randint(0, 50, (rows,), generator=g), p_total - start)
    length[::5] = 0
    got = decode_attention(q, pk, pv, start, length, sk, sv, 2, 0.3, tile=Tile(16, 16, 4, 2))
    torch.testing.assert_close(got, decode_attention_ref(q, pk, pv, start, length, sk, sv, 2, 0.3),
                               atol=2e-6, rtol=2e-6)


def _ancestry(seed: int, rows: int, slots: int, t: int) -> torch.Tensor:
    """suffix_rows as beam steps leave them before decode step t: slots 0..t-2 of each row at some
    earlier row (a beam's ancestors), slot t-1 and later its own."""
    g = torch.Generator().manual_seed(seed)
    anc = torch.randint(0, rows, (rows, slots), generator=g)
    own = torch.arange(rows).unsqueeze(1).expand(rows, slots)
    return torch.where(torch.arange(slots).unsqueeze(0) < t - 1, anc, own).contiguous()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["qwen2.5-0.5b", "mha"])
@pytest.mark.parametrize("t", [2, 4])
def test_suffix_slots_read_through_their_rows(dtype: torch.dtype, layout: str, t: int) -> None:
    """A reordered beam's suffix is not copied: slot j of row r is read from row suffix_rows[r, j]. The
    kernel so gives, bit for bit, what it gives on a cache where every row's slots were gathered into
    the row (the copy the beam step made before); the reference reads through the rows as well; and
    the step's own k/v still goes into the row's own slot t - 1."""
    h, g, e = LAYOUTS[layout]
    q, pk, pv, start, length, sk, sv, _ = _case(7 + t, dtype, "cpu", h, g, e, prompts=[7, 30, 12], beams=5, slots=4)
    rows = q.shape[0]
    anc = _ancestry(t, rows, 4, t)
    assert not torch.equal(anc[:, :t - 1], torch.arange(rows).unsqueeze(1).expand(rows, t - 1))
    slots = torch.arange(4)
    copied_k, copied_v = sk[anc, slots].contiguous(), sv[anc, slots].contiguous()  # the gather it replaces
    got = decode_attention(q, pk, pv, start, length, sk, sv, t, 0.3, suffix_rows=anc)
    assert torch.equal(got, decode_attention(q, pk, pv, start, length, copied_k, copied_v, t, 0.3))
    ref = decode_attention_ref(q, pk, pv, start, length, sk, sv, t, 0.3, suffix_rows=anc)
    assert torch.equal(ref, decode_attention_ref(q, pk, pv, start, length, copied_k, copied_v, t, 0.3))
    torch.testing.assert_close(got.float(), ref.float(), **({"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16
                                                           else {"atol": 1e-5, "rtol": 1e-5}))
    # from the q/k/v GEMM's output: the step's k/v into the row's own slot t - 1, the rest through the rows
    qkv, pos, cos, sin, norms, pk, pv, start, length, sk, sv = _qkv_case(t, dtype, "cpu", h, g, e, False, 4)
    rows = qkv.shape[0]
    anc = _ancestry(t + 1, rows, 4, t)
    k1, v1 = sk.clone(), sv.clone()
    got = decode_attention_qkv(qkv, pos, t - 1, cos, sin, h, *norms, 1e-6, pk, pv, start, length, k1, v1, t, 0.3,
                               suffix_rows=anc)
    k2, v2 = sk[anc, slots].contiguous(), sv[anc, slots].contiguous()
    want = decode_attention_qkv(qkv, pos, t - 1, cos, sin, h, *norms, 1e-6, pk, pv, start, length, k2, v2, t, 0.3)
    assert torch.equal(got, want)
    assert torch.equal(k1[:, t - 1], k2[:, t - 1]) and torch.equal(v1[:, t - 1], v2[:, t - 1])
    assert torch.equal(k1[:, :t - 1], sk[:, :t - 1])  # the earlier slots stay where they were
    with pytest.raises(ValueError, match="suffix_rows must be int64"):
        decode_attention(q[:rows], pk, pv, start, length, sk, sv, t, 0.3, suffix_rows=anc.int())


def _qkv_case(seed: int, dtype: torch.dtype, device: str, heads: int, kv_heads: int, dim: int, qk_norm: bool,
              slots: int):
    """A decode step's inputs from the q/k/v GEMM: qkv [N, (H + 2G) * E], each row's position, RoPE
    tables, q/k norms; the cache of _case (three requests of 5 beams, a padding slot)."""
    q, pk, pv, start, length, sk, sv, _ = _case(seed, dtype, device, heads, kv_heads, dim, [7, 30, 12], 5, slots)
    g = torch.Generator().manual_seed(seed + 1)
    n = q.shape[0]
    qkv = (2 * torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)).to(device, dtype)
    pos = length.clone()  # a beam's first generated token sits at its prompt's length
    angles = torch.arange(64).unsqueeze(1) * (10000.0 ** (-torch.arange(dim // 2) / (dim // 2)))
    angles = torch.cat([angles, angles], 1)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    norms = tuple((1 + 0.3 * torch.randn(dim, generator=g)).to(device, dtype) for _ in range(2)) if qk_norm \
        else (None, None)
    return qkv, pos, cos, sin, norms, pk, pv, start, length, sk, sv


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("layout", ["qwen2.5-0.5b", "mha"])
@pytest.mark.parametrize("t", [1, 3])
def test_attention_from_qkv_equals_qkv_rope_then_the_attention(dtype: torch.dtype, qk_norm: bool, layout: str,
                                                              t: int) -> None:
    """The fused kernel (q/k norm + RoPE of the GEMM's output, k/v into suffix slot t-1, attention)
    against kernels/qkv_rope.py followed by decode_attention: the same suffix bytes and the same
    output, bit for bit in 16 bits (the norm's float64 sum of squares); in float32 the norm's sum may
    round otherwise (1e-6), RoPE alone is exact."""
    h, g, e = LAYOUTS[layout]
    qkv, pos, cos, sin, norms, pk, pv, start, length, sk, sv = _qkv_case(3 + t, dtype, "cpu", h, g, e, qk_norm, 4)
    sk2, sv2 = sk.clone(), sv.clone()
    got = decode_attention_qkv(qkv, pos, t - 1, cos, sin, h, *norms, 1e-6, pk, pv, start, length, sk, sv, t, 0.3)
    q, _, _ = qkv_rope(qkv, pos, cos, sin, h, g, *norms, 1e-6, pos_offset=t - 1, k_out=sk2[:, t - 1],
                       v_out=sv2[:, t - 1])
    want = decode_attention(q, pk, pv, start, length, sk2, sv2, t, 0.3)
    assert torch.equal(sv, sv2)
    if dtype == torch.bfloat16 or not qk_norm:
        assert torch.equal(sk, sk2) and torch.equal(got, want)
    else:
        torch.testing.assert_close(sk, sk2, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    others = [j for j in range(sk.shape[1]) if j != t - 1]
    assert torch.equal(sk[:, others], sk2[:, others])  # only slot t-1 is written


def test_decode_attention_refuses_bad_arguments() -> None:
    q, pk, pv, start, length, sk, sv, _ = _case(0, torch.float32, "cpu", 4, 2, 16, [3], 2, 2)
    with pytest.raises(ValueError, match="num_suffix 3 outside"):
        decode_attention(q, pk, pv, start, length, sk, sv, 3, 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        decode_attention(q[:, :3], pk, pv, start, length, sk, sv, 1, 0.25)
    with pytest.raises(ValueError, match="int64"):
        decode_attention(q, pk, pv, start.int(), length, sk, sv, 1, 0.25)
    with pytest.raises(ValueError, match="powers of two"):
        Tile(24, 32, 4, 2)
    with pytest.raises(ValueError, match="query heads per KV head exceed"):
        decode_attention(q[:, :1].expand(-1, 32, -1).contiguous(), pk[:, :1].contiguous(), pv[:, :1].contiguous(),
                         start, length, sk[:, :, :1].contiguous(), sv[:, :, :1].contiguous(), 1, 0.25,
                         tile=Tile(16, 16, 4, 2))


# the workloads at full size on the GPU: (layout, prompts of the requests, beams, suffix slots)
GPU_CASES = {
    "W2": ("qwen2.5-0.5b", [128, 97, 128, 5, 128, 128, 64, 128], 100, 4),
    "W3": ("qwen2.5-0.5b", [480, 300, 480, 480], 100, 4),
    "W5": ("qwen3", [480], 400, 4),
    "W6": ("qwen3", [1000], 256, 2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_decode_attention_cuda_bfloat16_no_less_accurate(case: str) -> None:
    layout, prompts, beams, slots = GPU_CASES[case]
    heads, kv_heads, dim = LAYOUTS[layout]
    q, pk, pv, start, length, sk, sv, _ = _case(0, torch.bfloat16, "cuda", heads, kv_heads, dim, prompts, beams, slots)
    scale = dim ** -0.5
    truth = decode_attention_ref(*(x.double() for x in (q, pk, pv)), start, length, sk.double(), sv.double(), slots,
                                 scale)
    ref = decode_attention_ref(q, pk, pv, start, length, sk, sv, slots, scale)
    got = decode_attention(q, pk, pv, start, length, sk, sv, slots, scale)
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= err_ref.max() + 1e-3 and err_got.mean() <= err_ref.mean() + 1e-4
    assert torch.equal(got, decode_attention(q, pk, pv, start, length, sk, sv, slots, scale))  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["W3", "W5"])
def test_decode_attention_cuda_float32_is_not_tf32(case: str) -> None:
    """float32 must compute in float32: TF32 products (10-bit mantissa) would be ~1e-3 off here."""
    layout, prompts, beams, slots = GPU_CASES[case]
    heads, kv_heads, dim = LAYOUTS[layout]
    q, pk, pv, start, length, sk, sv, _ = _case(1, torch.float32, "cuda", heads, kv_heads, dim, prompts, beams, slots)
    scale = dim ** -0.5
    truth = decode_attention_ref(*(x.double() for x in (q, pk, pv)), start, length, sk.double(), sv.double(), slots,
                                 scale)
    got = decode_attention(q, pk, pv, start, length, sk, sv, slots, scale)
    assert (got.double() - truth).abs().max() < 2e-5
