"""The decoder's building blocks in plain torch (Hugging Face Qwen2/Qwen3 numerics).

These are the references the kernels and the C++ runtime are checked against: keep them plain.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ..siblings import sibling
from .config import ModelConfig

# kernels/ under this install's name (service/siblings.py): checkout and wheel name it differently
masked_attention_ref = sibling("kernels.attention").masked_attention_ref
rowwise_attention_ref = sibling("kernels.attention").rowwise_attention_ref
merge_attention_states_ref = sibling("kernels.attention_merge").merge_attention_states_ref
_fp8 = sibling("kernels.fp8_linear")
fp8_linear, scaled_linear, uses_scaled_mm = _fp8.fp8_linear, _fp8.scaled_linear, _fp8.uses_scaled_mm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF: variance in float32, normalise, cast back, then scale by the weight in the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# On the CPU, MKL gives a row of a GEMM the same bytes wherever it sits, except in a call of fewer
# than 12 rows that are no multiple of 4 (its kernel for the rows past the last 4: measured, M = 5 to
# 7 and 9 to 11 differ from the same rows among 96). Such a call gets zero rows up to the next
# multiple of 4, so a request's rows round alike in a small bucket and a large one.
_CPU_ROW_BLOCK, _CPU_FEW_ROWS = 4, 12


class Quantized(NamedTuple):
    """An FP8 GEMM's input made by the kernel that produced it (fp8_in_kernel): e4m3 rows and their
    float32 scales. cpp_dag/layer_ops.h's Activation with a scale."""
    q: torch.Tensor
    scale: torch.Tensor


def fp8_in_kernel(fused: Any, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor | None) -> bool:
    """Whether the fused path quantizes the activations of the FP8 GEMM (w_q, w_scale) inside the
    kernel that produces them: Triton kernels, an e4m3 weight, activations like x (its dtype and
    device) that scaled_linear takes. cpp_dag/layer_ops.cpp::fp8_in_kernel."""
    return (fused is not None and w_scale is not None and w_q.dtype == torch.float8_e4m3fn
            and uses_scaled_mm(x, w_q))


