"""Score and BeamSearch-prefill attention over packed segments in one Triton kernel.

A batch's rows are packed segments: Score fills block i of the rows with request i's prefix (a
segment, optional), then its samples (a segment each), then padding; BeamSearch prefill packs the
prompts (a segment each), then padding. Row t sees at most two key ranges of the same rows:

  its prefix   [key_ranges[0, t], key_ranges[1, t])  (a sample after a shared prefix; else empty)
  its segment  [key_ranges[2, t], t]                 (causal within its own segment)

and a padding row sees none (its output is 0). kernels.attention.segment_key_ranges computes them on the
device with static shapes and no host sync (the masks nodes run it, inside a CUDA graph).

One program takes BLOCK_M consecutive rows of one query head. It walks the union of its rows'
prefix ranges, then the union of their segment ranges (from the segment start of its first row up
to its last row), BLOCK_N keys at a time, each row keeping only its own keys, with one online
softmax in float32: no second pass and no log-sum-exp merge. A tile whose rows are all padding
loads nothing and writes zeros. The work is about the sum over segments of (prefix x s + s^2/2)
plus one diagonal key block a tile, not a whole (L / BLOCK_M) x (segment slots) grid: the varlen
FlashAttention calls it replaces (kernels/attention.py) launch one program per (max segment length
/ 128) x (segment slot) x head, nearly all of them empty.

float32 inputs are multiplied in float32 (IEEE), never TF32 (decode_attention's _mma). The plain
torch reference (segment_attention_ref) is a dense mask built from key_ranges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import COMPILE_OPTIONS
from .attention import masked_attention_ref
from .decode_attention import Tile, _attend

INT32_MAX = tl.constexpr(2 ** 31 - 1)  # "no key" in the min/max reductions over a tile


@triton.jit
def _key_block(q, k_ptr, v_ptr, n0, hi, rows, c_start, c_end, s_start, g, m_i, l_i, acc, qk_scale,
               G: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Keys n0 .. n0+BLOCK_N-1 (< hi) of KV head g; row m sees c_start[m] <= key < c_end[m] and
    s_start[m] <= key <= rows[m]."""
    keys = n0 + tl.arange(0, BLOCK_N)
    in_range = keys < hi
    offs = (keys * G + g)[:, None] * E + tl.arange(0, E)[None, :]
    k = tl.load(k_ptr + offs, mask=in_range[:, None], other=0.0)  # [BLOCK_N, E]
    v = tl.load(v_ptr + offs, mask=in_range[:, None], other=0.0)
    key = keys[None, :]
    visible = (((key >= c_start[:, None]) & (key < c_end[:, None]))
               | ((key >= s_start[:, None]) & (key <= rows[:, None]))) & in_range[None, :]
    return _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, INTERPRETED)


@triton.jit
def segment_attention_kernel(q_ptr, k_ptr, v_ptr, ranges_ptr, out_ptr, num_rows, scale,
                             H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    # the heads of a tile are consecutive programs (they share its key ranges, and a KV head's keys in L2)
    h = tl.program_id(0)
    g = h // (H // G)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = rows < num_rows
    c_start = tl.load(ranges_ptr + rows, mask=is_row, other=0)
    c_end = tl.load(ranges_ptr + num_rows + rows, mask=is_row, other=0)
    s_start = tl.load(ranges_ptr + 2 * num_rows + rows, mask=is_row, other=INT32_MAX)
    has_c = c_end > c_start
    has_s = s_start <= rows
    # int32 offsets: every buffer here has < 2^31 elements
    dims = tl.arange(0, E)
    q_offs = (rows * H + h)[:, None] * E + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=(has_c | has_s)[:, None], other=0.0)  # padding rows: nothing read
    qk_scale = scale * 1.4426950408889634  # scores in the log2 domain: exp(x) = exp2(x * log2(e))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, E], tl.float32)

    # the unions of the rows' prefix ranges [a_lo, a_hi) and segment ranges [b_lo, b_hi) (empty: lo > hi).
    # Two walks that never visit a key twice: [a_lo, min(a_hi, b_lo)), then [b_lo, max(a_hi, b_hi));
    # together they cover both unions (a prefix precedes its samples: the first walk is the prefix)
    a_lo = tl.min(tl.where(has_c, c_start, INT32_MAX), axis=0)
    a_hi = tl.max(tl.where(has_c, c_end, 0), axis=0)
    b_lo = tl.min(tl.where(has_s, s_start, INT32_MAX), axis=0)
    b_hi = tl.max(tl.where(has_s, rows + 1, 0), axis=0)
    hi1 = tl.minimum(a_hi, b_lo)
    hi2 = tl.maximum(a_hi, b_hi)
    if not INTERPRETED:  # for loops: Triton software-pipelines the K/V loads across iterations
        for n0 in range(a_lo, hi1, BLOCK_N):
            m_i, l_i, acc = _key_block(q, k_ptr, v_ptr, n0, hi1, rows, c_start, c_end, s_start, g, m_i, l_i, acc,
                                       qk_scale, G, E, BLOCK_N, INTERPRETED)
        for n0 in range(b_lo, hi2, BLOCK_N):
            m_i, l_i, acc = _key_block(q, k_ptr, v_ptr, n0, hi2, rows, c_start, c_end, s_start, g, m_i, l_i, acc,
                                       qk_scale, G, E, BLOCK_N, INTERPRETED)
    else:  # Triton 3.6's interpreter (numpy >= 2.3) cannot bound a range() by a tensor; same bodies
        n0 = a_lo
        while n0 < hi1:
            m_i, l_i, acc = _key_block(q, k_ptr, v_ptr, n0, hi1, rows, c_start, c_end, s_start, g, m_i, l_i, acc,
                                       qk_scale, G, E, BLOCK_N, INTERPRETED)
            n0 += BLOCK_N
        n0 = b_lo
        while n0 < hi2:
            m_i, l_i, acc = _key_block(q, k_ptr, v_ptr, n0, hi2, rows, c_start, c_end, s_start, g, m_i, l_i, acc,
                                       qk_scale, G, E, BLOCK_N, INTERPRETED)
            n0 += BLOCK_N

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees no key (padding): acc = 0, out 0
    tl.store(out_ptr + q_offs, out.to(q.dtype), mask=is_row[:, None])


