"""kernels.attention: the CUDA path's varlen attention over segment bounds.

On the CPU (float32): segment_bounds finds every run of a packed batch (static size, zero-length
tail) and the varlen reference equals the dense-mask reference (masked_attention_ref) under the
same visibility. On the GPU (bfloat16, marked gpu): FlashAttention's varlen kernel equals the
varlen reference, causal and against a block's prefix (seqused_k), and the segment bounds are the
same on the device. Fresh random inputs each time.
"""

from __future__ import annotations

import pytest
import torch

from kernels.attention import masked_attention_ref, segment_bounds, varlen_attention, varlen_attention_ref


def _packed_segments(g: torch.Generator, n: int, block: int) -> torch.Tensor:
    """seg ids of n rows in blocks of `block`: random runs inside each block, then padding (-1)."""
    seg = torch.full((n,), -1, dtype=torch.int64)
    s = 0
    for start in range(0, n, block):
        i, end = start, start + int(torch.randint(block // 2, block + 1, (1,), generator=g))
        while i < end:
            length = min(int(torch.randint(1, 20, (1,), generator=g)), end - i)
            seg[i:i + length] = s
            i, s = i + length, s + 1
    return seg


def _runs(seg: torch.Tensor, pad_chunk: int) -> list[int]:
    """The runs of equal ids, a padding run also ending at every multiple of pad_chunk."""
    starts = [i for i in range(len(seg)) if i == 0 or seg[i] != seg[i - 1] or (seg[i] < 0 and i % pad_chunk == 0)]
    return starts + [len(seg)]


@pytest.mark.parametrize("seed", range(4))
def test_segment_bounds_finds_every_run(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    block = 64
    seg = _packed_segments(g, 4 * block, block)
    runs = _runs(seg, block)
    spare = 3
    got = segment_bounds(seg, len(runs) - 1 + spare, block)
    assert got.dtype == torch.int32
    assert got.tolist() == runs + [len(seg)] * spare


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (14, 2, 64)])
def test_varlen_reference_equals_dense_masks(seed: int, heads: int, kv_heads: int, dim: int) -> None:
    g = torch.Generator().manual_seed(seed)
    block, n = 48, 3 * 48
    seg = _packed_segments(g, n, block)
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    cu = segment_bounds(seg, n, block)
    got, got_lse = varlen_attention_ref(q, k, v, cu, cu, True, dim ** -0.5)
    pos = torch.arange(n)
    run = torch.bucketize(pos, cu[1:], right=True)  # each row's run
    mask = (run[:, None] == run[None, :]) & (pos[None, :] <= pos[:, None])
    want, want_lse = masked_attention_ref(q, k, v, mask, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def test_varlen_reference_prefix_part_uses_only_seqused_keys() -> None:
    g = torch.Generator().manual_seed(9)
    block, dim = 16, 8
    q, k, v = (torch.randn(2 * block, 2, dim, generator=g) for _ in range(3))
    cu = torch.tensor([0, block, 2 * block], dtype=torch.int32)
    used = torch.tensor([5, 0], dtype=torch.int32)
    out, lse = varlen_attention_ref(q, k, v, cu, cu, False, dim ** -0.5, used)
    want, want_lse = masked_attention_ref(q[:block], k[:5], v[:5], torch.ones(block, 5, dtype=torch.bool), dim ** -0.5)
    torch.testing.assert_close(out[:block], want)
    torch.testing.assert_close(lse[:block], want_lse)
    assert out[block:].abs().max() == 0 and lse[block:].isneginf().all()  # no keys: nothing


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("heads,kv_heads,dim,block,blocks", [(14, 2, 64, 128, 4), (16, 8, 128, 1024, 8)])
def test_flash_varlen_matches_reference_cuda(seed: int, heads: int, kv_heads: int, dim: int, block: int,
                                             blocks: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = block * blocks
    seg = _packed_segments(g, n, block)
    q, k, v = (torch.randn(n, h, dim, generator=g).to("cuda", torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    num_runs = len(_runs(seg, block)) - 1
    cu = segment_bounds(seg.cuda(), num_runs + 5, block)
    assert cu.cpu().tolist() == segment_bounds(seg, num_runs + 5, block).tolist()
    scale = dim ** -0.5
    got, got_lse = varlen_attention(q, k, v, cu, cu, block, block, True, scale)
    want, want_lse = varlen_attention_ref(q.double().cpu(), k.double().cpu(), v.double().cpu(), cu.cpu(), cu.cpu(),
                                          True, scale)
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= 2e-2, err  # bf16 inputs and output
    torch.testing.assert_close(got_lse.cpu().double(), want_lse.double(), rtol=0, atol=1e-3)
    # the prefix part: every row of a block against the block's first prefix_len keys
    cu_blocks = torch.arange(0, n + 1, block, dtype=torch.int32, device="cuda")
    used = torch.randint(0, block // 2, (blocks,), generator=g, dtype=torch.int32)
    used[0] = 0  # a block without a prefix: its rows get out 0 (their lse is masked by the caller)
    got, got_lse = varlen_attention(q, k, v, cu_blocks, cu_blocks, block, block, False, scale, used.cuda())
    want, want_lse = varlen_attention_ref(q.double().cpu(), k.double().cpu(), v.double().cpu(), cu_blocks.cpu(),
                                          cu_blocks.cpu(),
                                          False, scale, used)
    assert (got.double().cpu() - want).abs().max().item() <= 2e-2
    has_keys = torch.repeat_interleave(used > 0, block)
    torch.testing.assert_close(got_lse.cpu().double()[has_keys], want_lse.double()[has_keys], rtol=0, atol=1e-3)
    assert got[:block].abs().max().item() == 0
