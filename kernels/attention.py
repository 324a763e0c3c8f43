"""Attention over one part of the keys, returning (out, lse) so that parts can be merged.

Plain-torch references. Shared-prefix attention is two calls merged through their log-sum-exp
(kernels.attention_merge): the prefix/prompt part, whose K/V is stored once and shared by every
sample/beam of a request, and the per-sequence suffix part.

On CUDA, attention over a whole packed batch (Score, BeamSearch prefill) goes through
`biased_attention` instead: torch's fused scaled_dot_product_attention with one additive bias
built once per batch (`attention_bias`), so the [H, T, T] float32 scores of the reference are
never materialised. The C++ runtime calls the same op (cpp_dag/layer_ops.cpp).
"""

from __future__ import annotations

import torch


def _expand_kv(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    # k: [..., G, E] -> [..., H, E]; query head h reads kv head h // (H/G) (HF repeat_kv order).
    # expand + reshape, not repeat_interleave: no host sync, so it can live in a CUDA graph.
    *lead, g, e = k.shape
    return k.unsqueeze(-2).expand(*lead, g, num_heads // g, e).reshape(*lead, num_heads, e)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mask [N, M] or [R, N, M] bool (True = visible) -> additive bias [1 or R, 1, N, M]: 0 where
    visible, -inf elsewhere."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return bias.view(-1, 1, mask.shape[-2], mask.shape[-1])


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Block-diagonal attention: q [R*N, H, E]; k, v [R*N, G, E]; bias [R, 1, N, N] from
    attention_bias (block r: rows r*N ... r*N+N-1 see only keys of the same block, as the bias
    allows; every row must see at least one key). Returns out [R*N, H, E] through torch's fused
    SDPA kernels."""
    h, r, n = q.shape[1], bias.shape[0], bias.shape[-1]
    q4 = q.view(r, n, h, -1).transpose(1, 2)
    k4 = _expand_kv(k, h).view(r, n, h, -1).transpose(1, 2)
    v4 = _expand_kv(v, h).view(r, n, h, -1).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale)
    return out.transpose(1, 2).reshape(q.shape)


def masked_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [N, H, E]; k, v: [M, G, E]; mask: [N, M] bool (True = visible).

    Returns out [N, H, E] (q.dtype) and lse [N, H] float32. A row with no visible key gets
    out = 0 and lse = -inf (it contributes nothing when merged).
    """
    n, h, _ = q.shape
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)
    s = torch.matmul(q.transpose(0, 1), kx.permute(1, 2, 0)).float() * scale  # [H, N, M]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, N]
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~mask, 0.0)  # also clears NaN of empty rows
    out = torch.matmul(p.to(v.dtype), vx.transpose(0, 1))  # [H, N, E]
    return out.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()


def rowwise_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row attends to its own keys: q [N, H, E]; k, v [N, T, G, E] (all T visible).

    The per-beam suffix part of a decode step. Returns out [N, H, E], lse [N, H] float32.
    """
    h = q.shape[1]
    kx, vx = _expand_kv(k, h), _expand_kv(v, h)  # [N, T, H, E]
    s = torch.matmul(q.unsqueeze(2), kx.permute(0, 2, 3, 1)).float() * scale  # [N, H, 1, T]
    lse = torch.logsumexp(s, dim=-1)  # [N, H, 1]
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p.to(v.dtype), vx.transpose(1, 2))  # [N, H, 1, E]
    return out.squeeze(2).contiguous(), lse.squeeze(2).contiguous()
