"""The beam step's selection in one pass over the logits: each parent row's top-K candidates
(log-softmax + beam score) without a float32 [rows, V] log-softmax or a top-k over B x V.

A candidate of request r is (parent p, token v) with score
    c = log_softmax(logits[r * P + p])[v] + beam_scores[r, p]      (float32; -inf where not allowed)
and the step keeps the B best of the request's P x V candidates, best first; equal scores go by
the lower flat index p * V + v first (`beam_topk_ref` states it with a stable sort). The optional
allowed-token mask applies after the log-softmax (as Hugging Face's logits processors do): the
log-sum-exp is over the whole vocabulary, a disallowed token's candidate is -inf.

The top-B of a request lies inside the union of its rows' top-B (under the same total order), so
the work is per row, then a merge of P x K candidates. Per row, four launches:
  1. `beam_stats_kernel` (rows x NUM_PARTS programs), one pass: max and sum-exp of the row's
     share, and the max of every group j = {tokens v : v mod NG == j} (strided groups, so that
     tokens close in id, often alike, land in different groups);
  2. `beam_threshold_kernel` (rows): log-sum-exp, and T = the K-th largest group max as a
     candidate score: K distinct tokens score >= T, so the row's top-K all score >= T;
  3. `beam_collect_kernel` (rows x NUM_PARTS), second pass: the tokens scoring > T into a
     per-row buffer of CAP slots (typically ~K of them: about one group in NG/K holds one);
  4. `beam_select_kernel` (rows): the buffered tokens, plus the first tokens (by id) scoring
     exactly T when fewer than K score above it, sorted as 64-bit keys (score, then flat index)
     -> the row's K best keys (a sort of 2 KP keys when at most that many are buffered, the usual
     case, else of all CAP). A row whose buffer overflowed finds its K-th score by bisection
     over the row instead (exact, slow, rare).
A row whose beam score is -inf (a dead beam of a narrow request) reads nothing: its K candidates
are tokens 0..K-1 at -inf, as the reference orders them.
Then `merge_candidates` (torch: top-B of the request's P x K keys, which are unique, so no ties
remain; then the keys decoded) gives (scores [R, B], parents, tokens). Both runtimes run those
very ATen ops after the same kernels, which keeps them byte-identical.

Keys: int64 (ordered float bits of c) << 32 | (2^32 - 1 - flat index): larger is better, and one
signed comparison orders by score, then by lower flat index.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS

NUM_PARTS = 8  # programs per row in the streaming kernels (1, 3): parallelism for few rows (8: measured best, H200)


def sizes(num_candidates: int) -> dict[str, int]:
    """The compile-time sizes for K candidates per row (cpp_dag/triton_kernels.cpp mirrors them):
    KP the sort width (a power of two >= max(K, 2)), NG the groups per row (>= 2 KP: T is then typically
    the K-th largest of NG/K-sparse maxima), CAP the collect buffer (4x the typical count); the
    select kernel's warps (its sort of CAP 64-bit keys)."""
    kp = max(2, triton.next_power_of_2(num_candidates))  # tl.topk needs k >= 2
    return {"KP": kp, "NG": max(1024, 2 * kp), "CAP": min(max(4 * kp, 256), 2048),
            "select_warps": 8 if kp >= 256 else 4}


@triton.jit
def _cand(x, row_max, log_sum, s):
    """Candidate score in float32, as log_softmax(x) + s rounds it; +0.0 for -0.0 (one key per value)."""
    c = ((x - row_max) - log_sum) + s
    return tl.where(c == 0.0, 0.0, c)


@triton.jit
def _allowed(allowed_ptr, row, cols, inb, words):
    """Bit v % 32 of word v // 32 of the row's allowed-token mask."""
    w = tl.load(allowed_ptr + row * words + (cols >> 5), mask=inb, other=0)
    return ((w >> (cols & 31)) & 1) != 0


