"""One BeamSearch decode step's attention in one Triton kernel, beams of a request as one matrix.

Each beam row attends to two parts: its request's prompt K/V (a contiguous range of the packed
prompts, stored once and shared by all the request's beams) and its own suffix K/V (one slot per
generated token). The reference does this in ~25 ATen kernels over a dense [rows, prompt tokens]
mask and merges the two parts through their log-sum-exp (kernels.attention +
kernels.attention_merge).

Here one program takes a tile of BEAMS consecutive beam rows and one KV head g: its query matrix
is (BEAMS beams x the QPG query heads reading g) x E, BLOCK_M rows in all. Beams of a request are
consecutive rows (row = request * B + beam), so a tile's rows share one prompt range (two where a
tile straddles two requests; each row keys only its own): the prompt K/V is read once per tile
and multiplied on the tensor cores, BLOCK_N keys at a time, with an online softmax in float32.
The suffix slots follow in the same online softmax, one slot at a time: slot j of the tile's
BEAMS beams is a key block too, each row seeing only its own beam's key. float32 inputs are
multiplied in float32 (IEEE), never TF32: float32 on CUDA must stay within 3e-4 of Hugging Face
run in float64.

Work per call: one pass over a request's prompt per (tile, KV head) instead of per (beam row, KV
head) — at W2 (100 beams, 7 query heads a KV head, BLOCK_M 64: 9 beams a tile, 12 tiles a
request) ~8x fewer K/V reads, as 64-row MMAs instead of 16-row ones 7/16 used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import COMPILE_OPTIONS
from .attention import masked_attention_ref, rowwise_attention_ref
from .attention_merge import merge_attention_states_ref


@triton.jit
def _mma(a, b, acc, INTERPRETED: tl.constexpr):
    """a @ b (+ acc) in float32; float32 inputs as IEEE float32, never TF32. Triton 3.6's
    interpreter multiplies bfloat16 operands as their raw uint16 bits: there, the same exact
    products from float32 copies."""
    if INTERPRETED:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, INTERPRETED: tl.constexpr):
    """One online-softmax step of the queries q [M, E] over a key block k / v [N, E], row m seeing
    the keys where visible [M, N]. Scores in the log2 domain; state m_i, l_i [M], acc [M, E]
    float32. A row that has seen no key yet keeps m = -inf, l = 0, acc = 0 (no -inf - -inf NaN)."""
    s = tl.where(visible, _mma(q, tl.trans(k), None, INTERPRETED) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], INTERPRETED)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _prompt_block(q, pk_ptr, pv_ptr, n0, hi, r_start, r_end, g, m_i, l_i, acc, qk_scale,
                  G: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """Prompt keys n0 .. n0+BLOCK_N-1 (< hi) of KV head g; row m sees r_start[m] <= key < r_end[m]."""
    keys = n0 + tl.arange(0, BLOCK_N)
    offs = (keys * G + g)[:, None] * E + tl.arange(0, E)[None, :]
    k = tl.load(pk_ptr + offs, mask=(keys < hi)[:, None], other=0.0)  # [BLOCK_N, E]
    v = tl.load(pv_ptr + offs, mask=(keys < hi)[:, None], other=0.0)
    visible = (keys[None, :] >= r_start[:, None]) & (keys[None, :] < r_end[:, None])
    return _attend(q, k, v, visible, m_i, l_i, acc, qk_scale, INTERPRETED)


@triton.jit
def decode_attention_kernel(q_ptr, pk_ptr, pv_ptr, start_ptr, len_ptr, sk_ptr, sv_ptr, out_ptr,
                            num_rows, num_slots, num_suffix, scale,
                            H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, QPG: tl.constexpr,
                            BEAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_B: tl.constexpr, INTERPRETED: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    # matrix row m = (beam m // QPG of the tile, query head g * QPG + m % QPG); BLOCK_M >= BEAMS * QPG.
    # int32 offsets (every buffer here has < 2^31 elements), recomputed where used: registers are scarce
    m = tl.arange(0, BLOCK_M)
    row = tile * BEAMS + m // QPG
    is_row = (m < BEAMS * QPG) & (row < num_rows)
    dims = tl.arange(0, E)
    q_rows = (row * H + g * QPG + m % QPG) * E
    q = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=is_row[:, None], other=0.0)  # [BLOCK_M, E]
    qk_scale = scale * 1.4426950408889634  # scores in the log2 domain: exp(x) = exp2(x * log2(e))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, E], tl.float32)

    # 1. the prompt keys: the union of the tile's rows' ranges (rows with no prompt left out)
    r_start = tl.load(start_ptr + row, mask=is_row, other=0).to(tl.int32)
    r_end = r_start + tl.load(len_ptr + row, mask=is_row, other=0).to(tl.int32)
    has_prompt = r_end > r_start
    hi = tl.max(tl.where(has_prompt, r_end, 0), axis=0)
    lo = tl.min(tl.where(has_prompt, r_start, hi), axis=0)  # lo == hi == 0: no prompt in the tile
    if not INTERPRETED:  # a for loop: Triton software-pipelines the K/V loads across iterations
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _prompt_block(q, pk_ptr, pv_ptr, n0, hi, r_start, r_end, g, m_i, l_i, acc, qk_scale,
                                          G, E, BLOCK_N, INTERPRETED)
    else:  # Triton 3.6's interpreter (numpy >= 2.3) cannot bound a range() by a tensor; same body
        n0 = lo
        while n0 < hi:
            m_i, l_i, acc = _prompt_block(q, pk_ptr, pv_ptr, n0, hi, r_start, r_end, g, m_i, l_i, acc, qk_scale,
                                          G, E, BLOCK_N, INTERPRETED)
            n0 += BLOCK_N

    # 2. the suffix slots 0 .. num_suffix-1: slot j of the tile's beams [BLOCK_B, E], row m sees its beam's
    b = tl.arange(0, BLOCK_B)
    b_row = tile * BEAMS + b
    b_ok = (b < BEAMS) & (b_row < num_rows)
    own = (m // QPG)[:, None] == b[None, :]
    j = 0
    while j < num_suffix:
        offs = ((b_row * num_slots + j) * G + g)[:, None] * E + dims[None, :]
        k = tl.load(sk_ptr + offs, mask=b_ok[:, None], other=0.0)
        v = tl.load(sv_ptr + offs, mask=b_ok[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, own, m_i, l_i, acc, qk_scale, INTERPRETED)
        j += 1

    out = acc / l_i[:, None]  # l_i >= 1 on every real row: it sees at least its first suffix key
    q_rows = (row * H + g * QPG + m % QPG) * E
    tl.store(out_ptr + q_rows[:, None] + dims[None, :], out.to(q.dtype), mask=is_row[:, None])


@dataclass(frozen=True)
class Tile:
    """The launch tile: BLOCK_M query rows, BLOCK_N prompt keys a step, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n):
            if v & (v - 1) or v < 16:
                raise ValueError(f"decode_attention: tile sizes must be powers of two >= 16, got {self}")


