"""kernels.beam_topk (Triton) against its plain-torch reference on fresh random inputs: on a CPU
through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET), on the GPU compiled and
as the AOT cubins launched from C++ (marked gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kernels.beam_topk import (NO_KEY_VALUE, allowed_bitmask, beam_candidates, beam_commit, beam_merge, beam_topk,
                               beam_topk_ref, decode_keys, row_passes, sizes)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ROOT = Path(__file__).resolve().parents[2]


def _inputs(seed: int, r: int, p: int, vocab: int, dtype: torch.dtype, device: str, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(r * p, vocab, generator=g)).to(device, dtype)
    scores = (-5 * torch.rand(r, p, generator=g)).to(device)
    return logits, scores


def _check(got, want, logits: torch.Tensor, scores: torch.Tensor, allowed=None, tol: float = 2e-5) -> None:
    """Equal to the reference; where the reference has near-ties (|gap| <= tol), the kernel's own
    float32 rounding of the log-sum-exp may order them the other way, so there the check is that
    each chosen candidate scores (by the reference's arithmetic) what the kernel says."""
    (s, par, tok), (ws, wpar, wtok) = got, want
    assert s.dtype == torch.float32 and par.dtype == tok.dtype == torch.int64 and s.shape == ws.shape
    assert torch.equal(s.isinf(), ws.isinf()), "the dead candidates differ"
    fin = ws.isfinite()
    assert (s[fin] - ws[fin]).abs().max().item() <= tol if fin.any() else True
    r, p = scores.shape
    vocab = logits.shape[1]
    cand = torch.log_softmax(logits.float(), -1)
    if allowed is not None:
        bits = allowed.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=allowed.device)
        cand = cand.masked_fill(~(bits & 1).bool().view(len(allowed), -1)[:, :vocab], float("-inf"))
    cand = (cand.view(r, p, vocab) + scores.unsqueeze(-1)).view(r, -1)
    picked = cand.gather(1, par * vocab + tok)
    fin = picked.isfinite()
    assert torch.equal(fin, s.isfinite()) and (picked[fin] - s[fin]).abs().max().item() <= tol if fin.any() else True
    assert (s[:, 1:] <= s[:, :-1]).all() or s.shape[1] == 1, "not best first"
    flat = par * vocab + tok
    assert all(len(set(row.tolist())) == len(row) for row in flat), "a candidate was chosen twice"
    gap = torch.cat([ws[:, 1:] - ws[:, :-1], torch.zeros(r, 1, device=ws.device)], 1).abs()
    near = (gap <= tol) | torch.cat([torch.zeros(r, 1, device=ws.device, dtype=torch.bool), gap[:, :-1] <= tol], 1)
    same = (par == wpar) & (tok == wtok)
    assert (same | near).all(), f"order differs from the reference away from near-ties: {(~same & ~near).nonzero()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,p,vocab,b", [
    (2, 4, 3000, 4),  # a small beam step
    (2, 8, 3000, 8),
    (1, 1, 2000, 16),  # beam_init: one parent row per request
    (2, 1, 777, 2),  # V not a multiple of anything
    (1, 3, 151936, 3),  # the Qwen vocabulary
])
def test_matches_reference(device: str, dtype: torch.dtype, r: int, p: int, vocab: int, b: int) -> None:
    logits, scores = _inputs(r * 100 + vocab + b, r, p, vocab, dtype, device)
    _check(beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b), logits, scores)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,vocab", [(100, 4096), (400, 6000)])
def test_wide_beams(device: str, b: int, vocab: int) -> None:
    """W2/W5 beam widths (sort widths 128 and 512); few rows, the interpreter is slow."""
    logits, scores = _inputs(b, 1, 2, vocab, torch.bfloat16, device)
    _check(beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b), logits, scores)


