import math

import pytest
import torch

import cpp_dag
from kernels.attention_merge import merge_attention_states_ref

SHAPES = [(1, 1, 1), (7, 2, 64), (33, 14, 64), (128, 8, 128)]  # [N, H, E]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _random_states(n, h, e, dtype, device, seed):
    """Two random partial states; some rows empty on one side, some on both (lse -inf)."""
    gen = torch.Generator().manual_seed(seed)
    out_a = torch.randn(n, h, e, generator=gen).to(dtype)
    out_b = torch.randn(n, h, e, generator=gen).to(dtype)
    lse_a = torch.randn(n, h, generator=gen) * 10
    lse_b = torch.randn(n, h, generator=gen) * 10
    which = torch.randint(0, 8, (n, h), generator=gen)  # 0: A empty, 1: B empty, 2: both
    lse_a[(which == 0) | (which == 2)] = -math.inf
    lse_b[(which == 1) | (which == 2)] = -math.inf
    # An empty side's out rows are garbage (a no-key attention yields 0/0): must not leak.
    out_a[which == 0] = math.nan
    out_b[which == 1] = math.nan
    return [t.to(device) for t in (out_a, lse_a, out_b, lse_b)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpp_equals_reference_bytewise(shape, dtype, device):
    args = _random_states(*shape, dtype, device, seed=hash((shape, str(dtype))) % 2**31)
    out, lse = cpp_dag.merge_attention_states(*args)
    out_ref, lse_ref = merge_attention_states_ref(*args)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == shape and lse.shape == shape[:2]
    assert torch.equal(out, out_ref)
    assert torch.equal(lse, lse_ref)
    assert not out.isnan().any() and not lse.isnan().any()


def _partial_attention(scores, v, mask):
    """Softmax attention over the keys in mask. scores: [N, H, L], v: [L, H, E], mask: [N, H, L]."""
    masked = scores.masked_fill(~mask, -math.inf)
    lse = masked.logsumexp(-1)  # [N, H]; -inf where mask is empty
    probs = (masked - lse.unsqueeze(-1)).exp()  # NaN rows where mask is empty
    return torch.einsum("nhl,lhe->nhe", probs, v), lse


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n,h,d,num_keys", [(5, 2, 16, 9), (40, 4, 64, 100), (3, 1, 8, 2)])
def test_merge_equals_attention_over_union(n, h, d, num_keys, dtype, tol):
    gen = torch.Generator().manual_seed(n * 1000 + num_keys)
    q = torch.randn(n, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(num_keys, h, d, generator=gen, dtype=torch.float64)
    v = torch.randn(num_keys, h, d, generator=gen, dtype=torch.float64)
    scores = torch.einsum("nhd,lhd->nhl", q, k) / math.sqrt(d)
    in_a = torch.rand(n, h, num_keys, generator=gen) < 0.5  # disjoint key sets A and B
    in_b = ~in_a & (torch.rand(n, h, num_keys, generator=gen) < 0.8)
    in_a[0, 0] = False  # row (0, 0) has no keys on A; row (n-1, h-1) none at all
    in_a[-1, -1] = in_b[-1, -1] = False

    out_a, lse_a = _partial_attention(scores, v, in_a)
    out_b, lse_b = _partial_attention(scores, v, in_b)
    out, lse = cpp_dag.merge_attention_states(
        out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float()
    )
    expected_out, expected_lse = _partial_attention(scores, v, in_a | in_b)
    is_empty = ~(in_a | in_b).any(-1)
    expected_out[is_empty] = 0.0
    torch.testing.assert_close(out.double(), expected_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(lse[is_empty], torch.full_like(lse[is_empty], -math.inf))


def _good_args():
    return [torch.zeros(4, 2, 8), torch.zeros(4, 2), torch.zeros(4, 2, 8), torch.zeros(4, 2)]


@pytest.mark.parametrize(
    "index,bad,name",
    [
        (0, torch.zeros(4, 2), "out_a"),
        (0, torch.zeros(4, 2, 8, dtype=torch.int32), "out_a"),
        (1, torch.zeros(4, 3), "lse_a"),
        (1, torch.zeros(4, 2, dtype=torch.float64), "lse_a"),
        (2, torch.zeros(4, 2, 9), "out_b"),
        (2, torch.zeros(4, 2, 8, dtype=torch.bfloat16), "out_b"),
        (3, torch.zeros(2, 4), "lse_b"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(index, bad, name):
    args = _good_args()
    args[index] = bad
    with pytest.raises(ValueError, match=name):
        cpp_dag.merge_attention_states(*args)


def test_build_info_matches_running_torch():
    info = cpp_dag.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["with_cuda"] == (torch.version.cuda is not None)
    assert info["cxx_standard"] == "c++17"
    assert info["cxx11_abi"] == torch._C._GLIBCXX_USE_CXX11_ABI