def default_tile(head_dim: int, is_float32: bool) -> Tile:
    """bf16/fp16: 64-row MMA tiles (one warpgroup's wgmma). float32 multiplies in IEEE float32 on the
    FMA units: its larger tiles spill registers (ptxas, sm_90a), 16 x 32 does not. To tune on the H200
    (python -m ops.bench.bench_kernels)."""
    if is_float32:
        return Tile(16, 32, 4 if head_dim <= 64 else 8, 2)
    return Tile(64, 64, 4, 3)


def kernel_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, tile: Tile,
                      interpreted: bool = False) -> dict[str, int | bool]:
    """The kernel's constexprs for one head layout (the launcher and kernels/aot.py share them):
    BEAMS whole beams of QPG query rows each fill at most block_m rows; a suffix key block holds
    BLOCK_B >= BEAMS keys (one per beam; an MMA needs >= 16)."""
    qpg = num_heads // num_kv_heads
    if qpg > tile.block_m:
        raise ValueError(f"decode_attention: {qpg} query heads per KV head exceed block_m {tile.block_m}")
    beams = tile.block_m // qpg
    return {"H": num_heads, "G": num_kv_heads, "E": head_dim, "QPG": qpg, "BEAMS": beams, "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n, "BLOCK_B": max(16, triton.next_power_of_2(beams)), "INTERPRETED": interpreted}


def decode_attention(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                     kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                     scale: float, tile: Tile | None = None) -> torch.Tensor:
    """q [N, H, E]; prompt_k/v [P, G, E]; kv_start/kv_len [N] int64: row n's prompt keys are
    prompt_k[kv_start[n] : kv_start[n] + kv_len[n]] (kv_len 0: none); suffix_k/v [N, S, G, E] of
    which the first num_suffix (>= 1) slots are live. Returns out [N, H, E] (q.dtype).
    Fast when the rows sharing a prompt range are consecutive (a request's beams). tile: None for
    default_tile (what kernels/aot.py compiles)."""
    n, h, e = q.shape
    g = prompt_k.shape[1]
    if (h % g or prompt_k.shape[2] != e or prompt_v.shape != prompt_k.shape or suffix_k.shape[0] != n
            or suffix_k.shape[2:] != (g, e) or suffix_v.shape != suffix_k.shape):
        raise ValueError(f"decode_attention: shapes q {list(q.shape)}, prompt_k {list(prompt_k.shape)}, "
                         f"suffix_k {list(suffix_k.shape)} do not agree")
    if not 1 <= num_suffix <= suffix_k.shape[1]:
        raise ValueError(f"decode_attention: num_suffix {num_suffix} outside [1, {suffix_k.shape[1]}]")
    if e & (e - 1) or e < 16:
        raise ValueError(f"decode_attention: head_dim {e} must be a power of two >= 16")
    if kv_start.dtype != torch.int64 or kv_len.dtype != torch.int64 or kv_start.shape != (n,) or kv_len.shape != (n,):
        raise ValueError("decode_attention: kv_start and kv_len must be int64 [N]")
    for t in (q, prompt_k, prompt_v, suffix_k, suffix_v, kv_start, kv_len):
        if not t.is_contiguous():
            raise ValueError("decode_attention: every tensor must be contiguous")
    tile = tile or default_tile(e, q.dtype == torch.float32)
    consts = kernel_constexprs(h, g, e, tile, interpreted=not isinstance(decode_attention_kernel, JITFunction))
    out = torch.empty_like(q)
    decode_attention_kernel[(triton.cdiv(n, consts["BEAMS"]), g)](
        q, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, out, n, suffix_k.shape[1], num_suffix, scale,
        **consts, num_warps=tile.num_warps, num_stages=tile.num_stages, **COMPILE_OPTIONS)
    return out


def decode_attention_ref(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                         kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                         scale: float) -> torch.Tensor:
    """Plain torch, same arguments: the prompt part over a dense [N, P] mask built from
    kv_start/kv_len, the suffix part per row, merged through their log-sum-exp."""
    keys = torch.arange(prompt_k.shape[0], device=q.device)
    mask = (keys[None, :] >= kv_start[:, None]) & (keys[None, :] < (kv_start + kv_len)[:, None])  # [N, P]
    out_a, lse_a = masked_attention_ref(q, prompt_k, prompt_v, mask, scale)
    out_b, lse_b = rowwise_attention_ref(q, suffix_k[:, :num_suffix], suffix_v[:, :num_suffix], scale)
    return merge_attention_states_ref(out_a, lse_a, out_b, lse_b)[0]
