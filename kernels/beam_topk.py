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
  3. `beam_collect_kernel` (rows x NUM_PARTS), second pass: the tokens scoring >= T (> T when T
     is -inf: a masked row with fewer than K allowed groups) into a per-row buffer of CAP slots
     (typically ~K of them: about one group in NG/K holds one, and the ties at T, which bf16
     logits make common: ~7 at K = 100);
  4. `beam_select_kernel` (ranks): the buffered tokens of the rank's row sorted as 64-bit keys
     (score, then flat index) -> the K best keys (a sort of 2 KP keys when at most that many are
     buffered, the usual case, else of all CAP). With T = -inf, fewer than K may be buffered: the
     first tokens (by id) scoring -inf complete them. A row whose buffer overflowed takes one more
     pass: when the tokens strictly above T fit (a plateau of equal scores at T overflowed it) it
     collects them again and scans for the first ties at T by id; else it finds its K-th score by
     bisection over the row (exact, slow, rare).
A row whose beam score is -inf (a dead beam of a narrow request) reads nothing: its K candidates
are tokens 0..K-1 at -inf, as the reference orders them.
The rows are packed (each request its own width of rows, padding after them) while the
bookkeeping is [R, P]: slot (each row's rank) gives a row its score, src (each rank's row) gives a
rank its keys, with the flat index (rank % P) * V + token; a rank without a row gets NO_KEYs.
Then `beam_merge_kernel` (top-B of the request's P x K keys, which are unique, so no ties remain;
in rounds over chunks, several programs a request) and `beam_commit_kernel` (the keys decoded into
scores, parents, tokens, the sequences and each packed row's next token and parent row, in one
launch) finish the step. Both runtimes run those very ops, which keeps them byte-identical.

Keys: int64 (ordered float bits of c) << 32 | (2^32 - 1 - flat index): larger is better, and one
signed comparison orders by score, then by lower flat index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS, interpreted

# a rank without a row (a request narrower than its bucket): below every candidate's key (its score
# bits under -inf's) and decoded to parent 0, token 0; the merge never keeps one (a request's rank 0
# always has a row, with B candidates)
NO_KEY_VALUE = -(2 ** 63) + 0xFFFFFFFF
NO_KEY = tl.constexpr(NO_KEY_VALUE)
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
def _top(x, KP: tl.constexpr, INTERPRETED: tl.constexpr):
    """tl.topk(x, KP) of a 1-D x: its KP largest, largest first. Under Triton's CPU interpreter the
    same values are taken by rank instead: tl.topk's bitonic network runs a Python-level reduction
    there for each compare-and-swap (~50 ms each, ~60 a sort: most of the CPU test suite's time in
    the beam kernels), where an [N, N] comparison is one numpy operation. Equal values take
    distinct ranks by position, so the values are tl.topk's (the candidate scores have no -0.0,
    `_cand`; the keys are unique). Compiled, it is tl.topk: the branch is a constexpr's."""
    if INTERPRETED:
        if x.shape[0] <= 1024:  # [N, N] within Triton's largest tensor (2^20 elements)
            i = tl.arange(0, x.shape[0])
            xi, xj = x[:, None], x[None, :]
            ahead = (xj > xi) | ((xj == xi) & (i[None, :] < i[:, None]))  # [N, N]: x[j] goes before x[i]
            rank = tl.sum(ahead.to(tl.int32), axis=1)  # 0 .. N-1, each once
            hit = rank[None, :] == tl.arange(0, KP)[:, None]  # [KP, N]: one x a row
            top = tl.max(tl.where(hit, x[None, :], tl.min(x, axis=0)), axis=1)
        else:
            top = tl.topk(x, KP)
    else:
        top = tl.topk(x, KP)
    return top


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
def _row_score(s_ptr, slot_ptr, row, num_ranks):
    """The beam score of a packed row: scores[slot[row]]; -inf for a padding row (slot >= num_ranks)."""
    rank = tl.load(slot_ptr + row)
    return tl.load(s_ptr + rank, mask=rank < num_ranks, other=float("-inf"))


