"""kernels/trie.py against its plain-torch references on catalogs' forests (several catalogs,
a node with more children than one tile, unconstrained rows, the code columns): bit for bit, on a
CPU through Triton's interpreter and on the GPU compiled (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels.trie import BLOCK_K, trie_advance, trie_advance_ref, trie_allowed, trie_allowed_ref
from service.artifact.catalog import build_trie, parse_catalog, trie_forest
from service.loadgen.catalogs import write_catalog
from service.runtime.nodes import code_columns_of, trie_children

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VOCAB = 2000


@pytest.fixture(scope="module")
def forest_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("trie")
    cats = []
    # 3 levels of 200 codes (a root with up to 200 children: more than a tile), 2 levels of 64, few items
    for name, items, levels, codes, base in (("a", 3000, 3, 200, 1000), ("b", 500, 2, 64, 10), ("c", 7, 4, 8, 500)):
        path = write_catalog(root / f"{name}.tsv", items, seed=len(name) + items, levels=levels, codes=codes,
                             base=base)
        cats.append(build_trie(name, *parse_catalog(path, VOCAB), path))
    w = trie_forest(cats, torch.device("cpu"))
    assert int((w["catalog.offsets"][1:] - w["catalog.offsets"][:-1]).max()) > BLOCK_K  # a node spans two tiles
    return w


def _nodes(w: dict[str, torch.Tensor], n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nodes = torch.randint(0, w["catalog.offsets"].shape[0] - 1, (n,), generator=g)
    nodes[:3] = w["catalog.roots"][:3]  # the roots: the widest nodes
    nodes[5::7] = -1  # unconstrained rows
    return nodes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codes", [False, True])
def test_trie_allowed_is_the_aten_bitmask(forest_cpu, device: str, codes: bool) -> None:
    trie = _nodes(forest_cpu, 64, 1)
    cols, vocab = None, VOCAB
    if codes:  # catalog a's code tokens as the columns (a batch normalised over its codes)
        code_tokens = torch.cat([torch.arange(1000, 1600), torch.full((40,), -1)])
        cols, vocab = code_columns_of(code_tokens, VOCAB), code_tokens.shape[0]
        trie = torch.where(trie < forest_cpu["catalog.roots"][1], trie, -1)  # catalog a's nodes (and free rows)
    f = forest_cpu
    want = trie_allowed_ref(trie, f["catalog.offsets"], f["catalog.window"], f["catalog.tokens"], (vocab + 31) // 32,
                            cols)
    w = {k: v.to(device) for k, v in forest_cpu.items()}
    got = trie_allowed(trie.to(device), w["catalog.offsets"], w["catalog.tokens"], (vocab + 31) // 32,
                       cols.to(device) if cols is not None else None)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    # not vacuous: a constrained row has a bit per child (leaves none), a free row every bit
    ones = ((want.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).sum((1, 2))
    node = trie.clamp_min(0)
    children = forest_cpu["catalog.offsets"][node + 1] - forest_cpu["catalog.offsets"][node]
    assert torch.equal(ones[trie >= 0], children[trie >= 0]) and (children[trie >= 0] > BLOCK_K).any()
    assert (ones[trie < 0] == 32 * want.shape[1]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_trie_advance_is_the_aten_lookup(forest_cpu, device: str) -> None:
    trie = _nodes(forest_cpu, 96, 2).view(8, 12)
    tokens, _, valid = trie_children(forest_cpu, trie.reshape(-1))
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, tokens.shape[1], (trie.numel(),), generator=g)
    nxt = tokens.gather(1, pick.unsqueeze(1)).squeeze(1)
    nxt = torch.where(valid.gather(1, pick.unsqueeze(1)).squeeze(1), nxt, 1999)  # some tokens no child has
    nxt = nxt.view_as(trie)
    f = forest_cpu
    want = trie_advance_ref(trie, nxt, f["catalog.offsets"], f["catalog.window"], f["catalog.tokens"], f["catalog.child"])
    assert (want >= 0).any() and (want < 0).any()
    w = {k: v.to(device) for k, v in forest_cpu.items()}
    got = trie_advance(trie.to(device), nxt.to(device), w["catalog.offsets"], w["catalog.tokens"], w["catalog.child"])
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