@triton.jit
def _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK: tl.constexpr):
    """Candidate scores of tokens `cols` of a row (-inf outside the row, for a dead row, or not allowed)."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=float("-inf")).to(tl.float32)
    c = _cand(x, row_max, log_sum, s)
    if HAS_MASK:
        c = tl.where(_allowed(allowed_ptr, row, cols, inb, words), c, float("-inf"))
    return c


@triton.jit
def _key(c, flat):
    """int64 key: ordered bits of c (a signed int32 that sorts like the float) above 2^32-1-flat."""
    bits = c.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return ((ordered.to(tl.int64) + 1) << 32) - 1 - flat


@triton.jit
def _from_ordered(key32):
    return (key32 ^ ((key32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _stats_line(x_ptr, allowed_ptr, row, stride_x, words, vocab, line, run_max, run_sum, gmax,
                NG: tl.constexpr, HAS_MASK: tl.constexpr):
    """One line (NG tokens) into the running max and sum of exp(x - max) of each column (group),
    and the group maxima of the allowed tokens: element-wise, no reduction across the program, so
    the loop over lines streams (the reductions happen once, after it)."""
    cols = line * NG + tl.arange(0, NG)
    inb = cols < vocab
    x = tl.load(x_ptr + row * stride_x + cols, mask=inb, other=float("-inf")).to(tl.float32)
    new_max = tl.maximum(run_max, x)
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
    if HAS_MASK:
        x = tl.where(_allowed(allowed_ptr, row, cols, inb, words), x, float("-inf"))
        gmax = tl.maximum(gmax, x)
    return new_max, run_sum, gmax


@triton.jit
def beam_stats_kernel(x_ptr, s_ptr, allowed_ptr, pmax_ptr, psum_ptr, gpart_ptr, vocab, stride_x, words,
                      NUM_PARTS: tl.constexpr, NG: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (row, part) reads lines part, part + NUM_PARTS, ... of the row seen as [V / NG, NG]:
    its max and sum of exp(x - max) (online over lines), and per column j (group j) the max of the
    allowed tokens. Writes pmax/psum [rows, NUM_PARTS], gpart [rows, NUM_PARTS, NG]."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    live = tl.load(s_ptr + row) > float("-inf")
    j = tl.arange(0, NG)
    run_max = tl.full([NG], float("-inf"), tl.float32)  # per column: the online softmax of its tokens
    run_sum = tl.zeros([NG], tl.float32)
    gmax = tl.full([NG], float("-inf"), tl.float32)  # with a mask: the allowed tokens' max (else run_max)
    lines = (vocab + NG - 1) // NG
    if live:  # a dead beam's candidates are -inf whatever its logits: read nothing
        if not INTERPRETED:  # a for loop: Triton software-pipelines the loads across iterations
            for line in range(part, lines, NUM_PARTS):
                run_max, run_sum, gmax = _stats_line(x_ptr, allowed_ptr, row, stride_x, words, vocab, line, run_max,
                                                     run_sum, gmax, NG, HAS_MASK)
        else:  # Triton 3.6's interpreter (numpy >= 2.3) cannot bound a range() by a tensor; same body
            line = part
            while line < lines:
                run_max, run_sum, gmax = _stats_line(x_ptr, allowed_ptr, row, stride_x, words, vocab, line, run_max,
                                                     run_sum, gmax, NG, HAS_MASK)
                line += NUM_PARTS
    part_max = tl.max(run_max, axis=0)
    safe = tl.where(part_max == float("-inf"), 0.0, part_max)
    part_sum = tl.sum(run_sum * tl.exp(run_max - safe), axis=0)
    tl.store(pmax_ptr + row * NUM_PARTS + part, part_max)
    tl.store(psum_ptr + row * NUM_PARTS + part, part_sum)
    tl.store(gpart_ptr + (row * NUM_PARTS + part) * NG + j, gmax if HAS_MASK else run_max)


@triton.jit
def beam_threshold_kernel(s_ptr, pmax_ptr, psum_ptr, gpart_ptr, stats_ptr, count_ptr, num_candidates,
                          NUM_PARTS: tl.constexpr, NG: tl.constexpr, KP: tl.constexpr):
    """Per row: its max and log(sum exp(x - max)), and T = the K-th largest group max as a
    candidate score (-inf with fewer than K allowed groups). Writes stats [rows, 4] = (max,
    log-sum, T, -) and zeroes the row's collect count."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(s_ptr + row)
    live = s > float("-inf")
    p = tl.arange(0, NUM_PARTS)
    pmax = tl.load(pmax_ptr + row * NUM_PARTS + p)
    psum = tl.load(psum_ptr + row * NUM_PARTS + p)
    # a dead row gets finite placeholders 0, 0 (its candidates are -inf whatever they are)
    row_max = tl.where(live, tl.max(pmax, axis=0), 0.0)
    log_sum = tl.log(tl.where(live, tl.sum(psum * tl.exp(pmax - row_max), axis=0), 1.0))
    j = tl.arange(0, NG)
    gmax = tl.full([NG], float("-inf"), tl.float32)
    for q in tl.static_range(NUM_PARTS):
        gmax = tl.maximum(gmax, tl.load(gpart_ptr + (row * NUM_PARTS + q) * NG + j))
    top = tl.topk(_cand(gmax, row_max, log_sum, s), KP)  # [KP] best first
    thr = tl.max(tl.where(tl.arange(0, KP) == num_candidates - 1, top, float("-inf")), axis=0)
    tl.store(stats_ptr + row * 4 + 0, row_max)
    tl.store(stats_ptr + row * 4 + 1, log_sum)
    tl.store(stats_ptr + row * 4 + 2, thr)
    tl.store(count_ptr + row, 0)