@triton.jit
def beam_stats_kernel(x_ptr, s_ptr, slot_ptr, allowed_ptr, pmax_ptr, psum_ptr, gpart_ptr, vocab, stride_x, words,
                      num_ranks, NUM_PARTS: tl.constexpr, NG: tl.constexpr, HAS_MASK: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Program (row, part) reads lines part, part + NUM_PARTS, ... of the row seen as [V / NG, NG]:
    its max and sum of exp(x - max) (online over lines), and per column j (group j) the max of the
    allowed tokens. Writes pmax/psum [rows, NUM_PARTS], gpart [rows, NUM_PARTS, NG]."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    live = _row_score(s_ptr, slot_ptr, row, num_ranks) > float("-inf")
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
def beam_threshold_kernel(s_ptr, slot_ptr, pmax_ptr, psum_ptr, gpart_ptr, stats_ptr, count_ptr, num_candidates,
                          num_ranks, NUM_PARTS: tl.constexpr, NG: tl.constexpr, KP: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    """Per row: its max and log(sum exp(x - max)), and T = the K-th largest group max as a
    candidate score (-inf with fewer than K allowed groups). Writes stats [rows, 4] = (max,
    log-sum, T, the row's beam score s) and zeroes the row's collect counts."""
    row = tl.program_id(0).to(tl.int64)
    s = _row_score(s_ptr, slot_ptr, row, num_ranks)
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
    top = _top(_cand(gmax, row_max, log_sum, s), KP, INTERPRETED)  # [KP] best first
    thr = tl.max(tl.where(tl.arange(0, KP) == num_candidates - 1, top, float("-inf")), axis=0)
    tl.store(stats_ptr + row * 4 + 0, row_max)
    tl.store(stats_ptr + row * 4 + 1, log_sum)
    tl.store(stats_ptr + row * 4 + 2, thr)
    tl.store(stats_ptr + row * 4 + 3, s)
    tl.store(count_ptr + row * 2 + tl.arange(0, 2), tl.zeros([2], tl.int32))


@triton.jit
def _collect_line(x_ptr, allowed_ptr, count_ptr, buf_ptr, row, stride_x, words, vocab, cap, line, row_max, log_sum,
                  s, thr, NG: tl.constexpr, HAS_MASK: tl.constexpr):
    cols = line * NG + tl.arange(0, NG)
    inb = cols < vocab
    c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, cols, inb, row_max, log_sum, s, HAS_MASK)
    # >= T takes the ties at T too (the select kernel then needs no scan for them); a -inf T would take
    # every disallowed token
    above = (c > thr) & inb
    sel = tl.where(thr > float("-inf"), c >= thr, c > thr) & inb
    # a slot per selected token from the row's counter (few tokens a row: no reduction over the line);
    # the second counter: those strictly above T (the select's way out when the ties overflow)
    pos = tl.atomic_add(count_ptr + row * 2 + tl.zeros_like(cols), 1, mask=sel, sem="relaxed")
    tl.store(buf_ptr + row * cap + pos, cols, mask=sel & (pos < cap))
    tl.atomic_add(count_ptr + row * 2 + 1 + tl.zeros_like(cols), 1, mask=above, sem="relaxed")


@triton.jit
def beam_collect_kernel(x_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, vocab, stride_x, words, cap,
                        NUM_PARTS: tl.constexpr, NG: tl.constexpr, HAS_MASK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (row, part), the lines of `beam_stats_kernel`: appends the tokens scoring >= T (> T when T
    is -inf) to the row's buffer buf [rows, cap] (slots taken with an atomic counter: any order,
    `beam_select_kernel` sorts); count [rows, 2] holds (tokens >= T, tokens > T), the first growing
    past cap, which tells `beam_select_kernel` that the buffer overflowed."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    s = tl.load(stats_ptr + row * 4 + 3)
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
def beam_select_kernel(x_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, src_ptr, out_ptr, vocab, stride_x, words,
                       num_candidates, num_parents, num_rows,
                       NG: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, HAS_MASK: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    """Per rank (program): the K best candidates of its packed row src[rank], best first, as keys
    whose flat index is (rank % num_parents) * V + token, into out [ranks, K]; a rank with no row
    (src[rank] >= num_rows) gets K NO_KEYs."""
    rank = tl.program_id(0).to(tl.int64)
    row = tl.load(src_ptr + rank)
    if row < num_rows:
        top = _select_row(x_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, row, rank % num_parents, vocab,
                          stride_x, words, num_candidates, NG, KP, CAP, HAS_MASK, INTERPRETED)
    else:
        top = tl.full([KP], NO_KEY, tl.int64)
    kk = tl.arange(0, KP)
    tl.store(out_ptr + rank * num_candidates + kk, top, mask=kk < num_candidates)


@triton.jit
def _select_row(x_ptr, allowed_ptr, stats_ptr, count_ptr, buf_ptr, row, parent, vocab, stride_x, words,
                num_candidates, NG: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, HAS_MASK: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """A row's KP best keys, best first (the caller stores the first K)."""
    s = tl.load(stats_ptr + row * 4 + 3)
    row_max = tl.load(stats_ptr + row * 4 + 0)
    log_sum = tl.load(stats_ptr + row * 4 + 1)
    thr = tl.load(stats_ptr + row * 4 + 2)
    n = tl.load(count_ptr + row * 2)
    above = tl.load(count_ptr + row * 2 + 1)
    k = num_candidates
    j = tl.arange(0, NG)
    if n > CAP:
        # the buffer overflowed. When the tokens strictly above T fit (a plateau of many equal scores
        # at T overflowed it), T stays the threshold; else (many near-equal scores above T) bisection
        # over the ordered bits of the score for the K-th largest: the largest b with
        # count(c >= b) >= K; lo always qualifies, hi never does. Then the tokens above it, again
        # (fewer than CAP: they fit), and the scan below for the ties.
        if above > CAP:
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
        n = 0
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
        # the K-th largest score is T itself (-inf, an overflowing plateau's, or the bisection's): add the
        # first K - n tokens (by id) scoring exactly T. At least K tokens score >= T, so the scan ends
        # before the row does.
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
        top = _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, parent, n, row_max,
                            log_sum, s, CAP, 2 * KP, KP, HAS_MASK, INTERPRETED)
    else:
        top = _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, parent, n, row_max,
                            log_sum, s, CAP, CAP, KP, HAS_MASK, INTERPRETED)
    return top


@triton.jit
def _buffered_top(x_ptr, allowed_ptr, buf_ptr, row, stride_x, words, vocab, parent, n, row_max, log_sum, s,
                  CAP: tl.constexpr, WIDTH: tl.constexpr, KP: tl.constexpr, HAS_MASK: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    """The KP best keys of the row's first n (<= WIDTH) buffered tokens, best first (flat index
    parent * V + token)."""
    i = tl.arange(0, WIDTH)
    valid = i < n
    tok = tl.load(buf_ptr + row * CAP + i, mask=valid, other=0)
    c = _scores_at(x_ptr, allowed_ptr, row, stride_x, words, tok, valid, row_max, log_sum, s, HAS_MASK)
    flat = parent * vocab + tok
    key = tl.where(valid, _key(c, flat), -(2 ** 63))
    return _top(key, KP, INTERPRETED)


def _check(logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
           allowed: torch.Tensor | None, slot: torch.Tensor, src: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype not in (torch.float32, torch.bfloat16,
                                                                            torch.float16):
        raise ValueError(f"beam_topk: logits must be [rows, V] float32/bfloat16/float16 with contiguous rows, got "
                         f"{list(logits.shape)} {logits.dtype} strides {logits.stride()}")
    rows, vocab = logits.shape
    ranks = beam_scores.shape[0] if beam_scores.dim() == 1 else -1
    if beam_scores.dtype != torch.float32 or ranks < 1 or not beam_scores.is_contiguous():
        raise ValueError(f"beam_topk: beam_scores must be a contiguous float32 [ranks], got "
                         f"{list(beam_scores.shape)} {beam_scores.dtype}")
    for name, t, n in (("slot", slot, rows), ("src", src, ranks)):
        if t.dtype != torch.int64 or t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"beam_topk: {name} must be a contiguous int64 [{n}], got {list(t.shape)} {t.dtype}")
    if not 1 <= num_candidates <= min(vocab, 1 << 16) or num_parents < 1 or ranks % num_parents:
        raise ValueError(f"beam_topk: need 1 <= K ({num_candidates}) <= V ({vocab}) and ranks ({ranks}) a multiple "
                         f"of the parents per request ({num_parents})")
    if num_parents * vocab >= 1 << 32:
        raise ValueError("beam_topk: parents x vocabulary must stay below 2^32 (the key's index field)")
    if allowed is not None and (allowed.dtype != torch.int32 or allowed.shape != (rows, (vocab + 31) // 32)
                                or not allowed.is_contiguous()):
        raise ValueError(f"beam_topk: allowed must be a contiguous int32 [{rows}, {(vocab + 31) // 32}] bitmask")


def beam_candidates(logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
                    allowed: torch.Tensor | None = None, slot: torch.Tensor | None = None,
                    src: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, V] (packed beam rows); beam_scores [ranks] float32 (the [R, P] bookkeeping
    flattened, request-major; -inf: a dead beam); slot [rows] int64: each row's rank (>= ranks: a
    padding row, read as dead); src [ranks] int64: each rank's row (>= rows: a rank without one);
    slot and src None: rows are the ranks. allowed: None or an int32 [rows, ceil(V / 32)] bitmask
    (bit v % 32 of word v // 32: token v allowed). Returns keys [ranks, K] int64: each rank's K best
    first, flat index (rank % P) * V + token; NO_KEY for a rank without a row."""
    rows = logits.shape[0]
    if slot is None and src is None:
        slot = src = torch.arange(rows, device=logits.device)
    _check(logits, beam_scores, num_candidates, num_parents, allowed, slot, src)
    keys, launches = candidate_launches(logits, beam_scores, num_candidates, num_parents, allowed, slot, src)
    for _, launch in launches:
        launch()
    return keys


def candidate_launches(logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
                       allowed: torch.Tensor | None, slot: torch.Tensor, src: torch.Tensor
                       ) -> tuple[torch.Tensor, list[tuple[str, Callable[[], None]]]]:
    """beam_candidates' keys (not yet written) and its four launches, (name, fn) in order, on
    checked arguments; ops/bench/bench_kernels.py times each alone."""
    rows, vocab = logits.shape
    ranks = beam_scores.shape[0]
    sz = sizes(num_candidates)
    (stats, count, buf), launches = row_pass_launches(logits, beam_scores, slot, num_candidates, allowed)
    keys = torch.empty(ranks, num_candidates, dtype=torch.int64, device=logits.device)

    def select() -> None:
        beam_select_kernel[(ranks,)](logits, allowed if allowed is not None else count, stats, count, buf, src, keys,
                                     vocab, logits.stride(0), (vocab + 31) // 32, num_candidates, num_parents, rows,
                                     NG=sz["NG"], KP=sz["KP"], CAP=sz["CAP"], HAS_MASK=allowed is not None,
                                     INTERPRETED=interpreted(),
                                     num_warps=sz["select_warps"], **COMPILE_OPTIONS)

    return keys, launches + [("select", select)]


def row_passes(logits: torch.Tensor, beam_scores: torch.Tensor, slot: torch.Tensor, num_candidates: int,
               allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three launches before the select (stats, threshold, collect): stats [rows, 4] (max,
    log-sum, T, s), count [rows, 2] (tokens scoring >= T, buffered up to CAP; those > T) and buf [rows, CAP]."""
    buffers, launches = row_pass_launches(logits, beam_scores, slot, num_candidates, allowed)
    for _, launch in launches:
        launch()
    return buffers


def row_pass_launches(logits: torch.Tensor, beam_scores: torch.Tensor, slot: torch.Tensor, num_candidates: int,
                      allowed: torch.Tensor | None
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], list[tuple[str, Callable[[], None]]]]:
    """row_passes' buffers (stats, count, buf: not yet written) and its three launches, (name, fn) in
    order; ops/bench/bench_kernels.py times each alone."""
    rows, vocab = logits.shape
    sz = sizes(num_candidates)
    ng, kp, cap = sz["NG"], sz["KP"], sz["CAP"]
    dev = logits.device
    pmax = torch.empty(rows, NUM_PARTS, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    gpart = torch.empty(rows, NUM_PARTS, ng, dtype=torch.float32, device=dev)
    stats = torch.empty(rows, 4, dtype=torch.float32, device=dev)
    count = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    buf = torch.empty(rows, cap, dtype=torch.int32, device=dev)
    mask = allowed if allowed is not None else count  # never read without HAS_MASK
    words, ranks = (vocab + 31) // 32, beam_scores.shape[0]
    has_mask = allowed is not None
    stride = logits.stride(0)
    interp = interpreted()
    parts = NUM_PARTS

    def stats_pass() -> None:
        beam_stats_kernel[(rows, parts)](logits, beam_scores, slot, mask, pmax, psum, gpart, vocab, stride, words,
                                         ranks, NUM_PARTS=parts, NG=ng, HAS_MASK=has_mask,
                                         INTERPRETED=interp, **COMPILE_OPTIONS)

    def threshold() -> None:
        beam_threshold_kernel[(rows,)](beam_scores, slot, pmax, psum, gpart, stats, count, num_candidates, ranks,
                                       NUM_PARTS=parts, NG=ng, KP=kp, INTERPRETED=interp, **COMPILE_OPTIONS)

    def collect() -> None:
        beam_collect_kernel[(rows, parts)](logits, mask, stats, count, buf, vocab, stride, words, cap,
                                           NUM_PARTS=parts, NG=ng, HAS_MASK=has_mask, INTERPRETED=interp,
                                           **COMPILE_OPTIONS)

    return (stats, count, buf), [("stats", stats_pass), ("threshold", threshold), ("collect", collect)]


def decode_keys(keys: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [..., B] int64 -> (scores float32, parents int64, tokens int64) of the same shape."""
    ordered = keys >> 32  # the score's ordered bits (fits an int32)
    flat = (ordered << 32) + 0xFFFFFFFF - keys
    scores = (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(torch.int32).view(torch.float32)
    parents = torch.div(flat, vocab, rounding_mode="floor")
    return scores, parents, flat - parents * vocab


@triton.jit
def _decode_key(key, vocab):
    """A key (int64) -> its score (float32), parent (key's flat index // V) and token (% V)."""
    ordered = key >> 32  # the score's ordered bits (an int32's range)
    flat = ((ordered + 1) << 32) - 1 - key
    parent = flat // vocab
    return _from_ordered(ordered.to(tl.int32)), parent, flat - parent * vocab


@triton.jit
def _code_token(codes_ptr, col, ok, HAS_CODES: tl.constexpr):
    """A chosen column's token: itself, or through codes (a padding column -1, only ever a dead beam's: 0)."""
    if HAS_CODES:
        return tl.maximum(tl.load(codes_ptr + col, mask=ok, other=0), 0)
    return col


@triton.jit
def beam_commit_kernel(top_ptr, seqs_ptr, widths_ptr, slot_ptr, src_ptr, codes_ptr, seqs_out_ptr, scores_out_ptr,
                       parents_out_ptr, tokens_out_ptr, row_tokens_ptr, parent_rows_ptr, rows_in_ptr, rows_out_ptr,
                       num_ranks, num_beams, seq_len, step, vocab, num_rows, rank_programs, is_step, num_slots,
                       BLOCK: tl.constexpr, HAS_CODES: tl.constexpr):
    """The programs below rank_programs take BLOCK ranks each: decode the rank's key, write its score
    (-inf past its request's width), parent, token and sequence (its parent's, is_step; its own, the
    first step), token at column `step`. The others take BLOCK packed rows each: the row's next input
    token and (is_step) its parent's row, both 0 for a padding row; and with num_slots > 0 the row's
    suffix_rows [N, num_slots] (kernels/decode_attention.py): its parent row's for the slots the
    steps so far wrote (j < step), its own for the rest (and for a padding row)."""
    pid = tl.program_id(0)
    if pid < rank_programs:
        rank = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = rank < num_ranks
        score, parent, col = _decode_key(tl.load(top_ptr + rank, mask=ok, other=0), vocab)
        token = _code_token(codes_ptr, col, ok, HAS_CODES)
        r = rank // num_beams
        p = rank - r * num_beams
        width = tl.load(widths_ptr + r, mask=ok, other=0)
        tl.store(scores_out_ptr + rank, tl.where(p < width, score, float("-inf")), mask=ok)
        tl.store(parents_out_ptr + rank, parent, mask=ok)
        tl.store(tokens_out_ptr + rank, token, mask=ok)
        from_rank = r * num_beams + tl.where(is_step != 0, parent, p)
        j = 0
        while j < seq_len:
            v = tl.load(seqs_ptr + from_rank * seq_len + j, mask=ok, other=0)
            tl.store(seqs_out_ptr + rank * seq_len + j, tl.where(j == step, token, v), mask=ok)
            j += 1
    else:
        row = (pid - rank_programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = row < num_rows
        rank = tl.load(slot_ptr + row, mask=ok, other=0)
        real = ok & (rank < num_ranks)
        _, parent, col = _decode_key(tl.load(top_ptr + rank, mask=real, other=0), vocab)
        token = _code_token(codes_ptr, col, real, HAS_CODES)
        tl.store(row_tokens_ptr + row, tl.where(real, token, 0), mask=ok)
        if is_step != 0:
            prow = tl.load(src_ptr + (rank // num_beams) * num_beams + parent, mask=real, other=0)
            tl.store(parent_rows_ptr + row, tl.where(real, prow, 0), mask=ok)
            j = 0
            while j < num_slots:
                inherit = real & (j < step) & (prow < num_rows)  # (a rank without a row: none to inherit)
                a = tl.load(rows_in_ptr + prow * num_slots + j, mask=inherit, other=0)
                tl.store(rows_out_ptr + row * num_slots + j, tl.where(inherit, a, row), mask=ok)
                j += 1


COMMIT_BLOCK = 128  # ranks or rows a beam_commit program


def beam_commit(top: torch.Tensor, seqs: torch.Tensor, widths: torch.Tensor, slot: torch.Tensor, vocab: int,
                step: int, src: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                suffix_rows: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """A beam step's bookkeeping from its B best keys a request, in one kernel. top [R, B] int64
    (beam_merge); seqs [R, B, n] int64; widths [R] int64; slot [N] int64 (each packed row's rank,
    R * B: padding); vocab: the logits' columns (the key's flat index is parent * vocab + column);
    step: the column of seqs the new tokens go to; src [R * B] int64 (each rank's row) for a decode
    step, None for the first token (one parent: every beam keeps its own sequence); codes [C] int64
    or None: the tokens of the columns. Returns (seqs [R, B, n] with the parents' sequences and the
    new tokens, scores [R, B] float32 (-inf past each request's width), parents [R, B], tokens
    [R, B], row_tokens [N] (each packed row's next input; 0 for padding), parent_rows [N] (each
    packed row's parent row; None for the first token), and with suffix_rows [N, S] int64 (a decode
    step's, kernels/decode_attention.py) the next step's: each row's parent row's for the slots
    0..step-1, its own for the rest (None without))."""
    r, b, n = seqs.shape
    rows = slot.shape[0]
    for name, t, shape in (("top", top, (r, b)), ("seqs", seqs, (r, b, n)), ("widths", widths, (r,)),
                           ("slot", slot, (rows,)), ("src", src, (r * b,)), ("codes", codes, None)):
        if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or (shape and t.shape != shape)):
            raise ValueError(f"beam_commit: {name} must be a contiguous int64 {list(shape or ['C'])}, got "
                             f"{list(t.shape)} {t.dtype}")
    if not 0 <= step < n:
        raise ValueError(f"beam_commit: step {step} outside the sequence's {n} columns")
    if suffix_rows is not None and (src is None or suffix_rows.dtype != torch.int64 or suffix_rows.dim() != 2
                                    or suffix_rows.shape[0] != rows or not suffix_rows.is_contiguous()):
        raise ValueError(f"beam_commit: suffix_rows must be a contiguous int64 [{rows}, S] of a decode step (with src), "
                         f"got {list(suffix_rows.shape)} {suffix_rows.dtype}")
    dev = top.device
    seqs_out = torch.empty_like(seqs)
    scores = torch.empty(r, b, dtype=torch.float32, device=dev)
    parents, tokens = torch.empty_like(top), torch.empty_like(top)
    row_tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    parent_rows = torch.empty(rows, dtype=torch.int64, device=dev) if src is not None else None
    rows_out = torch.empty_like(suffix_rows) if suffix_rows is not None else None
    rank_programs = triton.cdiv(r * b, COMMIT_BLOCK)
    beam_commit_kernel[(rank_programs + triton.cdiv(rows, COMMIT_BLOCK),)](
        top, seqs, widths, slot, src if src is not None else slot, codes if codes is not None else slot, seqs_out,
        scores, parents, tokens, row_tokens, parent_rows if parent_rows is not None else row_tokens,
        suffix_rows if suffix_rows is not None else slot, rows_out if rows_out is not None else row_tokens, r * b, b,
        n, step, vocab, rows, rank_programs, int(src is not None),
        0 if suffix_rows is None else suffix_rows.shape[1], BLOCK=COMMIT_BLOCK, HAS_CODES=codes is not None,
        **COMPILE_OPTIONS)
    return seqs_out, scores, parents, tokens, row_tokens, parent_rows, rows_out


# The merge: top-B of each request's P x K keys. torch's top-k runs one slice per thread block, so a
# request's B x B keys are one block's work: on the H200 (2026-12-04, `bench_kernels --only
# beam_merge`, 8 requests) 36.7 us at B = 48, 113.6 at B = 128, 139.0 at B = 400, for a few MB at
# most. beam_merge_kernel spreads a request over programs instead: each takes CHUNK keys and keeps
# their B best (tl.topk), and rounds repeat over the winners until one chunk is left (2 rounds at
# B x B = 100 x 100, 4 at 400 x 400; the top B of a union are among each part's top B).
MERGE_MIN_CHUNK = 1024


def merge_sizes(num_beams: int) -> dict[str, int]:
    """KP the sort width (a power of two >= max(B, 2), as sizes()), CHUNK the keys a program of a
    round takes (>= 4 KP: a round keeps at most a quarter of its keys), its warps (kernels/aot.py compiles
    them into the variant, whose CHUNK cpp_dag/triton_kernels.cpp reads back)."""
    kp = sizes(num_beams)["KP"]
    chunk = max(MERGE_MIN_CHUNK, 4 * kp)
    return {"KP": kp, "CHUNK": chunk, "num_warps": 8 if chunk >= 2048 else 4}


@triton.jit
def beam_merge_kernel(in_ptr, out_ptr, n_in, n_out, num_beams, KP: tl.constexpr, CHUNK: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Program (request r, chunk c): the num_beams largest of in[r, c * CHUNK:(c + 1) * CHUNK] (a
    request's keys: n_in of them; past n_in, none), largest first, into out[r, c * num_beams:] (n_out a
    request). A chunk with fewer keys than num_beams pads with -2^63, below every key (NO_KEY too)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    i = c * CHUNK + tl.arange(0, CHUNK)
    inb = i < n_in
    x = tl.where(inb, tl.load(in_ptr + r * n_in + i, mask=inb, other=0), -(2 ** 63))
    top = _top(x, KP, INTERPRETED)
    kk = tl.arange(0, KP)
    tl.store(out_ptr + r * n_out + c * num_beams + kk, top, mask=kk < num_beams)


def beam_merge(keys: torch.Tensor, num_requests: int, num_beams: int) -> torch.Tensor:
    """keys [R x P, K] int64 (beam_candidates) -> the B best of each request's P x K, best first
    [R, B], in rounds of beam_merge_kernel: exactly merge_keys (the keys are unique: no ties). One
    parent a request (the first token) is already the answer. cpp_dag/triton_kernels.cpp::beam_merge
    launches the same rounds."""
    if keys.dtype != torch.int64 or not keys.is_contiguous() or num_requests < 1 or keys.numel() % num_requests:
        raise ValueError(f"beam_merge: keys must be a contiguous int64 [R x P, K] of {num_requests} requests, got "
                         f"{list(keys.shape)} {keys.dtype}")
    x = keys.view(num_requests, -1)
    n = x.shape[1]
    if not 1 <= num_beams <= n:
        raise ValueError(f"beam_merge: need 1 <= B ({num_beams}) <= the keys a request ({n})")
    if n == num_beams:
        return x
    sz = merge_sizes(num_beams)
    while True:
        chunks = triton.cdiv(n, sz["CHUNK"])
        out = torch.empty(num_requests, chunks * num_beams, dtype=torch.int64, device=keys.device)
        beam_merge_kernel[(num_requests, chunks)](x, out, n, chunks * num_beams, num_beams, KP=sz["KP"],
                                                  CHUNK=sz["CHUNK"], INTERPRETED=interpreted(),
                                                  num_warps=sz["num_warps"], **COMPILE_OPTIONS)
        if chunks == 1:
            return out
        x, n = out, chunks * num_beams


def merge_keys(keys: torch.Tensor, num_requests: int, num_beams: int) -> torch.Tensor:
    """beam_merge in plain torch (its reference): one top-k a request. The keys are unique, so the
    top-k has no ties to break."""
    per_request = keys.view(num_requests, -1)
    return per_request if per_request.shape[1] == num_beams else per_request.topk(num_beams, dim=-1).values


def merge_candidates(keys: torch.Tensor, num_requests: int, num_beams: int,
                     vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """beam_merge, decoded: (scores [R, B] float32, parents [R, B] int64, tokens [R, B] int64)."""
    return decode_keys(beam_merge(keys, num_requests, num_beams), vocab)


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
