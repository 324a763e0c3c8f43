"""kernels.decode_attention (Triton) against the reference parts + LSE merge that the runtimes use
today (service.model.layers.two_part_attention), on fresh random inputs: prompts of several requests
packed, beams of each request, padding rows with no prompt. CPU: Triton's interpreter; GPU:
compiled (marked gpu), where bf16 is held to "no less accurate than the reference"."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention
from service.model.layers import two_part_attention


def _case(seed: int, dtype: torch.dtype, device: str, heads: int, kv_heads: int, dim: int,
          prompts: list[int], beams: int, slots: int):
    g = torch.Generator().manual_seed(seed)
    p_total = sum(prompts) + 5  # 5 padding tokens at the end of the packed prompts
    rows = len(prompts) * beams + beams  # one more request slot of padding (no prompt)
    q = torch.randn(rows, heads, dim, generator=g)
    pk, pv = (torch.randn(p_total, kv_heads, dim, generator=g) for _ in range(2))
    sk, sv = (torch.randn(rows, slots, kv_heads, dim, generator=g) for _ in range(2))
    starts = torch.tensor([0] + prompts[:-1]).cumsum(0).tolist()
    kv_start = torch.tensor([s for s in starts for _ in range(beams)] + [0] * beams)
    kv_len = torch.tensor([n for n in prompts for _ in range(beams)] + [0] * beams)
    seg = torch.full((p_total,), -1)
    for r, (s, n) in enumerate(zip(starts, prompts)):
        seg[s:s + n] = r
    beam_req = torch.arange(len(prompts) + 1).repeat_interleave(beams)
    mask = beam_req[:, None] == seg[None, :]
    to = lambda t: t.to(device, dtype)  # noqa: E731
    return (to(q), to(pk), to(pv), kv_start.to(device), kv_len.to(device), to(sk), to(sv), mask.to(device))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("t", [1, 3, 4])
@pytest.mark.parametrize("heads,kv_heads,dim", [(14, 2, 64), (4, 4, 16)])
def test_decode_attention_matches_reference_cpu(seed: int, t: int, heads: int, kv_heads: int, dim: int) -> None:
    q, pk, pv, start, length, sk, sv, mask = _case(seed, torch.float32, "cpu", heads, kv_heads, dim,
                                                   prompts=[7, 70, 1], beams=3, slots=4)
    scale = dim ** -0.5
    want = two_part_attention(q, pk, pv, mask, sk[:, :t], sv[:, :t], None, scale)
    got = decode_attention(q, pk, pv, start, length, sk, sv, t, scale, block_n=32)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_attention_refuses_bad_arguments() -> None:
    q, pk, pv, start, length, sk, sv, _ = _case(0, torch.float32, "cpu", 4, 2, 16, [3], 2, 2)
    with pytest.raises(ValueError, match="num_suffix 3 outside"):
        decode_attention(q, pk, pv, start, length, sk, sv, 3, 0.25)
    with pytest.raises(ValueError, match="do not agree"):
        decode_attention(q[:, :3], pk, pv, start, length, sk, sv, 1, 0.25)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_decode_attention_cuda_bf16(seed: int) -> None:
    q, pk, pv, start, length, sk, sv, mask = _case(seed, torch.bfloat16, "cuda", 14, 2, 64,
                                                   prompts=[128, 40, 300, 9], beams=16, slots=4)
    scale = 64 ** -0.5
    truth = two_part_attention(q.double(), pk.double(), pv.double(), mask, sk[:, :4].double(), sv[:, :4].double(),
                               None, scale)
    ref = two_part_attention(q, pk, pv, mask, sk[:, :4], sv[:, :4], None, scale)
    got = decode_attention(q, pk, pv, start, length, sk, sv, 4, scale)
    err_got, err_ref = (got.double() - truth).abs(), (ref.double() - truth).abs()
    assert err_got.max() <= err_ref.max() + 1e-3 and err_got.mean() <= err_ref.mean() + 1e-4