def linear(x: torch.Tensor | Quantized, w: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """Every GEMM of the model: F.linear, or with `scale` (the weight's per-output-channel float32
    scale: an e4m3 weight, `slmrank build --fp8`) kernels/fp8_linear.py's fp8_linear, or its
    scaled_linear when x comes Quantized. On the CPU a call of few rows is padded to a multiple of
    4 rows (above)."""
    if isinstance(x, Quantized):
        return scaled_linear(x.q, x.scale, w, scale, bias)
    m = x.shape[0]
    pad = -m % _CPU_ROW_BLOCK if x.dim() == 2 and x.device.type == "cpu" and m < _CPU_FEW_ROWS else 0
    if pad:
        x = torch.constant_pad_nd(x, [0, 0, 0, pad])
    y = F.linear(x, w, bias) if scale is None else fp8_linear(x, w, scale, bias)
    return y[:m] if pad else y


def rope_table(cfg: ModelConfig, num_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [num_positions, head_dim] float32 (HF default RoPE: the half-split layout)."""
    e = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, e, 2, dtype=torch.int64, device=device).float() / e))
    pos = torch.arange(num_positions, device=device, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, E/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, E]; cos/sin: [N, E] already gathered at the tokens' positions, in x.dtype
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def gemm_weight(weights: dict[str, torch.Tensor], min_rows: dict[str, int], name: str,
                rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, e4m3 scale or None) of the GEMM `name` for activations of `rows` rows: the stored
    weight, or below its fp8 row floor (min_rows: checkpoint.fp8_min_rows; `slmrank build --fp8
    PART:ROWS`) the model-dtype copy NAME.full. A bucket's rows are fixed, so its CUDA graph takes
    one of the two. cpp_dag/nodes.cpp::Context::gemm_weight."""
    if rows < min_rows.get(name, 0):
        return weights[name + ".full"], None
    return weights[name], weights.get(name + ".scale")


class LayerWeights:
    """Views of one layer's artifact tensors (at_rows: those a GEMM of so many rows takes)."""

    def __init__(self, weights: dict[str, torch.Tensor], i: int, min_rows: dict[str, int] | None = None) -> None:
        """min_rows: the artifact's row floors (checkpoint.fp8_min_rows, read once for every layer)."""
        p = f"layers.{i}."
        self.attn_norm = weights[p + "attn_norm"]
        self.wqkv = weights[p + "wqkv"]
        self.bqkv = weights.get(p + "bqkv")
        self.q_norm = weights.get(p + "q_norm")
        self.k_norm = weights.get(p + "k_norm")
        self.wo = weights[p + "wo"]
        self.mlp_norm = weights[p + "mlp_norm"]
        self.wgu = weights[p + "wgu"]
        self.wdown = weights[p + "wdown"]
        # the e4m3 weights' per-output-channel scales (`slmrank build --fp8`), None: not fp8
        self.wqkv_scale = weights.get(p + "wqkv.scale")
        self.wo_scale = weights.get(p + "wo.scale")
        self.wgu_scale = weights.get(p + "wgu.scale")
        self.wdown_scale = weights.get(p + "wdown.scale")
        self._weights, self._prefix = weights, p
        self._min_rows = {k: v for k, v in (min_rows or {}).items() if k.startswith(p)}

    def at_rows(self, rows: int) -> LayerWeights:
        """This layer for activations of `rows` rows: an e4m3 weight below its row floor (gemm_weight)
        gives way to its model-dtype copy. Itself when no weight of it has a floor."""
        if not self._min_rows:
            return self
        view = copy.copy(self)
        for attr in ("wqkv", "wo", "wgu", "wdown"):
            w, scale = gemm_weight(self._weights, self._min_rows, self._prefix + attr, rows)
            setattr(view, attr, w)
            setattr(view, attr + "_scale", scale)
        return view


def residual_rms_norm(x: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      fused: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + pending, rms_norm(x + pending)). x: [N, D] the residual stream; pending: the previous
    layer's MLP output not yet added to it ([N, D]), or None. The add is rounded to the dtype first,
    as HF's `hidden_states = residual + hidden_states`.

    fused: one kernel for the add and the norm (service.runtime.fused), or None for these torch ops."""
    if fused is not None:
        if pending is None:
            return x, fused.rms_norm(x, weight, eps)
        h, total = fused.rms_norm_residual(pending, x, weight, eps)
        return total, h
    if pending is not None:
        x = x + pending
    return x, rms_norm(x, weight, eps)


def residual_rms_norm_for(x: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          fused: Any, w_q: torch.Tensor, w_scale: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor | Quantized]:
    """residual_rms_norm whose normed rows feed the GEMM (w_q, w_scale): quantized in the norm's
    kernel when fp8_in_kernel, else as residual_rms_norm."""
    if not fp8_in_kernel(fused, x, w_q, w_scale):
        return residual_rms_norm(x, pending, weight, eps, fused)
    if pending is None:
        return x, Quantized(*fused.rms_norm_fp8(x, weight, eps))
    q, s, total = fused.rms_norm_residual_fp8(pending, x, weight, eps)
    return total, Quantized(q, s)


def qkv_projection(cfg: ModelConfig, w: LayerWeights, h: torch.Tensor | Quantized, positions: torch.Tensor,
                   pos_offset: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor, fused: Any = None,
                   k_out: torch.Tensor | None = None,
                   v_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h: [N, D] the normed input (Quantized for an FP8 q/k/v GEMM) -> q [N, H, E], k [N, G, E]
    (normed, rotated), v [N, G, E].

    RoPE at positions + pos_offset ([N] int64) from the model's tables rope_cos/rope_sin [P, E].
    k_out/v_out: [N, G, E] views (a decode step's suffix slot) that receive k and v, which are then
    returned; None: fresh tensors. fused: the split, q/k norm (Qwen3), RoPE and v copy in one kernel
    reading the GEMM's output (service.runtime.fused), or None for these torch ops."""
    n, eps = positions.shape[0], cfg.rms_norm_eps
    qkv = linear(h, w.wqkv, w.bqkv, w.wqkv_scale)  # the bias rides in the GEMM's epilogue: one rounding
    if fused is not None:
        q_norm, k_norm = (w.q_norm, w.k_norm) if cfg.qk_norm else (None, None)
        return fused.qkv_rope(qkv, positions, pos_offset, rope_cos, rope_sin, cfg.num_heads, cfg.num_kv_heads, q_norm,
                              k_norm, eps, k_out, v_out)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = q.reshape(n, cfg.num_heads, cfg.head_dim)
    k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    rows = positions + pos_offset if pos_offset else positions
    cos, sin = rope_cos.index_select(0, rows), rope_sin.index_select(0, rows)
    q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()
    if k_out is not None:
        k_out.copy_(k)
        k = k_out
    if v_out is not None:
        v_out.copy_(v)
        v = v_out
    return q, k, v


def attention_output_and_mlp(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor, attn: torch.Tensor,
                             fused: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj with its residual add, then the SwiGLU MLP. x: [N, D]; attn: [N, H, E].

    Returns (x + o_proj(attn), mlp_out): the MLP's output is not added here; the next layer's first
    norm (residual_rms_norm) adds it in the same kernel, or the caller does. fused: the residual add
    + RMSNorm and SiLU(gate)*up as fused kernels (service.runtime.fused), each quantizing its
    output for an FP8 GEMM (fp8_in_kernel), the attention's output quantized in one kernel."""
    a = attn.reshape(x.shape[0], cfg.q_size)
    if fp8_in_kernel(fused, a, w.wo, w.wo_scale):
        a = Quantized(*fused.quantize_rows(a))
    o = linear(a, w.wo, None, w.wo_scale)
    if fused is not None:
        y, h = residual_rms_norm_for(x, o, w.mlp_norm, cfg.rms_norm_eps, fused, w.wgu, w.wgu_scale)
        gate_up = linear(h, w.wgu, None, w.wgu_scale)
        act = (Quantized(*fused.silu_mul_fp8(gate_up)) if fp8_in_kernel(fused, gate_up, w.wdown, w.wdown_scale)
               else fused.silu_mul(gate_up))
        return y, linear(act, w.wdown, None, w.wdown_scale)
    x = x + o
    h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    gate, up = linear(h, w.wgu, None, w.wgu_scale).chunk(2, dim=-1)
    return x, linear(F.silu(gate) * up, w.wdown, None, w.wdown_scale)


def two_part_attention(q: torch.Tensor, k_a: torch.Tensor, v_a: torch.Tensor, mask_a: torch.Tensor,
                       k_b: torch.Tensor, v_b: torch.Tensor, mask_b: torch.Tensor | None,
                       scale: float) -> torch.Tensor:
    """Part A: shared keys under a mask. Part B: keys under mask_b, or per-row keys when it is None."""
    out_a, lse_a = masked_attention_ref(q, k_a, v_a, mask_a, scale)
    if mask_b is None:
        out_b, lse_b = rowwise_attention_ref(q, k_b, v_b, scale)
    else:
        out_b, lse_b = masked_attention_ref(q, k_b, v_b, mask_b, scale)
    out, _ = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    return out


def attention_blocks(*masks: torch.Tensor) -> list[tuple[int, int]]:
    """Row ranges [s, e) of a packed batch's self-attention (masks [T, T], OR-ed) whose rows see
    only keys inside their own range: each request's (each sample's, without a prefix) and the
    padding's. Every key a row sees is at or before it (causal segments, a sample's prefix before
    it), so a range starts at i where no row from i on sees a key before i. On the host (the ranges
    are sizes: CPU only, a CUDA graph cannot hold them)."""
    vis = masks[0]
    for m in masks[1:]:
        vis = vis | m
    n = vis.shape[0]
    rows = torch.arange(n)
    first = torch.where(vis.any(1), vis.to(torch.uint8).argmax(1), rows)  # the first key each row sees
    reach = first.flip(0).cummin(0).values.flip(0)  # the first key any row from i on sees
    starts = rows[reach == rows].tolist() + [n]
    return list(zip(starts[:-1], starts[1:]))


def blockwise_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                             mask_ctx: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A packed batch's self-attention (under mask, and two_part_attention's shared-prefix part under
    mask_ctx when given), a block of attention_blocks at a time, each block's keys from its first
    row: a request's rows compute with the same shapes and offsets packed as alone (the same bytes
    on a CPU, where the dense [T, T] form rounds with the request's place in the batch), and a
    batch costs the sum of its blocks' squares, not T squared."""
    out = torch.empty_like(q)
    for s, e in attention_blocks(mask, *(() if mask_ctx is None else (mask_ctx,))):
        qb, kb, vb, mb = q[s:e], k[s:e], v[s:e], mask[s:e, s:e]
        if mask_ctx is None:
            out[s:e] = masked_attention_ref(qb, kb, vb, mb, scale)[0]
        else:
            out[s:e] = two_part_attention(qb, kb, vb, mask_ctx[s:e, s:e], kb, vb, mb, scale)
    return out


def attention_runs(mask: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """mask [N, M] bool whose rows each see one contiguous range of keys (a decode step's beam rows
    and their request's prompt) -> the runs (r0, r1, k0, k1) of consecutive rows that see the same
    range [k0, k1) (k0 == k1: none). On the host: CPU only."""
    count = mask.sum(1)
    first = torch.where(count > 0, mask.to(torch.uint8).argmax(1), 0)
    n = mask.shape[0]
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = first[1:].ne(first[:-1]) | count[1:].ne(count[:-1])
    starts = change.nonzero().flatten().tolist() + [n]
    f, c = first.tolist(), count.tolist()
    return [(s, e, f[s], f[s] + c[s]) for s, e in zip(starts[:-1], starts[1:])]


def two_part_attention_by_runs(q: torch.Tensor, k_a: torch.Tensor, v_a: torch.Tensor, mask_a: torch.Tensor,
                               k_b: torch.Tensor, v_b: torch.Tensor, scale: float) -> torch.Tensor:
    """two_part_attention with part B per row and part A (mask_a: each row one contiguous range of
    k_a) a run of attention_runs at a time, each over its own keys only: a request's beam rows
    compute with the same shapes packed as alone (the same bytes on a CPU)."""
    out_a = torch.zeros_like(q)
    lse_a = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for r0, r1, k0, k1 in attention_runs(mask_a):
        if k1 > k0:
            out_a[r0:r1], lse_a[r0:r1] = masked_attention_ref(q[r0:r1], k_a[k0:k1], v_a[k0:k1], mask_a[r0:r1, k0:k1],
                                                              scale)
    out_b, lse_b = rowwise_attention_ref(q, k_b, v_b, scale)
    out, _ = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    return out

