"""kernels.gemm and kernels.norm_act.rms_norm_parts against torch on fresh random inputs: on a CPU
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on the GPU compiled (gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.gemm import GemmConfig, linear, sum_parts
from kernels.norm_act import rms_norm_parts
from service.model.layers import rms_norm as rms_norm_ref
from tests.kernels.test_norm_act import _ulps

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return a, w, bias


# the accumulation order is not torch's: float32 agrees to its rounding, bf16 to one output rounding
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,config", [(37, GemmConfig(32, 32, 32)), (5, GemmConfig(16, 64, 64)),
                                      (70, GemmConfig(64, 32, 32, num_stages=2))])  # row tails
def test_linear_matches_torch(device: str, dtype: torch.dtype, m: int, config: GemmConfig) -> None:
    a, w, bias = _inputs(m, 128, 192, dtype, device, seed=m)
    want = F.linear(a.double(), w.double(), bias.double())
    got = linear(a, w, bias, config)
    assert got.shape == (m, 128) and got.dtype == dtype
    assert _rel(got, want) <= TOL[dtype]
    no_bias = linear(a, w, None, config)
    assert _rel(no_bias, F.linear(a.double(), w.double())) <= TOL[dtype]
    assert not torch.equal(no_bias, got), "the bias is added"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_partials_sum_to_the_product(device: str, dtype: torch.dtype, split: int) -> None:
    a, w, _ = _inputs(21, 64, 32 * split * 2, dtype, device, seed=split)
    parts = linear(a, w, config=GemmConfig(32, 32, 32, split_k=split))
    assert parts.shape == (split, 21, 64) and parts.dtype == torch.float32
    k_part = a.shape[1] // split  # each part is its K slice's product
    for i in range(split):
        sl = slice(i * k_part, (i + 1) * k_part)
        assert _rel(parts[i], F.linear(a[:, sl].double(), w[:, sl].double())) <= 1e-5
    assert _rel(sum_parts(parts, dtype), F.linear(a.double(), w.double())) <= TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_epilogue_is_silu_gate_times_up(device: str, dtype: torch.dtype) -> None:
    a, w, _ = _inputs(19, 2 * 96, 64, dtype, device, seed=7)
    a = 3 * a  # gate values well into SiLU's curve
    got = linear(a, w, config=GemmConfig(16, 32, 32), silu=True)
    gate, up = F.linear(a.double(), w.double()).chunk(2, dim=-1)
    want = F.silu(gate.to(dtype).double()).to(dtype).double() * up.to(dtype).double()
    assert got.shape == (19, 96) and got.dtype == dtype
    assert _rel(got, want) <= 2 * TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,split", [(3, 64, 2), (9, 896, 4), (33, 128, 1)])
def test_rms_norm_parts_reduces_adds_and_normalises(device: str, dtype: torch.dtype, rows: int, dim: int,
                                                    split: int) -> None:
    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g).to(device, dtype)
    parts = torch.randn(split, rows, dim, generator=g).to(device)
    w = (1 + 0.3 * torch.randn(dim, generator=g)).to(device, dtype)
    out, total = rms_norm_parts(x, parts, w, 1e-6)
    want_total = (x.float() + sum_parts(parts, dtype).float()).to(dtype)
    if device == "cuda" or dtype == torch.float32:
        assert torch.equal(total, want_total)
    else:  # Triton's CPU interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even)
        assert _rel(total, want_total) <= 2 ** -7
    assert _ulps(out, rms_norm_ref(total, w, 1e-6)) <= (8 if dtype == torch.float32 else 2)


def test_bad_shapes_are_refused() -> None:
    a, w = torch.randn(4, 64), torch.randn(96, 64)
    with pytest.raises(ValueError, match="multiple of block_n"):
        linear(a, w, config=GemmConfig(16, 64, 32))
    with pytest.raises(ValueError, match="do not multiply"):
        linear(a, torch.randn(64, 32))
    with pytest.raises(ValueError, match="no bias or SiLU"):
        linear(a, torch.randn(64, 64), torch.zeros(64), GemmConfig(16, 32, 32, split_k=2))
    with pytest.raises(ValueError, match="float32 parts"):
        rms_norm_parts(torch.randn(4, 64), torch.randn(2, 4, 64).double(), torch.ones(64), 1e-6)
