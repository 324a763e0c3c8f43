"""One BeamSearch decode step's attention in one Triton kernel.

Each beam row attends to two parts: its request's prompt K/V (a contiguous range of the packed
prompts, stored once and shared by all the request's beams) and its own suffix K/V (one slot per
generated token). The reference does this in ~25 ATen kernels over a dense [rows, prompt tokens]
mask and merges the two parts through their log-sum-exp (kernels.attention +
kernels.attention_merge); here one program per (row, KV head) streams only the row's own prompt
range and suffix slots with an online softmax in float32, for the H/G query heads that share the
KV head (GQA). Not yet called by the runtimes (see kernels/norm_act.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attend(q, k, v, kmask, m_i, l_i, acc, scale):
    """One online-softmax step of the queries q [BQ, E] over keys k / values v [BN, E] (kmask: live keys)."""
    s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
    s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
    return m_new, l_i, acc


@triton.jit
def decode_attention_kernel(q_ptr, pk_ptr, pv_ptr, start_ptr, len_ptr, sk_ptr, sv_ptr, out_ptr,
                            num_slots, num_suffix, scale,
                            H: tl.constexpr, G: tl.constexpr, E: tl.constexpr, QPG: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    heads = g * QPG + tl.arange(0, BLOCK_Q)  # the query heads reading KV head g
    hmask = tl.arange(0, BLOCK_Q) < QPG
    dims = tl.arange(0, E)
    q = tl.load(q_ptr + (row * H + heads)[:, None] * E + dims[None, :], mask=hmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, E], tl.float32)

    start = tl.load(start_ptr + row).to(tl.int64)
    length = tl.load(len_ptr + row).to(tl.int64)
    n0 = 0
    while n0 < length:  # the request's prompt keys
        keys = n0 + tl.arange(0, BLOCK_N)
        kmask = keys < length
        offs = ((start + keys) * G + g)[:, None] * E + dims[None, :]
        k = tl.load(pk_ptr + offs, mask=kmask[:, None], other=0.0)
        v = tl.load(pv_ptr + offs, mask=kmask[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, kmask, m_i, l_i, acc, scale)
        n0 += BLOCK_N

    slots = tl.arange(0, BLOCK_S)  # this row's own suffix keys (the first num_suffix slots)
    smask = slots < num_suffix
    offs = ((row * num_slots + slots) * G + g)[:, None] * E + dims[None, :]
    k = tl.load(sk_ptr + offs, mask=smask[:, None], other=0.0)
    v = tl.load(sv_ptr + offs, mask=smask[:, None], other=0.0)
    m_i, l_i, acc = _attend(q, k, v, smask, m_i, l_i, acc, scale)

    out = acc / l_i[:, None]
    tl.store(out_ptr + (row * H + heads)[:, None] * E + dims[None, :], out.to(q.dtype), mask=hmask[:, None])


def decode_attention(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
                     kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int,
                     scale: float, block_n: int = 64) -> torch.Tensor:
    """q [N, H, E]; prompt_k/v [P, G, E]; kv_start/kv_len [N]: row n's prompt keys are
    prompt_k[kv_start[n] : kv_start[n] + kv_len[n]]; suffix_k/v [N, S, G, E] of which the first
    num_suffix (>= 1) slots are live. Returns out [N, H, E] (q.dtype)."""
    n, h, e = q.shape
    g = prompt_k.shape[1]
    if h % g or prompt_k.shape[2] != e or suffix_k.shape[0] != n or suffix_k.shape[2:] != (g, e):
        raise ValueError(f"decode_attention: shapes q {list(q.shape)}, prompt_k {list(prompt_k.shape)}, "
                         f"suffix_k {list(suffix_k.shape)} do not agree")
    if not 1 <= num_suffix <= suffix_k.shape[1]:
        raise ValueError(f"decode_attention: num_suffix {num_suffix} outside [1, {suffix_k.shape[1]}]")
    if e & (e - 1) or e < 16:
        raise ValueError(f"decode_attention: head_dim {e} must be a power of two >= 16")
    for t in (q, prompt_k, prompt_v, suffix_k, suffix_v):
        if not t.is_contiguous():
            raise ValueError("decode_attention: every tensor must be contiguous")
    qpg = h // g
    out = torch.empty_like(q)
    decode_attention_kernel[(n, g)](q, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, out,
                                    suffix_k.shape[1], num_suffix, scale, H=h, G=g, E=e, QPG=qpg,
                                    BLOCK_Q=max(16, triton.next_power_of_2(qpg)), BLOCK_N=block_n,
                                    BLOCK_S=max(16, triton.next_power_of_2(suffix_k.shape[1])))
    return out
