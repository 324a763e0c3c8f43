"""The decoder's building blocks in plain torch (Hugging Face Qwen2/Qwen3 numerics).

These are the references the kernels and the C++ runtime are checked against: keep them plain.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.attention import masked_attention_ref, rowwise_attention_ref
from kernels.attention_merge import merge_attention_states_ref

from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF: variance in float32, normalise, cast back, then scale by the weight in the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


class LayerWeights:
    """Views of one layer's artifact tensors."""

    def __init__(self, weights: dict[str, torch.Tensor], i: int) -> None:
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


def qkv_projection(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, fused: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [N, D] -> q [N, H, E], k [N, G, E] (normed, rotated), v [N, G, E].

    fused: fused kernels (service.runtime.fused) for the norms, or None for these plain-torch ones."""
    n, eps = x.shape[0], cfg.rms_norm_eps
    h = fused.rms_norm(x, w.attn_norm, eps) if fused is not None else rms_norm(x, w.attn_norm, eps)
    qkv = F.linear(h, w.wqkv, w.bqkv)
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = q.reshape(n, cfg.num_heads, cfg.head_dim)
    k = k.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(n, cfg.num_kv_heads, cfg.head_dim)
    if fused is not None:  # q/k norm (Qwen3) and RoPE in one kernel each
        q = fused.norm_rope(q.contiguous(), cos, sin, w.q_norm if cfg.qk_norm else None, eps)
        k = fused.norm_rope(k.contiguous(), cos, sin, w.k_norm if cfg.qk_norm else None, eps)
        return q, k, v.contiguous()
    if cfg.qk_norm:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()


def attention_output_and_mlp(cfg: ModelConfig, w: LayerWeights, x: torch.Tensor, attn: torch.Tensor,
                             fused: Any = None) -> torch.Tensor:
    """Residual adds around o_proj and the SwiGLU MLP. x: [N, D]; attn: [N, H, E].

    fused: the first residual add + RMSNorm and SiLU(gate)*up as fused kernels (service.runtime.fused)."""
    o = F.linear(attn.reshape(x.shape[0], cfg.q_size), w.wo)
    if fused is not None:
        h, y = fused.rms_norm_residual(o, x, w.mlp_norm, cfg.rms_norm_eps)
        return y + F.linear(fused.silu_mul(F.linear(h, w.wgu)), w.wdown)
    x = x + o
    h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
    gate, up = F.linear(h, w.wgu).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.wdown)


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
