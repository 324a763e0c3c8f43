"""kernels.linear (Triton GEMM for decode row counts) against a float64 product on fresh random
inputs: on a CPU through Triton's interpreter, on the GPU compiled (marked gpu). Its error must stay
within what torch's own bf16 F.linear makes (2x, plus one bf16 rounding of the output scale)."""

from __future__ import annotations

import pytest
import torch

from kernels.linear import linear, linear_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device: str, m: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, torch.bfloat16)
    b = torch.randn(n // 1, generator=g).to(device, torch.bfloat16) if bias else None
    return x, w, b


def _check(got: torch.Tensor, x, w, b, silu_mul: bool) -> None:
    want = linear_ref(x.double(), w.double(), None if b is None else b.double(), silu_mul)
    torch_err = (linear_ref(x, w, b, silu_mul).double() - want).abs().max().item()
    err = (got.double() - want).abs().max().item()
    assert got.dtype == x.dtype and got.shape == want.shape
    assert err <= 2 * torch_err + want.abs().max().item() * 2 ** -8, (err, torch_err)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,k,config", [
    (100, 96, 256, None),                 # the default tile: one 128-row tile over 100 rows
    (7, 48, 128, (64, 32, 64, 4, 2)),     # rows and columns both short of a tile
    (130, 64, 192, (128, 16, 64, 4, 3)),  # a second row tile of 2 rows; K of 3 steps
])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(device: str, m: int, n: int, k: int, config, bias: bool) -> None:
    x, w, b = _inputs(device, m, n, k, bias, seed=m * 7 + n + bias)
    _check(linear(x, w, b, config=config), x, w, b, silu_mul=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,inter,k,config", [(100, 80, 128, None), (9, 48, 256, (64, 16, 128, 4, 2))])
def test_linear_silu_mul_matches_the_unfused_path(device: str, m: int, inter: int, k: int, config) -> None:
    x, w, _ = _inputs(device, m, 2 * inter, k, False, seed=inter + k)
    got = linear(x, w, silu_mul=True, config=config)
    assert got.shape == (m, inter)
    _check(got, x, w, None, silu_mul=True)


def test_linear_names_what_is_wrong() -> None:
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        linear(x.float(), torch.zeros(8, 128))
    with pytest.raises(ValueError, match="bias must be"):
        linear(x, torch.zeros(8, 128, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="BLOCK_K"):
        linear(x, torch.zeros(8, 128, dtype=torch.bfloat16), config=(64, 16, 256, 4, 2))