@pytest.mark.gpu
@pytest.mark.parametrize("r,b", [(8, 100), (4, 400), (1, 256)])
def test_serving_shapes_on_the_gpu(r: int, b: int) -> None:
    logits, scores = _inputs(r + b, r, b, 151936, torch.bfloat16, "cuda", scale=4.0)
    _check(beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b), logits, scores)


@pytest.mark.parametrize("device", DEVICES)
def test_dead_beams_and_dead_requests(device: str) -> None:
    """A request narrower than the bucket has -inf beam scores on its extra parents (nodes'
    _mask_extra_beams): those rows' candidates are -inf; a request with every beam dead gets
    parent 0's tokens 0..B-1 at -inf, as a stable sort puts them."""
    logits, scores = _inputs(7, 3, 6, 1500, torch.float32, device)
    scores[0, 2:] = float("-inf")  # width 2 of 6
    scores[1, :] = float("-inf")
    got, want = beam_topk(logits, scores, 6), beam_topk_ref(logits, scores, 6)
    _check(got, want, logits, scores)
    assert got[0][1].isinf().all() and got[1][1].tolist() == [0] * 6 and got[2][1].tolist() == list(range(6))
    assert set(got[1][0].tolist()) <= {0, 1}  # request 0: only its two live parents continue


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_lower_flat_index(device: str, dtype: torch.dtype) -> None:
    """Integer logits (many equal values in a row) and identical parent rows with equal beam
    scores: every tie across parents and tokens is broken by parent * V + token, exactly as the
    reference's stable sort breaks it."""
    g = torch.Generator().manual_seed(11)
    vocab, p, b = 3000, 4, 16
    row = torch.randint(-6, 3, (vocab,), generator=g).float()
    logits = row.repeat(2 * p, 1)
    logits[p:] = torch.randint(-6, 3, (p, vocab), generator=g).float()  # request 1: its own rows, more ties
    logits = logits.to(device, dtype)
    scores = torch.zeros(2, p, device=device)
    scores[1] = torch.tensor([-1.0, 0.0, -1.0, 0.0])
    got, want = beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert (got[0] - want[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_mask(device: str) -> None:
    """The mask applies after the log-softmax (over the whole vocabulary); a disallowed token is
    -inf; a row allowing fewer than K tokens fills with its first tokens at -inf; a row allowing
    none is -inf throughout."""
    r, p, vocab, b = 2, 4, 2100, 8
    logits, scores = _inputs(5, r, p, vocab, torch.bfloat16, device)
    g = torch.Generator().manual_seed(6)
    allowed = torch.rand(r * p, vocab, generator=g) < 0.05
    allowed[1] = False
    allowed[1, [7, 900, 2050]] = True  # 3 allowed tokens < K
    allowed[2] = False  # none
    bits = allowed_bitmask(allowed).to(device)
    assert bits.shape == (r * p, (vocab + 31) // 32) and bits.dtype == torch.int32
    got, want = beam_topk(logits, scores, b, bits), beam_topk_ref(logits, scores, b, bits)
    _check(got, want, logits, scores, allowed=bits)
    assert torch.equal(want[0], beam_topk_ref(logits, scores, b, allowed.to(device))[0])
    lone = beam_topk(logits[4:5], torch.zeros(1, 1, device=device), b, bits[1:2].clone())  # row 1 alone
    assert lone[2][0, :3].sort().values.tolist() == [7, 900, 2050] and lone[0][0, 3:].isinf().all()
    assert lone[2][0, 3:].tolist() == [0, 1, 2, 3, 4]  # then tokens in id order at -inf


@pytest.mark.parametrize("device", DEVICES)
def test_a_full_collect_buffer_falls_back_to_the_exact_search(device: str) -> None:
    """Tokens of a few groups (v mod NG) above every other group's best: more of them than the
    collect buffer holds score above the threshold, so the row finds its K-th score by bisection.
    Equal values around the K-th place check the ties there too."""
    vocab, b = 151936, 4
    ng, cap = sizes(b)["NG"], sizes(b)["CAP"]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, vocab, generator=g) - 20
    top = torch.arange(vocab) % ng < 3  # 3 groups of ~148 tokens each: > CAP above the threshold
    assert int(top.sum()) > cap
    x[:, top] = torch.randint(0, 50, (1, int(top.sum())), generator=g).float()  # many ties
    logits, scores = x.to(device), torch.tensor([[-1.0]], device=device)
    got, want = beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b)
    assert torch.equal(got[2], want[2]) and (got[0] - want[0]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_more_buffered_tokens_than_the_short_sort_takes_are_all_sorted(device: str) -> None:
    """One group (v mod NG) holds 40 tokens above every other group's best, so 40 + K - 1 tokens
    are buffered (more than 2 KP, fewer than CAP): the select kernel must sort all of them (a sort
    narrowed to the usual ~K buffered tokens would miss some); the K best are the group's."""
    vocab, b = 151936, 4
    sz = sizes(b)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, vocab, generator=g) - 20
    group = torch.nonzero(torch.arange(vocab) % sz["NG"] == 5).flatten()[:40]
    assert 2 * sz["KP"] < 40 + b - 1 < sz["CAP"]
    x[:, group] = torch.randn(2, 40, generator=g) * 3  # distinct: no ties
    logits, scores = x.to(device), torch.tensor([[-1.0, -2.0]], device=device)
    got, want = beam_topk(logits, scores, b), beam_topk_ref(logits, scores, b)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert (got[0] - want[0]).abs().max().item() <= 1e-5
    assert set(got[2].flatten().tolist()) <= set(group.tolist())


# (requests, parents, beams): on the CPU small sort widths (Triton's interpreter takes seconds a program
# at KP 512); 2 rounds at 1,024 x 2 and 200 x 8 and 40 x 60; on the GPU W2's and W5's bookkeeping too
# (128 x 128 keys take 2 rounds, 400 x 400 take 4; 7 x 300 is two chunks, one of them partial)
MERGE_SHAPES = [(3, 4, 4), (4, 3, 1), (1, 1024, 2), (2, 200, 8), (2, 40, 60)]
MERGE_SHAPES_GPU = [(8, 128, 128), (2, 400, 400), (1, 96, 96), (8, 127, 127), (2, 7, 300)]


@pytest.mark.parametrize("device,r,p,b", [("cpu", *s) for s in MERGE_SHAPES]
                         + [pytest.param("cuda", *s, marks=pytest.mark.gpu) for s in MERGE_SHAPES + MERGE_SHAPES_GPU])
def test_beam_merge_is_topk(device: str, r: int, p: int, b: int) -> None:
    """The merge in rounds returns exactly torch's top-k of each request's unique keys, in its order:
    keys as beam_candidates makes them (each rank's B best first, a rank without a row all NO_KEY)
    and in random order."""
    g = torch.Generator().manual_seed(r * p + b)
    n = p * b
    keys = torch.randperm(r * n, generator=g).mul((1 << 24) + 7).sub(1 << 40).view(r * p, b)  # unique
    ranked = keys.sort(dim=-1, descending=True).values
    if p > 1:
        ranked[p - 1::p] = NO_KEY_VALUE - torch.arange(b)  # each request's last rank has no row
    for k in (keys, ranked):
        k = k.to(device)
        want = k.view(r, -1).topk(b, dim=-1).values
        assert torch.equal(beam_merge(k, r, b), want)


def test_beam_merge_refuses_what_it_cannot_merge() -> None:
    keys = torch.arange(12, dtype=torch.int64)
    with pytest.raises(ValueError, match="B .5. <= the keys a request .4."):
        beam_merge(keys, 3, 5)
    with pytest.raises(ValueError, match="contiguous int64"):
        beam_merge(keys.float(), 3, 2)
    assert torch.equal(beam_merge(keys, 3, 4), keys.view(3, 4))  # one parent a request: already the answer


def _packing(widths: list[int], b: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """service/runtime/batch.py::pack_beam's placement: (slot [rows], src [R * B]) for requests of
    these widths, each its width of rows back to back, padding rows after."""
    slot, src = [], []
    for r, w in enumerate(widths):
        src += [len(slot) + p for p in range(w)] + [rows] * (b - w)
        slot += [r * b + p for p in range(w)]
    return torch.tensor(slot + [len(widths) * b] * (rows - len(slot))), torch.tensor(src)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", [False, True])
def test_packed_rows_give_each_rank_its_rows_keys(device: str, mask: bool) -> None:
    """Packed rows (requests of widths 3, 1, 4 and an empty slot in a [4, 4] bookkeeping, two
    padding rows): each rank gets the keys its row would get alone with the rank's flat index,
    a rank without a row gets NO_KEYs: the ATen ops the runtimes ran before."""
    b, vocab, widths, rows = 4, 3000, [3, 1, 4, 0], 10
    slot, src = _packing(widths, b, rows)
    g = torch.Generator().manual_seed(5)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, torch.bfloat16)
    scores = (-5 * torch.rand(len(widths), b, generator=g)).to(device)
    scores[0, 2] = float("-inf")  # a dead beam of a live request
    slot, src = slot.to(device), src.to(device)
    allowed = allowed_bitmask(torch.rand(rows, vocab, generator=g).to(device) < 0.3) if mask else None
    got = beam_candidates(logits, scores.reshape(-1), b, b, allowed, slot=slot, src=src)
    row_scores = torch.constant_pad_nd(scores.reshape(-1), [0, 1], float("-inf")).index_select(0, slot)
    alone = beam_candidates(logits, row_scores, b, 1, allowed) - ((slot % b) * vocab).unsqueeze(1)
    want = torch.constant_pad_nd(alone, [0, 0, 0, 1], NO_KEY_VALUE).index_select(0, src)
    assert torch.equal(got, want)
    assert (got[src == rows] == NO_KEY_VALUE).all() and (src == rows).sum() == 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_code_head_narrower_than_a_line_at_400_beams(device: str) -> None:
    """Normalisation over a catalog's codes at W5's width (tests/e2e/test_catalog_gpu.py's qwen3 case):
    768 code columns (fewer than a line of NG = 1,024: one line, seven empty parts), K = 400 (sort
    width 512) and masks allowing fewer than K columns (T = -inf: the row fills with its first
    disallowed columns at -inf). Two live rows among a request's 400 ranks (the rest have none, so
    the interpreter sorts two rows); each live rank's keys are its row's stable-sorted top K."""
    vocab, k, ranks, rows = 768, 400, 400, 2
    g = torch.Generator().manual_seed(768)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to(device)
    allowed = torch.zeros(rows, vocab, dtype=torch.bool)
    allowed[0, torch.randperm(vocab, generator=g)[:256]] = True  # a first code level
    allowed[1, torch.randperm(vocab, generator=g)[:78]] = True  # a prefix's children
    scores = torch.full((ranks,), float("-inf"))
    scores[:2] = torch.tensor([-0.5, -1.25])
    src = torch.full((ranks,), rows, dtype=torch.int64)
    src[:2] = torch.arange(2)
    keys = beam_candidates(logits, scores.to(device), k, ranks, allowed_bitmask(allowed).to(device),
                           slot=torch.arange(2, device=device), src=src.to(device))
    got_s, parents, tokens = (x.cpu() for x in decode_keys(keys[:rows], vocab))
    for r in range(rows):
        cand = torch.log_softmax(logits[r].float().cpu(), -1).masked_fill(~allowed[r], float("-inf")) + scores[r]
        want_s, want_t = torch.sort(cand, descending=True, stable=True)
        live = int(allowed[r].sum())
        assert torch.equal(tokens[r], want_t[:k]) and (parents[r] == r).all()
        assert (got_s[r, :live] - want_s[:live]).abs().max().item() <= 2e-6 and got_s[r, live:].isinf().all()
    assert (keys[rows:] == NO_KEY_VALUE).all()


@pytest.mark.parametrize("device", DEVICES)
def test_the_collect_buffers_the_ties_at_the_threshold(device: str) -> None:
    """bf16 logits tie often at the K-th group max T (~7 tokens at K = 100 here). The collect pass
    buffers every token scoring >= T, so at least K, and the select never scans a row for ties:
    each count equals the reference's count of candidates >= T, and is >= K."""
    k, vocab, rows = 100, 20000, 6
    logits, scores = _inputs(31, 1, rows, vocab, torch.bfloat16, device, scale=3.0)
    flat = scores.reshape(-1).contiguous()
    stats, count, _ = row_passes(logits, flat, torch.arange(rows, device=device), k, None)
    assert torch.allclose(stats[:, 0] + stats[:, 1], torch.logsumexp(logits.float(), -1))
    cand = ((logits.float() - stats[:, :1]) - stats[:, 1:2]) + flat.unsqueeze(1)  # the kernels' arithmetic
    thr = stats[:, 2:3]
    assert torch.equal(count[:, 0].long().cpu(), (cand >= thr).sum(1).cpu()) and (count[:, 0] >= k).all()
    assert torch.equal(count[:, 1].long().cpu(), (cand > thr).sum(1).cpu())
    assert ((cand == thr).sum(1) > 1).any(), "no row has a tie at T: the test shows nothing"


@pytest.mark.parametrize("device", DEVICES)
def test_a_plateau_of_ties_at_the_threshold_overflowing_the_buffer(device: str) -> None:
    """1,000 tokens of one equal logit at T overflow the collect buffer (CAP 256 at K = 4) while the
    tokens above T fit (2 of them; none): the select keeps T, collects those again and takes the
    plateau's first tokens by id, without the bisection (the full-buffer test above has it). Exact."""
    g = torch.Generator().manual_seed(8)
    vocab, k = 3000, 4
    logits = -10 - torch.rand(2, vocab, generator=g)
    plateau = torch.randperm(vocab, generator=g)[:1000]
    logits[:, plateau] = 5.0
    logits[0, plateau[:2]] = torch.tensor([10.0, 9.0])  # row 0: two above the plateau; row 1: the plateau alone
    logits = logits.to(device, torch.bfloat16)
    scores = torch.zeros(2, 1, device=device)
    _, count, _ = row_passes(logits, scores.reshape(-1), torch.arange(2, device=device), k, None)
    assert (count[:, 0] > sizes(k)["CAP"]).all() and count[:, 1].tolist() == [2, 0], count
    got, want = beam_topk(logits, scores, k), beam_topk_ref(logits, scores, k)
    _check(got, want, logits, scores)
    assert torch.equal(got[2], want[2])  # exact ties: the lower ids first, as the reference orders them
    assert got[2][1].tolist() == plateau.sort().values[:k].tolist()


def _keys(scores: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Keys of (score, flat index), as the kernels make them (decode_keys' inverse)."""
    bits = scores.view(torch.int32).to(torch.int64)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ((ordered + 1) << 32) - 1 - flat


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("first,codes", [(False, False), (True, False), (False, True), (True, True)])
def test_beam_commit_equals_the_aten_bookkeeping(device: str, first: bool, codes: bool) -> None:
    """The commit kernel against the ATen ops the runtimes ran (service/runtime/nodes.py before):
    decoded keys, scores masked past each width, the parents' sequences with the new tokens, each
    packed row's token and parent row; through a catalog's code columns (a padding column -1
    becomes token 0), and the first token (one parent, each beam its own sequence). A decode step
    also hands each packed row its parent row's suffix_rows for the slots written so far (j < step)
    and its own for the rest; a padding row keeps its own."""
    b, n, widths, rows = 5, 4, [5, 2, 0, 3], 12
    r, vocab, step = len(widths), 50, 0 if first else 2
    slot, src = _packing(widths, b, rows)
    g = torch.Generator().manual_seed(9 + first + 2 * codes)
    parents = torch.zeros(r, b, dtype=torch.int64) if first else torch.randint(0, b, (r, b), generator=g)
    cols = torch.randint(0, vocab, (r, b), generator=g)
    scores = -10 * torch.rand(r, b, generator=g)
    scores[1, 3] = float("-inf")
    top = _keys(scores, parents * vocab + cols)
    top[2] = NO_KEY_VALUE  # an empty request slot: parent 0, token 0
    seqs = torch.randint(0, 1000, (r, b, n), generator=g)
    code_tokens = torch.cat([torch.randint(0, 151936, (vocab - 3,), generator=g), torch.full((3,), -1)]) \
        if codes else None
    width_t = torch.tensor(widths)
    to = lambda *ts: [t.to(device) if t is not None else None for t in ts]  # noqa: E731
    slots = n - 1
    suffix_rows = None if first else torch.randint(0, rows, (rows, slots), generator=g)
    got = beam_commit(*to(top, seqs, width_t, slot), vocab, step, *to(None if first else src, code_tokens),
                      suffix_rows=None if first else suffix_rows.to(device))
    # the ATen ops (nodes.py's decode_keys, to_code_tokens, _mask_extra_beams, to_rows, gather)
    w_scores, w_parents, w_cols = decode_keys(top, vocab)
    w_tokens = w_cols if code_tokens is None else code_tokens.index_select(0, w_cols.reshape(-1)).clamp_min(0) \
        .view_as(w_cols)
    rank = torch.arange(b).unsqueeze(0)
    w_scores = w_scores.masked_fill(rank >= width_t.unsqueeze(1), float("-inf"))
    w_seqs = (seqs.clone() if first else seqs.gather(1, w_parents.unsqueeze(-1).expand_as(seqs)).clone())
    w_seqs[:, :, step] = w_tokens
    pad_rows = lambda rect: torch.constant_pad_nd(rect.reshape(-1), [0, 1], 0).index_select(0, slot)  # noqa: E731
    w_row_tokens = pad_rows(w_tokens)
    want = [w_seqs, w_scores, w_parents, w_tokens, w_row_tokens]
    if not first:
        parent_rows = pad_rows(src.index_select(0, (w_parents + torch.arange(r).unsqueeze(1) * b).reshape(-1)))
        own = torch.arange(rows).unsqueeze(1).expand(rows, slots)
        real = ((slot < r * b) & (parent_rows < rows)).unsqueeze(1)  # (a parent rank without a row: none)
        inherit = real & (torch.arange(slots).unsqueeze(0) < step)
        want += [parent_rows, torch.where(inherit, suffix_rows.index_select(0, parent_rows.clamp_max(rows - 1)), own)]
        assert not torch.equal(want[-1], own) and not torch.equal(want[-1][:, step:], suffix_rows[:, step:])
    assert (got[5] is None) == first and (got[6] is None) == first
    for name, x, y in zip(("seqs", "scores", "parents", "tokens", "row_tokens", "parent_rows", "suffix_rows"), got,
                          want):
        assert x.dtype == y.dtype and torch.equal(x.cpu(), y), name
    if codes:
        assert (got[3] >= 0).all() and (code_tokens < 0).any()


def test_bad_arguments_are_refused() -> None:
    x = torch.randn(4, 100)
    with pytest.raises(ValueError, match="contiguous rows"):
        beam_candidates(x.t(), torch.zeros(100), 2, 1)
    with pytest.raises(ValueError, match=r"src must be a contiguous int64 \[3\]"):
        beam_candidates(x, torch.zeros(3), 2, 1)
    with pytest.raises(ValueError, match=r"beam_scores must be a contiguous float32"):
        beam_candidates(x, torch.zeros(4, 1), 2, 1)
    with pytest.raises(ValueError, match="multiple of the parents"):
        beam_candidates(x, torch.zeros(4), 2, 3)
    with pytest.raises(ValueError, match=r"K \(101\) <= V \(100\)"):
        beam_candidates(x, torch.zeros(4), 101, 1)
    with pytest.raises(ValueError, match="allowed must be"):
        beam_candidates(x, torch.zeros(4), 2, 1, torch.zeros(4, 3, dtype=torch.int64))


# ---- the AOT cubins launched from C++ (the path of both runtimes on the GPU) -------------------

@pytest.fixture(scope="module")
def aot_kernels(tmp_path_factory: pytest.TempPathFactory):
    import json

    from cpp_dag import _core
    from service.model.checkpoint import weight_source

    out = tmp_path_factory.mktemp("aot_beam")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cfg = weight_source("embedded:qwen2.5-0.5b")[0]
    shape = json.dumps(dict(hidden_size=cfg.hidden_size, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads))
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--shape", shape, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _core.TritonKernels(str(out), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("r,p,b", [(8, 100, 100), (2, 400, 400), (8, 1, 100)])
def test_aot_beam_candidates_equal_the_jit_kernels_in_a_cuda_graph(aot_kernels, r: int, p: int, b: int) -> None:
    from kernels.beam_topk import merge_candidates

    logits, scores = _inputs(r * p + b, r, p, 151936, torch.bfloat16, "cuda", scale=4.0)
    flat = scores.reshape(-1).contiguous()
    scores[0, p // 2:] = float("-inf")
    flat = scores.reshape(-1).contiguous()
    eager = aot_kernels.beam_candidates(logits, flat, b, p)
    assert torch.equal(eager, beam_candidates(logits, flat, b, p)), "AOT cubins and JIT kernels disagree"
    _check(merge_candidates(eager, r, b, 151936), beam_topk_ref(logits, scores, b), logits, scores)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        aot_kernels.beam_candidates(logits, flat, b, p)  # warm-up on the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = aot_kernels.beam_candidates(logits, flat, b, p)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("codes", [False, True])
def test_aot_packed_beam_step_equals_the_jit_kernels_in_a_cuda_graph(aot_kernels, codes: bool) -> None:
    """A packed beam step as the runtimes run it (requests of widths 100, 37, 0 in a [3, 100]
    bookkeeping, padding rows): the AOT candidates with slot/src, the merge and the commit kernel
    equal the JIT kernels' eagerly and replayed from a CUDA graph."""
    b, vocab, widths, rows = 100, 151936, [100, 37, 0], 160
    slot, src = (t.cuda() for t in _packing(widths, b, rows))
    g = torch.Generator().manual_seed(77)
    logits = (4 * torch.randn(rows, vocab, generator=g)).to("cuda", torch.bfloat16)
    scores = (-5 * torch.rand(len(widths), b, generator=g)).cuda()
    seqs = torch.randint(0, vocab, (len(widths), b, 5), generator=g).cuda()
    width_t = torch.tensor(widths).cuda()
    code_tokens = torch.randint(0, 151936, (vocab,), generator=g).cuda() if codes else None

    suffix_rows = torch.randint(0, rows, (rows, 4), generator=g).cuda()

    def step(kern):
        keys = kern.beam_candidates(logits, scores.reshape(-1), b, b, None, slot, src)
        return kern.beam_commit(kern.beam_merge(keys, len(widths), b), seqs, width_t, slot, vocab, 2, src, code_tokens,
                                suffix_rows=suffix_rows)

    jit = types.SimpleNamespace(beam_candidates=beam_candidates, beam_merge=beam_merge, beam_commit=beam_commit)
    eager, want = step(aot_kernels), step(jit)
    for x, y in zip(eager, want):
        assert torch.equal(x, y), "AOT cubins and JIT kernels disagree"
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step(aot_kernels)  # warm-up on the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            captured = step(aot_kernels)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, eager):
        assert torch.equal(x, y)
