"""The attention's inputs in one Triton kernel: split the fused q/k/v projection, RMSNorm q and k
per head (Qwen3), apply RoPE to q and k at each token's position, and write q, k, v where the
attention reads them.

qkv [N, (H + 2G) * E] is the q/k/v GEMM's output as it comes (bias included: cuBLASLt adds it in
the GEMM epilogue before the one rounding, so adding it here would round twice and leave the ATen
path). Per token and head the kernel does, in torch's order and roundings (the ATen path's ops,
service.model.layers):
  q/k norm: y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)  (float32 statistics; the sum of
            squares taken in float64, exact for 16-bit inputs of a usual range)
  RoPE:     out = x * cos + rotate_half(x) * sin             (each product and the sum rounded)
  v:        a copy.
The reference is the ATen path of service.model.layers (rms_norm, apply_rope);
tests/kernels/test_qkv_rope.py compares them. cos/sin are the model's whole tables [P, E]; the kernel reads row positions[token] + pos_offset,
so no gathered copy is made (decode step t passes beam_pos and t - 1).

Outputs: q [N, H, E] contiguous; k and v [N, G, E] with one row stride (a multiple of 8 elements):
a fresh [N, G, E], or a decode step's suffix slot `suffix_k[:, t - 1]` of [N, S, G, E].

Program (token tile, head group): BLOCK_T tokens x HB heads of one kind, so a program needs one
branch (q, k or v) and the cos/sin rows it loads serve HB heads. Groups 0..H/HB-1 are q heads,
then G/HB groups of k, then G/HB of v.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS

TILE_ELEMENTS = 4096


def qkv_rope_config(num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """HB: heads per program (the largest power of two dividing G, so a group never mixes q, k
    and v); BLOCK_T: tokens per program, for ~TILE_ELEMENTS elements."""
    hb = num_kv_heads & -num_kv_heads
    return {"HB": hb, "BLOCK_T": max(1, TILE_ELEMENTS // (hb * head_dim)), "num_warps": 4}


@triton.jit
def _rms_norm_halves(x1, x2, w_ptr, eps, E: tl.constexpr):
    # x1, x2: [T, HB, E/2] the two halves of each head's row; torch's rms_norm over E per head
    half = tl.arange(0, E // 2)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # the sum of squares in float64: exact for 16-bit inputs (unless they span > 2^30), so it does not
    # depend on the reduction's order (kernels/decode_attention.py norms the same rows in another
    # layout and must agree)
    d1, d2 = f1.to(tl.float64), f2.to(tl.float64)
    ss = (tl.sum(d1 * d1, axis=2) + tl.sum(d2 * d2, axis=2)).to(tl.float32)
    inv = tl.rsqrt(ss / E + eps)[:, :, None]
    w1 = tl.load(w_ptr + half).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + E // 2 + half).to(tl.float32)[None, None, :]
    y1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    y2 = (w2 * (f2 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
    return y1, y2


@triton.jit
def _rope_halves(x1, x2, c1, c2, s1, s2):
    # x * cos + cat(-x2, x1) * sin with torch's roundings: each product to the dtype, then the sum
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    a1 = (f1 * c1).to(dt).to(tl.float32)
    b1 = (-f2 * s1).to(dt).to(tl.float32)
    a2 = (f2 * c2).to(dt).to(tl.float32)
    b2 = (f1 * s2).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def qkv_rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
                    num_tokens, pos_offset, kv_stride8, eps,
                    H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr,
                    QK_NORM: tl.constexpr):
    group = tl.program_id(1)
    # k/v row stride passed in units of 8 elements: the compiler then knows every row is 16-byte
    # aligned and stores k and v as vectors (an alignment hint on an int argument does not reach AOT)
    kv_row_stride = kv_stride8.to(tl.int64) * 8
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T]
    heads = tl.arange(0, HB)
    half = tl.arange(0, E // 2)
    mask = (toks < num_tokens)[:, None, None]
    inner = heads[None, :, None] * E + half[None, None, :]  # [1, HB, E/2]: a head's half-row within a token
    head0 = group * HB  # first head of the group in qkv's head order (q, then k, then v)
    src = qkv_ptr + toks[:, None, None] * ((H + 2 * G) * E) + head0 * E + inner
    x1 = tl.load(src, mask=mask, other=0.0)  # [T, HB, E/2]
    x2 = tl.load(src + E // 2, mask=mask, other=0.0)
    if head0 >= H + G:  # v
        dst = v_ptr + toks[:, None, None] * kv_row_stride + (head0 - H - G) * E + inner
        tl.store(dst, x1, mask=mask)
        tl.store(dst + E // 2, x2, mask=mask)
    else:
        is_q = head0 < H
        if QK_NORM:
            if is_q:
                x1, x2 = _rms_norm_halves(x1, x2, qw_ptr, eps, E)
            else:
                x1, x2 = _rms_norm_halves(x1, x2, kw_ptr, eps, E)
        pos = tl.load(pos_ptr + toks, mask=toks < num_tokens, other=0) + pos_offset  # [T]
        row = pos[:, None] * E + half[None, :]  # [T, E/2]
        c1 = tl.load(cos_ptr + row).to(tl.float32)[:, None, :]
        c2 = tl.load(cos_ptr + row + E // 2).to(tl.float32)[:, None, :]
        s1 = tl.load(sin_ptr + row).to(tl.float32)[:, None, :]
        s2 = tl.load(sin_ptr + row + E // 2).to(tl.float32)[:, None, :]
        y1, y2 = _rope_halves(x1, x2, c1, c2, s1, s2)
        if is_q:
            dst = q_ptr + toks[:, None, None] * (H * E) + head0 * E + inner
        else:
            dst = k_ptr + toks[:, None, None] * kv_row_stride + (head0 - H) * E + inner
        tl.store(dst, y1, mask=mask)
        tl.store(dst + E // 2, y2, mask=mask)


def _check_kv_out(t: torch.Tensor, n: int, g: int, e: int, qkv: torch.Tensor, what: str) -> None:
    if t.shape != (n, g, e) or t.dtype != qkv.dtype or t.device != qkv.device or t.stride(2) != 1 or t.stride(1) != e:
        raise ValueError(f"qkv_rope: {what} must be [{n}, {g}, {e}] of qkv's dtype and device with contiguous heads "
                         f"(any row stride), got {list(t.shape)} strides {t.stride()} {t.dtype}")


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
             num_kv_heads: int, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             eps: float = 0.0, pos_offset: int = 0, k_out: torch.Tensor | None = None,
             v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (H + 2G) * E] contiguous; positions [N] int64; cos/sin [P, E] (the RoPE tables, qkv's
    dtype); q_norm/k_norm [E] (Qwen3) or None. k_out/v_out: [N, G, E] views to write k and v into
    (one row stride), or None for fresh tensors. Returns q [N, H, E], k, v."""
    n = qkv.shape[0]
    e = cos.shape[-1] if cos.dim() == 2 else -1
    h, g = num_heads, num_kv_heads
    if (qkv.dim() != 2 or not qkv.is_contiguous() or e <= 0 or e & (e - 1) or h % g
            or qkv.shape[1] != (h + 2 * g) * e):
        raise ValueError(f"qkv_rope: qkv must be a contiguous [N, (H + 2G) * E] with E a power of two and G | H; got "
                         f"{list(qkv.shape)}, H {h}, G {g}, cos {list(cos.shape)}")
    if (sin.shape != cos.shape or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype):
        raise ValueError("qkv_rope: cos and sin must be contiguous [P, E] tables of qkv's dtype")
    if positions.shape != (n,) or positions.dtype != torch.int64:
        raise ValueError(f"qkv_rope: positions must be int64 [{n}], got {positions.dtype} {list(positions.shape)}")
    if (q_norm is None) != (k_norm is None) or any(w is not None and w.shape != (e,) for w in (q_norm, k_norm)):
        raise ValueError(f"qkv_rope: q_norm and k_norm must both be [{e}] or both None")
    q = torch.empty(n, h, e, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, g, e, dtype=qkv.dtype, device=qkv.device) if k_out is None else k_out
    v = torch.empty(n, g, e, dtype=qkv.dtype, device=qkv.device) if v_out is None else v_out
    _check_kv_out(k, n, g, e, qkv, "k_out")
    _check_kv_out(v, n, g, e, qkv, "v_out")
    if k.stride(0) != v.stride(0) or k.stride(0) % 8:
        raise ValueError(f"qkv_rope: k_out and v_out must share one row stride, a multiple of 8 elements; got "
                         f"{k.stride(0)} and {v.stride(0)}")
    cfg = qkv_rope_config(g, e)
    has_norm = q_norm is not None
    qkv_rope_kernel[(triton.cdiv(n, cfg["BLOCK_T"]), (h + 2 * g) // cfg["HB"])](
        qkv, positions, cos, sin, q_norm if has_norm else qkv, k_norm if has_norm else qkv, q, k, v,
        n, pos_offset, k.stride(0) // 8, eps, H=h, G=g, E=e, HB=cfg["HB"], BLOCK_T=cfg["BLOCK_T"], QK_NORM=has_norm,
        num_warps=cfg["num_warps"], **COMPILE_OPTIONS)
    return q, k, v

