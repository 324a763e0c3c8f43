"""Fused element-wise Triton kernels of the decoder layer, with Hugging Face Qwen numerics.

- `rms_norm`: y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), computed in float32 per row;
  with `residual`, x + residual first (rounded to x.dtype, as torch's add) and that sum is
  returned too (it is the next residual stream). One program per row: replaces ~8 ATen kernels.
- `silu_mul`: silu(gate) * up of a fused [N, 2I] gate/up projection, rounded as torch does
  (silu to the dtype, then the product): replaces chunk + silu + mul.

The references are `service.model.layers.rms_norm` and torch's `F.silu(gate) * up`;
tests/kernels/test_norm_act.py checks them on fresh random inputs (on a CPU through Triton's
interpreter). Not yet called by the runtimes: the C++ executor will launch the ahead-of-time
compiled cubins (kernels/aot.py), and the Python runtime the same ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * inter + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] contiguous; weight [D]. Returns y, or (y, x + residual) with a residual."""
    if not x.is_contiguous() or (residual is not None and (residual.shape != x.shape or not residual.is_contiguous())):
        raise ValueError("rms_norm: x (and residual) must be contiguous and of one shape")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight must be [{d}], got {list(weight.shape)}")
    rows = x.numel() // d
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else out
    rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, total, d, eps,
                             HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(d))
    return (out, total) if residual is not None else out


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [N, 2I] contiguous (gate first) -> silu(gate) * up: [N, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul: gate_up must be a contiguous [N, 2I], got {list(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps,
                     E: tl.constexpr, HAS_NORM: tl.constexpr):
    """One (token, head) row of q or k: optional RMSNorm over the head dim (Qwen3's q/k norm), then
    RoPE (half-split layout) with the token's cos/sin, each product and sum rounded to the dtype as
    torch's element-wise ops round them."""
    pid = tl.program_id(0).to(tl.int64)
    token = pid // heads
    half = tl.arange(0, E // 2)
    x1 = tl.load(x_ptr + pid * E + half)
    x2 = tl.load(x_ptr + pid * E + E // 2 + half)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / E + eps)
        w1 = tl.load(w_ptr + half).to(tl.float32)
        w2 = tl.load(w_ptr + E // 2 + half).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        x2 = (w2 * (f2 * inv).to(x2.dtype).to(tl.float32)).to(x2.dtype)
    c1 = tl.load(cos_ptr + token * E + half).to(tl.float32)
    c2 = tl.load(cos_ptr + token * E + E // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + token * E + half).to(tl.float32)
    s2 = tl.load(sin_ptr + token * E + E // 2 + half).to(tl.float32)
    a1 = (x1.to(tl.float32) * c1).to(x1.dtype).to(tl.float32)
    b1 = (-x2.to(tl.float32) * s1).to(x1.dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2).to(x1.dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2).to(x1.dtype).to(tl.float32)
    tl.store(out_ptr + pid * E + half, (a1 + b1).to(x1.dtype))
    tl.store(out_ptr + pid * E + E // 2 + half, (a2 + b2).to(x1.dtype))


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
              eps: float = 0.0) -> torch.Tensor:
    """x: [N, heads, E] contiguous; cos/sin [N, E] (the tokens' rows of the RoPE tables, x's dtype);
    weight [E] for the q/k RMSNorm first, or None. Returns rope(norm(x)) [N, heads, E]."""
    n, heads, e = x.shape
    if not x.is_contiguous() or e & (e - 1) or cos.shape != (n, e) or sin.shape != (n, e):
        raise ValueError(f"norm_rope: x must be a contiguous [N, heads, E] (E a power of two) and cos/sin [N, E]; "
                         f"got {list(x.shape)}, {list(cos.shape)}, {list(sin.shape)}")
    if weight is not None and weight.shape != (e,):
        raise ValueError(f"norm_rope: weight must be [{e}], got {list(weight.shape)}")
    out = torch.empty_like(x)
    norm_rope_kernel[(n * heads,)](x, weight if weight is not None else x, cos.contiguous(), sin.contiguous(), out,
                                   heads, eps, E=e, HAS_NORM=weight is not None)
    return out