@triton.jit
def _collect_line(x_ptr, allowed_ptr, count_ptr, buf_ptr, row, stride_x, words, vocab, cap, line, row_max, log_sum,
                  s, thr, NG: tl.constexpr, HAS_MASK: tl.constexpr):
    cols = line * NG + tl.arange(0, NG)
    inb = cols < vocab
    c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK)
    sel = (c > thr) & inb
    # a slot per selected token from the row's counter (few tokens a row: no reduction over the line)
    pos = tl.atomic_add(count_ptr + row + tl.zeros_like(cols), 1, mask=sel, sem="relaxed")
    tl.store(buf_ptr + row * cap + pos, cols, mask=sel & (pos < cap))


@triton.jit
def beam_collect_kernel(x_ptr, s_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, vocab, stride_x, words, cap,
                        NUM_PARTS: tl.constexpr, NG: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (row, part), the lines of `beam_stats_kernel`: appends the tokens scoring > T to the row's
    buffer buf [rows, cap] (slots taken with an atomic counter: any order, `beam_select_kernel` sorts);
    the count keeps growing past cap, which tells `beam_select_kernel` that the buffer overflowed."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    s = tl.load(s_ptr + row)
    row_max = tl.load(stats_ptr + row * 4 + 0)
    log_sum = tl.load(stats_ptr + row * 4 + 1)
    thr = tl.load(stats_ptr + row * 4 + 2)
    lines = (vocab + NG - 1) // NG
    if s > float("-inf"):
        if not INTERPRETED:
            for line in range(part, lines, NUM_PARTS):
                _collect_line(x_ptr, allowed_ptr, count_ptr, buf_ptr, row, stride_x, words, vocab, cap, line,
                              row_max, log_sum, s, thr, NG, HAS_MASK)
        else:
            line = part
            while line < lines:
                _collect_line(x_ptr, allowed_ptr, count_ptr, buf_ptr, row, stride_x, words, vocab, cap, line,
                              row_max, log_sum, s, thr, NG, HAS_MASK)
                line += NUM_PARTS


@triton.jit
def _count_at_least(x_ptr, allowed_ptr, row, stride_x, words, vocab, row_max, log_sum, s, bound,
                    NG: tl.constexpr, HAS_MASK: tl.constexpr):
    j = tl.arange(0, NG)
    total = 0
    start = 0
    while start < vocab:  # while loops in this rare path: the interpreter runs them too
        cols = start + j
        inb = cols < vocab
        c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK)
        total += tl.sum(((c >= bound) & inb).to(tl.int32), axis=0)
        start += NG
    return total


