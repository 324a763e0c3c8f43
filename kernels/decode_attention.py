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
BEAMS beams is a key block too, each row seeing only its own beam's key.

A beam's suffix is not copied when beams are reordered: `suffix_rows` [N, S] names, per packed row
and slot, the row whose cache holds that slot of the row's beam (its ancestor's at that step). A
step writes its k/v into the row's own slot, which no later step overwrites, and the beam step
hands each new beam its parent's `suffix_rows` (kernels/beam_topk.py beam_commit), so the step's
reorder is N x S indices instead of every layer's suffix K/V: at W5's 400 beams of qwen3-0.6b the
gather it replaces moved 367 MB (287 us on an H100) a step. float32 inputs are
multiplied in float32 (IEEE), never TF32: float32 on CUDA must stay within 3e-4 of Hugging Face
run in float64.

Work per call: one pass over a request's prompt per (tile, KV head) instead of per (beam row, KV
head) — at W2 (100 beams, 7 query heads a KV head, BLOCK_M 64: 9 beams a tile, 12 tiles a
request) ~8x fewer K/V reads, as 64-row MMAs instead of 16-row ones 7/16 used.

The runtimes call it as `decode_attention_qkv`, from the q/k/v GEMM's output: the program's
prologue does kernels/qkv_rope.py's work for what it reads (its q rows, and its beams' k and v of
head g, normed for Qwen3 and rotated, element for element as qkv_rope does) and writes the step's
k and v into their suffix slot; one launch a layer instead of two (2026-12-05). `decode_attention`
takes q as qkv_rope leaves it (benchmarks and tests).
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
def _roped(qkv_ptr, rows, heads, ok, pos, cos_ptr, sin_ptr, w_ptr, eps, H: tl.constexpr, G: tl.constexpr,
           E: tl.constexpr, QK_NORM: tl.constexpr):
    """[M, E]: row rows[m] of head heads[m] (qkv's head order: the q heads, then k, then v) of the
    q/k/v GEMM's output, normed per head (QK_NORM, Qwen3) and rotated at position pos[m]: kernels/
    qkv_rope.py's arithmetic, element for element (each column next to its rotate_half partner)."""
    d = tl.arange(0, E)
    partner = (d + E // 2) % E
    src = qkv_ptr + (rows * ((H + 2 * G) * E) + heads * E)[:, None]
    x = tl.load(src + d[None, :], mask=ok[:, None], other=0.0)
    dt = x.dtype
    fx = x.to(tl.float32)
    fp = tl.load(src + partner[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if QK_NORM:  # squares summed in float64: exact for 16-bit inputs (unless they span > 2^30), so in any
        # order the sum qkv_rope takes
        wide = fx.to(tl.float64)
        inv = tl.rsqrt(tl.sum(wide * wide, axis=1).to(tl.float32) / E + eps)[:, None]
        fx = (tl.load(w_ptr + d).to(tl.float32)[None, :] * (fx * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        fp = (tl.load(w_ptr + partner).to(tl.float32)[None, :] * (fp * inv).to(dt).to(tl.float32)).to(dt) \
            .to(tl.float32)
    table = pos[:, None] * E + d[None, :]
    c = tl.load(cos_ptr + table, mask=ok[:, None], other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + table, mask=ok[:, None], other=0.0).to(tl.float32)
    rot = tl.where((d < E // 2)[None, :], -fp, fp)  # rotate_half: (-x2, x1)
    return ((fx * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def decode_attention_kernel(q_ptr, pk_ptr, pv_ptr, start_ptr, len_ptr, sk_ptr, sv_ptr, sr_ptr, out_ptr, pos_ptr, cos_ptr,
                            sin_ptr, qw_ptr, kw_ptr, num_rows, num_slots, num_suffix, pos_offset, scale, eps,
                            H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, QPG: tl.constexpr,
                            BEAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_B: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                            INTERPRETED: tl.constexpr):
    """ROPE: q_ptr is the q/k/v GEMM's output [N, (H + 2G) * E]; the program norms (QK_NORM) and
    rotates its q rows and its beams' k of head g at positions pos + pos_offset and writes its
    beams' k and v of head g into suffix slot num_suffix - 1 (qkv_rope and the attention in one
    launch). Else q_ptr is q [N, H, E]. Either way every suffix slot is read from the cache, slot j
    of row r from row sr_ptr[r, j] (its beam's ancestor at step j; the row itself for the slot this
    step writes)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    # matrix row m = (beam m // QPG of the tile, query head g * QPG + m % QPG); BLOCK_M >= BEAMS * QPG.
    # int32 offsets (every buffer here has < 2^31 elements), recomputed where used: registers are scarce
    m = tl.arange(0, BLOCK_M)
    row = tile * BEAMS + m // QPG
    is_row = (m < BEAMS * QPG) & (row < num_rows)
    dims = tl.arange(0, E)
    b = tl.arange(0, BLOCK_B)  # the suffix key blocks: the tile's beams
    b_row = tile * BEAMS + b
    b_ok = (b < BEAMS) & (b_row < num_rows)
    if ROPE:
        pos = tl.load(pos_ptr + row, mask=is_row, other=0) + pos_offset
        q = _roped(q_ptr, row, g * QPG + m % QPG, is_row, pos, cos_ptr, sin_ptr, qw_ptr, eps, H, G, E, QK_NORM)
        b_pos = tl.load(pos_ptr + b_row, mask=b_ok, other=0) + pos_offset
        k_new = _roped(q_ptr, b_row, H + g, b_ok, b_pos, cos_ptr, sin_ptr, kw_ptr, eps, H, G, E, QK_NORM)
        v_new = tl.load(q_ptr + (b_row * ((H + 2 * G) * E) + (H + G + g) * E)[:, None] + dims[None, :],
                        mask=b_ok[:, None], other=0.0)
        slot = ((b_row * num_slots + num_suffix - 1) * G + g)[:, None] * E + dims[None, :]
        tl.store(sk_ptr + slot, k_new, mask=b_ok[:, None])
        tl.store(sv_ptr + slot, v_new, mask=b_ok[:, None])
        # the suffix loop reads them back with the other slots (this program's threads wrote them: a
        # barrier makes them visible), so that they hold no registers through the prompt loop
        tl.debug_barrier()
    else:
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
    own = (m // QPG)[:, None] == b[None, :]
    j = 0
    while j < num_suffix:
        src = tl.load(sr_ptr + b_row * num_slots + j, mask=b_ok, other=0).to(tl.int32)
        offs = ((src * num_slots + j) * G + g)[:, None] * E + dims[None, :]
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


def kernel_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, tile: Tile, interpreted: bool = False,
                      rope: bool = False, qk_norm: bool = False) -> dict[str, int | bool]:
    """The kernel's constexprs for one head layout (the launcher and kernels/aot.py share them):
    BEAMS whole beams of QPG query rows each fill at most block_m rows; a suffix key block holds
    BLOCK_B >= BEAMS keys (one per beam; an MMA needs >= 16). rope: the kernel takes the q/k/v GEMM's
    output (decode_attention_qkv); qk_norm: with Qwen3's q/k norms."""
    qpg = num_heads // num_kv_heads
    if qpg > tile.block_m:
        raise ValueError(f"decode_attention: {qpg} query heads per KV head exceed block_m {tile.block_m}")
    beams = tile.block_m // qpg
    return {"H": num_heads, "G": num_kv_heads, "E": head_dim, "QPG": qpg, "BEAMS": beams, "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n, "BLOCK_B": max(16, triton.next_power_of_2(beams)), "ROPE": rope,
            "QK_NORM": qk_norm, "INTERPRETED": interpreted}


def _check_cache(n: int, g: int, e: int, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                 kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                 suffix_rows: torch.Tensor) -> None:
    if (prompt_k.dim() != 3 or prompt_k.shape[1:] != (g, e) or prompt_v.shape != prompt_k.shape
            or suffix_k.dim() != 4 or suffix_k.shape[0] != n or suffix_k.shape[2:] != (g, e)
            or suffix_v.shape != suffix_k.shape):
        raise ValueError(f"decode_attention: shapes prompt_k {list(prompt_k.shape)}, suffix_k {list(suffix_k.shape)} "
                         f"do not agree with {n} rows, {g} KV heads of {e}")
    if not 1 <= num_suffix <= suffix_k.shape[1]:
        raise ValueError(f"decode_attention: num_suffix {num_suffix} outside [1, {suffix_k.shape[1]}]")
    if e & (e - 1) or e < 16:
        raise ValueError(f"decode_attention: head_dim {e} must be a power of two >= 16")
    if kv_start.dtype != torch.int64 or kv_len.dtype != torch.int64 or kv_start.shape != (n,) or kv_len.shape != (n,):
        raise ValueError("decode_attention: kv_start and kv_len must be int64 [N]")
    if suffix_rows.dtype != torch.int64 or suffix_rows.shape != suffix_k.shape[:2]:
        raise ValueError(f"decode_attention: suffix_rows must be int64 {list(suffix_k.shape[:2])}, got "
                         f"{list(suffix_rows.shape)} {suffix_rows.dtype}")
    for t in (prompt_k, prompt_v, suffix_k, suffix_v, kv_start, kv_len, suffix_rows):
        if not t.is_contiguous():
            raise ValueError("decode_attention: every tensor must be contiguous")


def own_suffix_rows(num_rows: int, num_slots: int, device: torch.device | str) -> torch.Tensor:
    """suffix_rows [N, S] int64 where every row's slots are its own (before any reorder)."""
    return torch.arange(num_rows, dtype=torch.int64, device=device).unsqueeze(1).expand(num_rows, num_slots).contiguous()


def _launch(q: torch.Tensor, num_heads: int, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
            kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, suffix_rows: torch.Tensor,
            num_suffix: int, scale: float, tile: Tile | None, positions: torch.Tensor | None = None, pos_offset: int = 0,
            cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
            k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """q: q [N, H, E], or with positions (and the RoPE tables) the q/k/v GEMM's output (ROPE)."""
    n, g, e = q.shape[0], prompt_k.shape[1], prompt_k.shape[2]
    tile = tile or default_tile(e, q.dtype == torch.float32)
    rope, qk_norm = positions is not None, q_norm is not None
    consts = kernel_constexprs(num_heads, g, e, tile, interpreted=not isinstance(decode_attention_kernel, JITFunction),
                               rope=rope, qk_norm=qk_norm)
    out = torch.empty(n, num_heads, e, dtype=q.dtype, device=q.device)
    unused = q  # the pointers a variant never reads
    decode_attention_kernel[(triton.cdiv(n, consts["BEAMS"]), g)](
        q, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, suffix_rows, out, positions if rope else kv_start,
        cos if rope else unused, sin if rope else unused, q_norm if qk_norm else unused,
        k_norm if qk_norm else unused, n, suffix_k.shape[1], num_suffix, pos_offset, scale, eps,
        **consts, num_warps=tile.num_warps, num_stages=tile.num_stages, **COMPILE_OPTIONS)
    return out


def decode_attention(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                     kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                     scale: float, tile: Tile | None = None, suffix_rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, E]; prompt_k/v [P, G, E]; kv_start/kv_len [N] int64: row n's prompt keys are
    prompt_k[kv_start[n] : kv_start[n] + kv_len[n]] (kv_len 0: none); suffix_k/v [N, S, G, E] of
    which the first num_suffix (>= 1) slots are live, slot j of row n at row suffix_rows[n, j]
    ([N, S] int64; None: every row's own). Returns out [N, H, E] (q.dtype).
    Fast when the rows sharing a prompt range are consecutive (a request's beams). tile: None for
    default_tile (what kernels/aot.py compiles)."""
    n, h, e = q.shape
    if h % prompt_k.shape[1] or prompt_k.shape[2] != e or not q.is_contiguous():
        raise ValueError(f"decode_attention: shapes q {list(q.shape)}, prompt_k {list(prompt_k.shape)}, "
                         f"suffix_k {list(suffix_k.shape)} do not agree")
    if suffix_rows is None:
        suffix_rows = own_suffix_rows(n, suffix_k.shape[1], q.device)
    _check_cache(n, prompt_k.shape[1], e, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, num_suffix,
                 suffix_rows)
    return _launch(q, h, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, suffix_rows, num_suffix, scale, tile)


def decode_attention_qkv(qkv: torch.Tensor, positions: torch.Tensor, pos_offset: int, cos: torch.Tensor,
                         sin: torch.Tensor, num_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                         eps: float, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                         kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                         scale: float, tile: Tile | None = None, suffix_rows: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """A decode step's attention from the q/k/v GEMM's output, kernels/qkv_rope.py's work included:
    qkv [N, (H + 2G) * E]; positions [N] int64 (+ pos_offset: the rows' RoPE positions); cos/sin
    [P, E] (the model's tables, qkv's dtype); q_norm/k_norm [E] (Qwen3) or None. Each row's k and v
    go into suffix slot num_suffix - 1 (as qkv_rope(..., k_out=suffix_k[:, num_suffix - 1]) puts
    them: the row's own slot, so suffix_rows[:, num_suffix - 1] must be each row itself), then the
    attention as decode_attention's. Returns out [N, H, E]; equal to qkv_rope followed by
    decode_attention (bit for bit in 16 bits: the q/k norm sums squares in float64)."""
    n = qkv.shape[0]
    g, e = prompt_k.shape[1], prompt_k.shape[2]
    if (qkv.dim() != 2 or not qkv.is_contiguous() or num_heads % g or qkv.shape[1] != (num_heads + 2 * g) * e
            or prompt_k.dtype != qkv.dtype):
        raise ValueError(f"decode_attention_qkv: qkv must be a contiguous [N, (H + 2G) * E] of the cache's dtype; got "
                         f"{list(qkv.shape)} {qkv.dtype}, H {num_heads}, prompt_k {list(prompt_k.shape)}")
    if positions.shape != (n,) or positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError(f"decode_attention_qkv: positions must be a contiguous int64 [{n}]")
    if (cos.dim() != 2 or cos.shape[1] != e or sin.shape != cos.shape or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype):
        raise ValueError("decode_attention_qkv: cos and sin must be contiguous [P, E] tables of qkv's dtype")
    if (q_norm is None) != (k_norm is None) or any(w is not None and w.shape != (e,) for w in (q_norm, k_norm)):
        raise ValueError(f"decode_attention_qkv: q_norm and k_norm must both be [{e}] or both None")
    if suffix_rows is None:
        suffix_rows = own_suffix_rows(n, suffix_k.shape[1], qkv.device)
    _check_cache(n, g, e, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, num_suffix, suffix_rows)
    return _launch(qkv, num_heads, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, suffix_rows, num_suffix,
                   scale, tile, positions, pos_offset, cos, sin, q_norm, k_norm, eps)


def decode_attention_ref(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                         kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                         scale: float, suffix_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, same arguments: the prompt part over a dense [N, P] mask built from
    kv_start/kv_len, the suffix part per row (slot j from row suffix_rows[:, j]), merged through
    their log-sum-exp."""
    if suffix_rows is not None:  # each row's own beam's slots, gathered
        slots = torch.arange(num_suffix, device=suffix_k.device)
        idx = suffix_rows[:, :num_suffix]
        suffix_k, suffix_v = suffix_k[idx, slots], suffix_v[idx, slots]  # [N, num_suffix, G, E]
    keys = torch.arange(prompt_k.shape[0], device=q.device)
    mask = (keys[None, :] >= kv_start[:, None]) & (keys[None, :] < (kv_start + kv_len)[:, None])  # [N, P]
    out_a, lse_a = masked_attention_ref(q, prompt_k, prompt_v, mask, scale)
    out_b, lse_b = rowwise_attention_ref(q, suffix_k[:, :num_suffix], suffix_v[:, :num_suffix], scale)
    return merge_attention_states_ref(out_a, lse_a, out_b, lse_b)[0]
