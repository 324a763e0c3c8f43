"""A catalog trie's two lookups of constrained BeamSearch (issue 28), one Triton kernel each, on the
forest of service/artifact/catalog.py (`trie_forest`: int64 CSR `offsets` [nodes + 1], edge `tokens`
and `child` [edges + 1], the last edge a padding one; a node's children are edges
offsets[n] .. offsets[n + 1] - 1, at most `window` of them):

- `trie_allowed(trie, offsets, tokens, words, cols)`: each row's allowed next tokens as
  kernels/beam_topk.py's int32 bitmask [rows, words] (bit v % 32 of word v // 32): the children's
  tokens of the row's node, or (cols given: a batch normalised over a catalog's codes) their
  columns cols[token]; every bit for an unconstrained row (node -1).
- `trie_advance(trie, next_tokens, offsets, tokens, child)`: the child of each node along its
  token, -1 where it has none.

The references are the plain torch ops below (`trie_children_ref` and the two `_ref`s: ~20 and
~15 launches a step, what both runtimes ran before; the ATen path still runs `trie_children_ref`
and `trie_advance_ref`); integer arithmetic, so the kernels equal them bit for bit
(tests/kernels/test_trie.py, on a CPU through Triton's interpreter). A row's children are read in
tiles of BLOCK_K edges up to its own count (the catalog's window is a runtime value: one compiled
variant serves every catalog).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import COMPILE_OPTIONS

BLOCK_K = 128  # child edges a tile
BLOCK_W = 1024  # bitmask words a store


@triton.jit
def _edges(offsets_ptr, node):
    """A node's child edges: (the first, how many)."""
    start = tl.load(offsets_ptr + node)
    return start, tl.load(offsets_ptr + node + 1) - start


@triton.jit
def trie_allowed_kernel(trie_ptr, offsets_ptr, tokens_ptr, cols_ptr, words_ptr, num_words,
                        BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_COLS: tl.constexpr):
    # one row a program: its words [num_words] (-1 when unconstrained, else 0), then a bit per child
    row = tl.program_id(0).to(tl.int64)
    node = tl.load(trie_ptr + row)
    fill = tl.where(node < 0, -1, 0).to(tl.int32)
    out = words_ptr + row * num_words
    w0 = 0
    while w0 < num_words:  # while, not range(): Triton 3.6's interpreter cannot bound a range() by a tensor
        w = w0 + tl.arange(0, BLOCK_W)
        tl.store(out + w, tl.full([BLOCK_W], 0, tl.int32) + fill, mask=w < num_words)
        w0 += BLOCK_W
    tl.debug_barrier()  # the zeros are in place before any bit is added (one block: __syncthreads)
    if node >= 0:
        start, count = _edges(offsets_ptr, node)
        k0 = 0
        while k0 < count:
            k = k0 + tl.arange(0, BLOCK_K)
            valid = k < count
            tok = tl.load(tokens_ptr + start + k, mask=valid, other=0)
            if HAS_COLS:
                tok = tl.load(cols_ptr + tok, mask=valid, other=0)
            valid = valid & (tok < num_words * 32)  # a column past the mask (none: every trie token has one)
            # a node's tokens are distinct, so adding their bits is OR-ing them
            bit = tl.full([BLOCK_K], 1, tl.int32) << (tok & 31).to(tl.int32)
            tl.atomic_add(out + (tok >> 5), bit, mask=valid, sem="relaxed")
            k0 += BLOCK_K


@triton.jit
def trie_advance_kernel(trie_ptr, next_ptr, offsets_ptr, tokens_ptr, child_ptr, out_ptr, BLOCK_K: tl.constexpr):
    # one (row, beam) a program: the child of its node along its next token, -1 where none
    i = tl.program_id(0).to(tl.int64)
    node = tl.load(trie_ptr + i)
    want = tl.load(next_ptr + i)
    found = tl.full([], -1, tl.int64)
    if node >= 0:
        start, count = _edges(offsets_ptr, node)
        k0 = 0
        while k0 < count:
            k = k0 + tl.arange(0, BLOCK_K)
            hit = (k < count) & (tl.load(tokens_ptr + start + k, mask=k < count, other=-1) == want)
            kid = tl.load(child_ptr + start + k, mask=hit, other=0)
            found = tl.where(tl.sum(hit.to(tl.int32), axis=0) > 0, tl.sum(kid, axis=0), found)
            k0 += BLOCK_K
    tl.store(out_ptr + i, found)