def default_tile(head_dim: int, is_float32: bool) -> Tile:
    """bf16/fp16: 64-row tiles (one warpgroup's wgmma), 32 keys a step: on the H200 (ops/bench/bench_kernels.py,
    prefill_attention) 40 us a layer at W1x8 and 79 at W4x8 against 49 and 82 for 64 keys a step and
    77 and 110 for 128 x 64 tiles of 8 warps; within 10% of the best at the BeamSearch prefills.
    float32 multiplies in IEEE float32 on the FMA units: 16 x 32 (decode_attention's float32 tile,
    which does not spill on sm_90a)."""
    if is_float32:
        return Tile(16, 32, 4 if head_dim <= 64 else 8, 2)
    return Tile(64, 32, 4, 3)


def kernel_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, tile: Tile,
                      interpreted: bool = False) -> dict[str, int | bool]:
    """The kernel's constexprs (the launcher and kernels/aot.py share them)."""
    return {"H": num_heads, "G": num_kv_heads, "E": head_dim, "BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n,
            "INTERPRETED": interpreted}


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ranges: torch.Tensor, scale: float,
                      tile: Tile | None = None) -> torch.Tensor:
    """q [T, H, E]; k, v [T, G, E] (the same rows' keys); key_ranges [3, T] int32 (segment_key_ranges).
    Returns out [T, H, E] (q.dtype); a row with no key gets 0. tile: None for default_tile (what
    kernels/aot.py compiles)."""
    t, h, e = q.shape
    g = k.shape[1]
    if h % g or k.shape != (t, g, e) or v.shape != k.shape:
        raise ValueError(f"segment_attention: shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not "
                         "agree")
    if e & (e - 1) or e < 16:
        raise ValueError(f"segment_attention: head_dim {e} must be a power of two >= 16")
    if key_ranges.dtype != torch.int32 or key_ranges.shape != (3, t):
        raise ValueError(f"segment_attention: key_ranges must be int32 [3, {t}]")
    for x in (q, k, v, key_ranges):
        if not x.is_contiguous():
            raise ValueError("segment_attention: every tensor must be contiguous")
    tile = tile or default_tile(e, q.dtype == torch.float32)
    consts = kernel_constexprs(h, g, e, tile, interpreted=not isinstance(segment_attention_kernel, JITFunction))
    out = torch.empty_like(q)
    segment_attention_kernel[(h, triton.cdiv(t, tile.block_m))](
        q, k, v, key_ranges, out, t, scale, **consts, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **COMPILE_OPTIONS)
    return out


def key_mask(key_ranges: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: the keys each row sees under key_ranges."""
    t = key_ranges.shape[1]
    keys = torch.arange(t, device=key_ranges.device)[None, :]
    lo_c, hi_c, lo_s = (x.long()[:, None] for x in key_ranges)
    rows = keys.t()
    return ((keys >= lo_c) & (keys < hi_c)) | ((keys >= lo_s) & (keys <= rows))


def segment_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_ranges: torch.Tensor,
                          scale: float, rows_per_chunk: int = 1024) -> torch.Tensor:
    """Plain torch, same arguments: one dense [T, T] mask from key_ranges (a row with no key: 0),
    rows_per_chunk query rows at a time (each row's answer is its own: the chunks change no value; the
    [H, rows, T] scores stay small: in float64 at W1 x 8, all rows at once took 4 GB)."""
    mask = key_mask(key_ranges)
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[0], rows_per_chunk):
        rows = slice(r0, r0 + rows_per_chunk)
        out[rows] = masked_attention_ref(q[rows], k, v, mask[rows], scale)[0]
    return out