@triton.jit
def beam_select_kernel(x_ptr, s_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, out_ptr, vocab, stride_x, words,
                       num_candidates, num_parents,
                       NG: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, HAS_MASK: tl.constexpr):
    """Per row: its K best candidates as keys, best first, into out [rows, K]."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(s_ptr + row)
    row_max = tl.load(stats_ptr + row * 4 + 0)
    log_sum = tl.load(stats_ptr + row * 4 + 1)
    thr = tl.load(stats_ptr + row * 4 + 2)
    n = tl.load(count_ptr + row)
    k = num_candidates
    j = tl.arange(0, NG)
    if n > CAP:
        # the buffer overflowed (many tokens above T: a row of many near-equal scores). Bisection
        # over the ordered bits of the score for the K-th largest: the largest b with
        # count(c >= b) >= K; lo always qualifies, hi never does.
        bits = thr.to(tl.int32, bitcast=True)
        lo = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
        hi = tl.full([], 0x7F800000 + 1, tl.int64)  # past +inf
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            cnt = _count_at_least(x_ptr, allowed_ptr, row, stride_x, words, vocab, row_max, log_sum, s,
                                  _from_ordered(mid.to(tl.int32)), NG, HAS_MASK)
            lo = tl.where(cnt >= k, mid, lo)
            hi = tl.where(cnt >= k, hi, mid)
        thr = _from_ordered(lo.to(tl.int32))
        n = 0  # fewer than K score above the K-th: they all fit
        start = 0
        while start < vocab:
            cols = start + j
            inb = cols < vocab
            c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK)
            sel = ((c > thr) & inb).to(tl.int32)
            tl.store(buf_ptr + row * CAP + n + tl.cumsum(sel, axis=0) - 1, cols, mask=sel != 0)
            n += tl.sum(sel, axis=0)
            start += NG
    if n < k:
        # the K-th largest score is T itself: add the first K - n tokens (by id) scoring exactly T.
        # At least K tokens score >= T, so the scan ends before the row does.
        need = k - n
        got = 0
        start = 0
        while (got < need) & (start < vocab):
            cols = start + j
            inb = cols < vocab
            c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK)
            eq = ((c == thr) & inb).to(tl.int32)
            pos = got + tl.cumsum(eq, axis=0) - 1
            tl.store(buf_ptr + row * CAP + n + pos, cols, mask=(eq != 0) & (pos < need))
            got += tl.sum(eq, axis=0)
            start += NG
        n = k
    tl.debug_barrier()  # this program's buffer stores are visible to all its threads
    # typically ~K tokens are buffered: sort the first 2 KP slots then, all CAP only when more are
    if n <= 2 * KP:
        top = _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, num_parents, n, row_max,
                            log_sum, s, CAP, 2 * KP, KP, HAS_MASK)
    else:
        top = _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, num_parents, n, row_max,
                            log_sum, s, CAP, CAP, KP, HAS_MASK)
    kk = tl.arange(0, KP)
    tl.store(out_ptr + row * k + kk, top, mask=kk < k)


@triton.jit
def _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, num_parents, n, row_max, log_sum, s,
                  CAP: tl.constexpr, WIDTH: tl.constexpr, KP: tl.constexpr, HAS_MASK: tl.constexpr):
    """The KP best keys of the row's first n (<= WIDTH) buffered tokens, best first."""
    i = tl.arange(0, WIDTH)
    valid = i < n
    tok = tl.load(buf_ptr + row * CAP + i, mask=valid, other=0)
    c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, tok, valid, row_max, log_sum, s, HAS_MASK)
    flat = (row % num_parents) * vocab + tok
    key = tl.where(valid, _key(c, flat), -(2 ** 63))
    return tl.topk(key, KP)


