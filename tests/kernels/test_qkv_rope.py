"""kernels.qkv_rope against the ATen path of the decoder layer (split, q/k RMSNorm, RoPE from the
gathered tables, v copy) on fresh random inputs: on a CPU through Triton's interpreter, on the GPU
compiled (marked gpu), where RoPE must equal torch bit for bit (the kernels are compiled without
FMA contraction: kernels/__init__.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.qkv_rope import qkv_rope
from service.model.layers import apply_rope, rms_norm

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NUM_POSITIONS = 300


def _inputs(device: str, dtype: torch.dtype, n: int, h: int, g: int, e: int, qk_norm: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(n, (h + 2 * g) * e, generator=gen)).to(device, dtype)
    # the model's tables are cos/sin of angles; random values in [-1, 1] exercise every rounding as well
    cos, sin = ((2 * torch.rand(NUM_POSITIONS, e, generator=gen) - 1).to(device, dtype) for _ in range(2))
    positions = torch.randint(0, NUM_POSITIONS - 8, (n,), generator=gen).to(device)
    norms = tuple((1 + 0.3 * torch.randn(e, generator=gen)).to(device, dtype) for _ in range(2)) if qk_norm else (None, None)
    return qkv, positions, cos, sin, norms


def _aten_path(qkv, positions, cos, sin, h, g, norms, eps, offset):
    """service.model.layers' ops in the ATen path's order."""
    n, e = qkv.shape[0], cos.shape[1]
    q, k, v = qkv.split([h * e, g * e, g * e], dim=-1)
    q, k, v = q.reshape(n, h, e), k.reshape(n, g, e), v.reshape(n, g, e)
    if norms[0] is not None:
        q, k = rms_norm(q, norms[0], eps), rms_norm(k, norms[1], eps)
    rows = positions + offset
    c, s = cos.index_select(0, rows), sin.index_select(0, rows)
    return apply_rope(q, c, s), apply_rope(k, c, s), v.contiguous()


def _max_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("n,h,g,e", [(37, 14, 2, 64), (9, 16, 8, 128), (70, 4, 2, 16), (5, 6, 6, 32)])
def test_qkv_rope_matches_the_aten_path(device: str, dtype: torch.dtype, qk_norm: bool, n: int, h: int, g: int,
                                        e: int) -> None:
    eps, offset = 1e-6, 3 if n % 2 else 0
    qkv, pos, cos, sin, norms = _inputs(device, dtype, n, h, g, e, qk_norm, seed=n * 7 + e)
    q, k, v = qkv_rope(qkv, pos, cos, sin, h, g, *norms, eps, pos_offset=offset)
    want_q, want_k, want_v = _aten_path(qkv, pos, cos, sin, h, g, norms, eps, offset)
    assert q.shape == (n, h, e) and k.shape == (n, g, e) and q.dtype == k.dtype == v.dtype == dtype
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert torch.equal(v, want_v)
    exact = not qk_norm and (device == "cuda" or dtype == torch.float32)
    for got, want in ((q, want_q), (k, want_k)):
        err, scale = _max_err(got, want)
        if exact:  # RoPE: the same roundings as torch's mul, mul, add
            assert torch.equal(got, want), err
        elif dtype == torch.float32:  # the norm's sum order and rsqrt
            assert err <= 1e-5 * scale, err
        elif device == "cuda":  # one bf16 rounding of the normalised value may differ (sum order)
            assert err <= 2 * 2 ** -8 * scale, err
        else:  # Triton's interpreter truncates at each rounding to bf16 (the GPU rounds to nearest even)
            assert err <= 4 * 2 ** -7 * scale, (err, scale)


@pytest.mark.parametrize("device", DEVICES)
def test_k_and_v_go_into_a_decode_steps_suffix_slot(device: str) -> None:
    """k_out/v_out may be strided views: step t writes suffix_k[:, t - 1] of [N, S, G, E] in place."""
    n, h, g, e, slots, t = 12, 4, 2, 32, 4, 3
    qkv, pos, cos, sin, norms = _inputs(device, torch.float32, n, h, g, e, True, seed=1)
    suffix_k, suffix_v = (torch.full((n, slots, g, e), 7.0, device=device) for _ in range(2))
    q, k, v = qkv_rope(qkv, pos, cos, sin, h, g, *norms, 1e-6, pos_offset=t - 1,
                       k_out=suffix_k[:, t - 1], v_out=suffix_v[:, t - 1])
    fresh_q, fresh_k, fresh_v = qkv_rope(qkv, pos, cos, sin, h, g, *norms, 1e-6, pos_offset=t - 1)
    assert k.data_ptr() == suffix_k[:, t - 1].data_ptr() and v.data_ptr() == suffix_v[:, t - 1].data_ptr()
    assert torch.equal(suffix_k[:, t - 1], fresh_k) and torch.equal(suffix_v[:, t - 1], fresh_v)
    assert torch.equal(q, fresh_q)
    others = [s for s in range(slots) if s != t - 1]
    assert bool((suffix_k[:, others] == 7.0).all()) and bool((suffix_v[:, others] == 7.0).all())


def test_bad_inputs_are_refused() -> None:
    qkv, pos, cos, sin, _ = _inputs("cpu", torch.float32, 4, 4, 2, 16, False, seed=2)
    with pytest.raises(ValueError, match=r"\[N, \(H \+ 2G\) \* E\]"):
        qkv_rope(qkv, pos, cos, sin, 4, 1)
    with pytest.raises(ValueError, match="positions must be int64"):
        qkv_rope(qkv, pos.int(), cos, sin, 4, 2)
    with pytest.raises(ValueError, match="tables of qkv's dtype"):
        qkv_rope(qkv, pos, cos.double(), sin.double(), 4, 2)
    with pytest.raises(ValueError, match="both be"):
        qkv_rope(qkv, pos, cos, sin, 4, 2, q_norm=torch.ones(16))
    with pytest.raises(ValueError, match="contiguous heads"):
        qkv_rope(qkv, pos, cos, sin, 4, 2, k_out=torch.empty(4, 16, 2).transpose(1, 2))
    with pytest.raises(ValueError, match="one row stride"):
        qkv_rope(qkv, pos, cos, sin, 4, 2, k_out=torch.empty(4, 3, 2, 16)[:, 0], v_out=torch.empty(4, 2, 16))
