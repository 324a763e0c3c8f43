"""Attention over one part of the keys, returning (out, lse) so that parts can be merged.

Shared-prefix attention is two calls merged through their log-sum-exp (kernels.attention_merge):
the prefix/prompt part, whose K/V is stored once and shared by every sample/beam of a request, and
the per-sequence part.

On CUDA, Score and BeamSearch-prefill attention is `varlen_attention`: FlashAttention's varlen
kernel (ATen's `_flash_attention_forward`, GQA without expanding K/V) over packed segments whose
boundaries `segment_bounds` computes on the device from the segment ids, with static shapes (a
fixed number of segments per bucket, unused ones zero-length) so it can live in a CUDA graph. Each
sample attends causally to itself; a sample after a shared prefix also attends to its request's
prefix, a second varlen call merged by log-sum-exp. The work is the sum over samples of
(prefix * s + s^2 / 2), not L^2 per request block. The C++ runtime calls the same ATen ops
(cpp_dag/layer_ops.cpp), so the two runtimes stay byte-identical. The plain-torch references
below are what the CPU runs and what the CUDA path is tested against.

With the fused kernels (--kernels triton) the same attention is one Triton kernel instead
(kernels/segment_attention.py), over each row's key ranges from `segment_key_ranges`.
"""

from __future__ import annotations

import torch


def _expand_kv(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    # k: [..., G, E] -> [..., H, E]; query head h reads kv head h // (H/G) (HF repeat_kv order).
    # expand + reshape, not repeat_interleave: no host sync, so it can live in a CUDA graph.
    *lead, g, e = k.shape
    return k.unsqueeze(-2).expand(*lead, g, num_heads // g, e).reshape(*lead, num_heads, e)


def segment_bounds(seg: torch.Tensor, num_segments: int, pad_chunk: int = 0) -> torch.Tensor:
    """cu_seqlens [num_segments + 1] int32 of the runs of equal ids in seg [T] (with pad_chunk > 0, a
    padding run (ids < 0) also ends at every multiple of pad_chunk, so no run is longer than the
    longest real segment once pad_chunk bounds it); entries past the last run are T (zero-length
    segments). Static shapes and no host sync; num_segments must bound the number of runs."""
    t = seg.shape[0]
    rows = torch.arange(t, device=seg.device)
    first = torch.ones(1, dtype=torch.bool, device=seg.device)
    starts = torch.cat([first, seg[1:].ne(seg[:-1])])
    if pad_chunk > 0:
        starts = starts.logical_or(seg.lt(0).logical_and(rows.remainder(pad_chunk).eq(0)))
    index = starts.cumsum(0).sub(1)  # [T]: each row's run
    bounds = torch.full((num_segments + 1,), t, dtype=torch.int32, device=seg.device)
    return bounds.scatter_reduce(0, index, rows.to(torch.int32), "amin")


def segment_key_ranges(seg: torch.Tensor, ctx: torch.Tensor | None = None, request_rows: torch.Tensor | None = None,
                       prefix_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The key ranges of kernels/segment_attention.py: [3, T] int32 for the packed segments seg [T]
    (ids, each segment's differing from its neighbours'; < 0: padding), on seg's device with static
    shapes and no host sync. Row t sees keys [out[0, t], out[1, t]) (its prefix) and [out[2, t], t]
    (its own segment, causal); a padding row's out[2, t] is t + 1 (no key).

    Score (service/runtime/batch.py): ctx [T] is a sample's prefix segment id (< 0: none);
    request_rows [R+1] each request's first row, then T; prefix_rows [R] each request's prefix
    length: a sample's prefix is its request's first prefix_rows rows. BeamSearch prefill (ctx
    None): no row has a prefix. cpp_dag/layer_ops.cpp::segment_key_ranges mirrors it op for op."""
    t = seg.shape[0]
    rows = torch.arange(t, device=seg.device)
    first = torch.ones(1, dtype=torch.bool, device=seg.device)
    starts = torch.cat([first, seg[1:].ne(seg[:-1])])
    run_start = rows.mul(starts).cummax(0)[0]  # each row's run's first row
    self_start = torch.where(seg.ge(0), run_start, rows.add(1))
    if ctx is None:
        prefix_start = prefix_end = torch.zeros_like(rows)
    else:
        assert request_rows is not None and prefix_rows is not None
        request = torch.searchsorted(request_rows[1:].contiguous(), rows, right=True)  # [T]: each row's request
        has_prefix = ctx.ge(0)
        prefix_start = request_rows.index_select(0, request).mul(has_prefix)  # the request's first row
        prefix_end = prefix_start.add(prefix_rows.index_select(0, request).mul(has_prefix))
    return torch.stack([prefix_start, prefix_end, self_start]).to(torch.int32)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, causal: bool, scale: float,
                     seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA only. q [N, H, E]; k, v [M, G, E]; segment i: queries cu_q[i]..cu_q[i+1], keys from
    cu_k[i] (cu_k[i+1] - cu_k[i] of them, or seqused_k[i] when given); causal aligns the last query
    with the last key. Returns out [N, H, E] and lse [N, H] float32 (a row with no keys: out 0; its
    lse is not -inf, so callers mask it)."""
    out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                       scale=scale, seqused_k=seqused_k)[:2]
    return out, lse.t()


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                         causal: bool, scale: float,
                         seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """varlen_attention in plain torch, segment by segment (rows outside every segment, and rows
    with no keys: out 0, lse -inf)."""
    n, h, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(cu_q.shape[0] - 1):
        q0, q1, k0 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
        k1 = k0 + int(seqused_k[i]) if seqused_k is not None else int(cu_k[i + 1])
        if q1 == q0 or k1 == k0:
            continue
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device)
        if causal:  # bottom-right aligned
            mask = mask.tril(diagonal=(k1 - k0) - (q1 - q0))
        out[q0:q1], lse[q0:q1] = masked_attention_ref(q[q0:q1], k[k0:k1], v[k0:k1], mask, scale)
    return out, lse


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