def _check(logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
           allowed: torch.Tensor | None) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16,
                                                                            torch.float16):
        raise ValueError(f"beam_topk: logits must be [rows, V] float32/bfloat16/float16 with contiguous rows, got "
                         f"{list(logits.shape)} {logits.dtype} strides {logits.stride()}")
    rows, vocab = logits.shape
    if beam_scores.dtype != torch.float32 or beam_scores.shape != (rows,) or not beam_scores.is_contiguous():
        raise ValueError(f"beam_topk: beam_scores must be a contiguous float32 [{rows}], got "
                         f"{list(beam_scores.shape)} {beam_scores.dtype}")
    if not 1 <= num_candidates <= min(vocab, 1 << 16) or num_parents < 1 or rows % num_parents:
        raise ValueError(f"beam_topk: need 1 <= K ({num_candidates}) <= V ({vocab}) and rows ({rows}) a multiple "
                         f"of the parents per request ({num_parents})")
    if num_parents * vocab >= 1 << 32:
        raise ValueError("beam_topk: parents x vocabulary must stay below 2^32 (the key's index field)")
    if allowed is not None and (allowed.dtype != torch.int32 or allowed.shape != (rows, (vocab + 31) // 32)
                                or not allowed.is_contiguous()):
        raise ValueError(f"beam_topk: allowed must be a contiguous int32 [{rows}, {(vocab + 31) // 32}] bitmask")


def beam_candidates(logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
                    allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, V] (rows = R x P, request-major); beam_scores [rows] float32 (the parent's
    score; -inf: a dead beam); allowed: None or an int32 [rows, ceil(V / 32)] bitmask (bit v % 32
    of word v // 32: token v allowed). Returns keys [rows, K] int64, each row's K best first."""
    _check(logits, beam_scores, num_candidates, num_parents, allowed)
    rows, vocab = logits.shape
    sz = sizes(num_candidates)
    ng, kp, cap = sz["NG"], sz["KP"], sz["CAP"]
    dev = logits.device
    pmax = torch.empty(rows, NUM_PARTS, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    gpart = torch.empty(rows, NUM_PARTS, ng, dtype=torch.float32, device=dev)
    stats = torch.empty(rows, 4, dtype=torch.float32, device=dev)
    count = torch.empty(rows, dtype=torch.int32, device=dev)
    buf = torch.empty(rows, cap, dtype=torch.int32, device=dev)
    keys = torch.empty(rows, num_candidates, dtype=torch.int64, device=dev)
    mask = allowed if allowed is not None else count  # never read without HAS_MASK
    words = (vocab + 31) // 32
    has_mask = allowed is not None
    stride = logits.stride(0)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    beam_stats_kernel[(rows, NUM_PARTS)](logits, beam_scores, mask, pmax, psum, gpart, vocab, stride, words,
                                         NUM_PARTS=NUM_PARTS, NG=ng, HAS_MASK=has_mask, INTERPRETED=interpreted,
                                         **COMPILE_OPTIONS)
    beam_threshold_kernel[(rows,)](beam_scores, pmax, psum, gpart, stats, count, num_candidates,
                                   NUM_PARTS=NUM_PARTS, NG=ng, KP=kp, **COMPILE_OPTIONS)
    beam_collect_kernel[(rows, NUM_PARTS)](logits, beam_scores, mask, stats, count, buf, vocab, stride, words, cap,
                                           NUM_PARTS=NUM_PARTS, NG=ng, HAS_MASK=has_mask, INTERPRETED=interpreted,
                                           **COMPILE_OPTIONS)
    beam_select_kernel[(rows,)](logits, beam_scores, mask, stats, count, buf, keys, vocab, stride, words,
                                num_candidates, num_parents, NG=ng, KP=kp, CAP=cap, HAS_MASK=has_mask,
                                num_warps=sz["select_warps"], **COMPILE_OPTIONS)
    return keys


def decode_keys(keys: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [..., B] int64 -> (scores float32, parents int64, tokens int64) of the same shape."""
    ordered = keys >> 32  # the score's ordered bits (fits an int32)
    flat = (ordered << 32) + 0xFFFFFFFF - keys
    scores = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(torch.int32).view(torch.float32)
    parents = torch.div(flat, vocab, rounding_mode="floor")
    return scores, parents, flat - parents * vocab


# The merge in rounds: top-B of every MERGE_GROUP x B keys, then of the winners. torch's top-k
# runs a slice per thread block, so one slice of B x B keys a request is slow at W2's width: on the
# H200 (2026-12-04, `bench_kernels --only beam_merge`, 8 requests) 113.6 us at B = 128 against
# 76.9 in rounds, 76.6 against 56.2 at B = 96; but 36.7 against 39.7 at B = 48, and 125-139
# against 154-224 at B = 400 (torch's multi-block top-k for large slices wins there): rounds only
# for widths in MERGE_ROUNDS_WIDTHS.
MERGE_GROUP = 8
MERGE_ROUNDS_WIDTHS = range(96, 129)


def top_keys(keys: torch.Tensor, num_beams: int) -> torch.Tensor:
    """keys [R, n] unique -> the num_beams largest of each row, largest first: exactly
    keys.topk(num_beams).values; for widths in MERGE_ROUNDS_WIDTHS in rounds over chunks of
    MERGE_GROUP x num_beams keys while a round leaves under half of them (the top B of a union
    are among each part's top B)."""
    r, chunk = keys.shape[0], MERGE_GROUP * num_beams
    while num_beams in MERGE_ROUNDS_WIDTHS and keys.shape[1] >= 2 * chunk and keys.shape[1] % chunk == 0:
        keys = keys.reshape(-1, chunk).topk(num_beams, dim=-1).values.reshape(r, -1)
    return keys.topk(num_beams, dim=-1).values


def merge_candidates(keys: torch.Tensor, num_requests: int, num_beams: int,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [R x P, K] (beam_candidates) -> the B best of each request's P x K candidates:
    (scores [R, B] float32, parents [R, B] int64, tokens [R, B] int64), best first. The keys are
    unique, so the top-k has no ties to break. cpp_dag/node_beam.cpp runs the same ops."""
    per_request = keys.view(num_requests, -1)
    if per_request.shape[1] != num_beams:  # one parent per request (beam_init): already the answer
        per_request = top_keys(per_request, num_beams)
    return decode_keys(per_request, vocab)


def beam_topk(logits: torch.Tensor, beam_scores: torch.Tensor, num_beams: int,
              allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R x P, V]; beam_scores [R, P] float32 -> (scores, parents, tokens), each [R, B]:
    the B best candidates of each request (see the module docstring), best first."""
    r, p = beam_scores.shape
    keys = beam_candidates(logits, beam_scores.reshape(-1).contiguous(), num_beams, p, allowed)
    return merge_candidates(keys, r, num_beams, logits.shape[1])


def allowed_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, V] -> int32 [rows, ceil(V / 32)]: bit v % 32 of word v // 32 is allowed[:, v]."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=allowed.device)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.view(rows, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def beam_topk_ref(logits: torch.Tensor, beam_scores: torch.Tensor, num_beams: int,
                  allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch, same arguments (allowed: the int32 bitmask, or a bool [rows, V]): the
    definition, with a float32 log-softmax and a stable sort over each request's P x V candidates."""
    r, p = beam_scores.shape
    vocab = logits.shape[1]
    cand = torch.log_softmax(logits.float(), dim=-1)
    if allowed is not None:
        if allowed.dtype != torch.bool:
            bits = allowed.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=allowed.device)
            allowed = (bits & 1).bool().view(allowed.shape[0], -1)[:, :vocab]
        cand = cand.masked_fill(~allowed, float("-inf"))
    cand = (cand.view(r, p, vocab) + beam_scores.float().unsqueeze(-1)).view(r, p * vocab)
    scores, flat = torch.sort(cand, dim=-1, descending=True, stable=True)
    scores, flat = scores[:, :num_beams], flat[:, :num_beams]
    parents = torch.div(flat, vocab, rounding_mode="floor")
    return scores, parents, flat - parents * vocab