def trie_allowed(trie: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor, num_words: int,
                 cols: torch.Tensor | None = None) -> torch.Tensor:
    """trie [rows] int64 nodes (-1: unconstrained) -> int32 bitmask [rows, num_words]."""
    if trie.dim() != 1 or not trie.is_contiguous():
        raise ValueError(f"trie_allowed: trie must be a contiguous [rows], got {list(trie.shape)}")
    words = torch.empty(trie.shape[0], num_words, dtype=torch.int32, device=trie.device)
    trie_allowed_kernel[(trie.shape[0],)](trie, offsets, tokens, cols if cols is not None else tokens, words,
                                          num_words, BLOCK_K=BLOCK_K, BLOCK_W=BLOCK_W, HAS_COLS=cols is not None,
                                          num_warps=4, **COMPILE_OPTIONS)
    return words


def trie_advance(trie: torch.Tensor, next_tokens: torch.Tensor, offsets: torch.Tensor, tokens: torch.Tensor,
                 child: torch.Tensor) -> torch.Tensor:
    """trie, next_tokens [...] int64 (one shape) -> the child nodes [...] int64 (-1: none)."""
    if trie.shape != next_tokens.shape:
        raise ValueError(f"trie_advance: trie {list(trie.shape)} and tokens {list(next_tokens.shape)} differ")
    flat, nxt = trie.reshape(-1).contiguous(), next_tokens.reshape(-1).contiguous()
    out = torch.empty_like(flat)
    trie_advance_kernel[(flat.shape[0],)](flat, nxt, offsets, tokens, child, out, BLOCK_K=BLOCK_K, num_warps=4,
                                          **COMPILE_OPTIONS)
    return out.view_as(trie)


# ---- the plain-torch references (static shapes, no host sync: they run inside CUDA graphs too) ----

def trie_children_ref(offsets: torch.Tensor, window: torch.Tensor, edge_tokens: torch.Tensor, child: torch.Tensor,
                      trie: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """trie [X] nodes (-1: none) -> tokens, children, valid [X, K]: each node's window of K child
    edges (window = arange(K), K the most children a node has); valid marks the node's own edges."""
    node = trie.clamp_min(0)
    start = offsets.index_select(0, node)
    count = offsets.index_select(0, node + 1) - start
    edge = (start.unsqueeze(1) + window).clamp_max(edge_tokens.shape[0] - 1).reshape(-1)  # past the last: padding
    tokens = edge_tokens.index_select(0, edge).view(-1, window.shape[0])
    children = child.index_select(0, edge).view(-1, window.shape[0])
    valid = window.lt(count.unsqueeze(1)).logical_and(trie.ge(0).unsqueeze(1))
    return tokens, children, valid


def trie_allowed_ref(trie: torch.Tensor, offsets: torch.Tensor, window: torch.Tensor, edge_tokens: torch.Tensor,
                     num_words: int, cols: torch.Tensor | None = None) -> torch.Tensor:
    tokens, _, valid = trie_children_ref(offsets, window, edge_tokens, edge_tokens, trie)
    if cols is not None:
        tokens = cols.index_select(0, tokens.reshape(-1)).view_as(tokens)
    # bit v % 32 of word v // 32; distinct tokens are distinct bits, so their sum is their OR
    bits = torch.where(valid, torch.bitwise_left_shift(torch.ones_like(tokens), tokens.bitwise_and(31)), 0)
    words = torch.zeros(trie.shape[0], num_words, dtype=torch.int64, device=trie.device)
    words = words.scatter_add_(1, torch.where(valid, tokens, 0).bitwise_right_shift(5), bits)
    words = torch.where(words.ge(1 << 31), words - (1 << 32), words).to(torch.int32)  # as int32 bits
    return torch.where(trie.lt(0).unsqueeze(1), -1, words).contiguous()


def trie_advance_ref(trie: torch.Tensor, next_tokens: torch.Tensor, offsets: torch.Tensor, window: torch.Tensor,
                     edge_tokens: torch.Tensor, child: torch.Tensor) -> torch.Tensor:
    kids_tokens, kids, valid = trie_children_ref(offsets, window, edge_tokens, child, trie.reshape(-1))
    hit = valid.logical_and(kids_tokens.eq(next_tokens.reshape(-1, 1)))  # [X, K]: at most one per row
    found = torch.where(hit, kids, 0).sum(1)
    return torch.where(hit.any(1), found, -1).view_as(trie)
