"""Catalog files -> the artifact's tries (service/artifact/catalog.py): parsing errors name
file:line, the BFS CSR layout, item lookup, the forest of several catalogs, and the artifact's
manifest entry and hash check."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from service.artifact.artifact import ArtifactError, build_artifact, load_artifact
from service.artifact.catalog import CatalogError, build_catalog, build_trie, load_catalog, parse_catalog, trie_forest


def _trie(tmp_path, text: str, vocab: int = 10):
    path = tmp_path / "c.tsv"
    path.write_text(text)
    return build_trie("c", *parse_catalog(path, vocab), path)


def test_trie_is_bfs_csr_with_sorted_children(tmp_path):
    cat = _trie(tmp_path, "a\t3 1 2\nb\t3 1 0\nc\t0 5 5\nd\t3 2 0\n")
    # root -> {0, 3}; 0 -> {5}; 3 -> {1, 2}; 05 -> {5}; 31 -> {0, 2}; 32 -> {0}; then 4 leaves
    assert cat.offsets.tolist() == [0, 2, 3, 5, 6, 8, 9, 9, 9, 9, 9]
    assert cat.tokens.tolist() == [0, 3, 5, 1, 2, 5, 0, 2, 0]
    assert cat.item_ids.tolist() == ["c", "b", "a", "d"]  # leaf order: sorted by code
    codes = np.array([[3, 1, 0], [0, 5, 5], [3, 2, 1], [3, 2, 0], [9, 9, 9]])
    assert cat.item_of(codes) == ["b", "c", None, "d", None]


@pytest.mark.parametrize("text,line,what", [
    ("a\t1 2\nb\t1 2\n", 2, "duplicate item code (the same tokens as line 1)"),
    ("a\t1 2\na\t1 3\n", 2, "duplicate item id 'a'"),
    ("a\t1 2\nb\t1 12\n", 2, "outside the model's vocabulary [0, 10)"),
    ("a\t1 2\nb\t1\n", 2, "1 tokens, but line 1 has 2"),
    ("a 1 2\n", 1, "needs exactly one TAB"),
    ("a\t1\tx\n", 1, "needs exactly one TAB"),
    ("a\t1 -2\n", 1, "integer ids separated by spaces"),
    ("\t1 2\n", 1, "empty item id"),
    ("a\t1 2\nb\t \n", 2, "no tokens"),
    ("a\t1 2\nb\x00\t1 3\n", 2, "an item id holds a zero byte"),
    ("a\t1 2\n\nb\t3 4\n", 2, "needs exactly one TAB"),
])
def test_bad_lines_name_file_and_line(tmp_path, text, line, what):
    with pytest.raises(CatalogError) as e:
        _trie(tmp_path, text)
    assert f"c.tsv:{line}: " in str(e.value) and what in str(e.value)


def test_crlf_and_no_final_newline(tmp_path):
    assert _trie(tmp_path, "a\t1 2\r\nb\t1 3").item_ids.tolist() == ["a", "b"]


def test_an_id_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "c.tsv"
    path.write_bytes("a\t1 2\nb\u00e9\t1 3\n".encode() + b"c\xe9\t1 4\n")
    with pytest.raises(CatalogError, match="c.tsv:3: the item id is not UTF-8"):
        parse_catalog(path, 10)


def test_ids_of_any_length_and_utf8_survive_build_files_and_load(tmp_path):
    """Item ids as one byte string (ItemIds): from the file through the trie's leaf order, the items
    file and a load, each id comes back whole, of 1 to 40 bytes, ASCII or not, a prefix of another."""
    rng = np.random.default_rng(5)
    alphabet = list("abcXYZ019-_.") + ["\u00e9", "\u4e2d", "\U0001f600"]
    ids = {"".join(rng.choice(alphabet, int(rng.integers(1, 15)))) for _ in range(400)} | {"a", "ab", "abc"}
    ids = sorted(ids)
    codes = rng.permutation(4096)[:len(ids)]
    path = tmp_path / "c.tsv"
    path.write_text("".join(f"{i}\t{c // 64} {c % 64}\n" for i, c in zip(ids, codes)))
    entry = build_catalog("c", path, 64, tmp_path, quiet=True)
    cat = load_catalog(tmp_path, entry)
    by_code = sorted(zip(codes.tolist(), ids))
    assert cat.item_ids.tolist() == [i for _, i in by_code]  # leaf order
    assert (tmp_path / entry["items_file"]).read_text() == "".join(f"{i}\n" for _, i in by_code)
    assert cat.item_of(np.stack([codes // 64, codes % 64], axis=1)) == ids


def test_forest_of_two_catalogs(tmp_path):
    one, two = _trie(tmp_path, "a\t1 2\nb\t1 3\n"), _trie(tmp_path, "x\t4\ny\t5\nz\t6\n")
    forest = trie_forest([one, two], torch.device("cpu"))
    assert forest["catalog.roots"].tolist() == [0, one.num_nodes, -1]
    assert forest["catalog.window"].tolist() == [0, 1, 2]  # the root of `two` has 3 children
    root2 = one.num_nodes
    start, end = forest["catalog.offsets"][root2:root2 + 2].tolist()
    assert forest["catalog.tokens"][start:end].tolist() == [4, 5, 6]
    assert forest["catalog.child"][start:end].tolist() == [root2 + 1, root2 + 2, root2 + 3]
    assert forest["catalog.child"][-1].item() == -1  # the padding edge


def test_a_large_catalog_builds_and_loads_fast(tmp_path):
    rng = np.random.default_rng(1)
    n = 200_000
    codes = np.unique(rng.integers(0, 256, (n + n // 4, 3)), axis=0)[:n]
    rng.shuffle(codes)
    path = tmp_path / "big.tsv"
    path.write_text("\n".join(f"i{i}\t{a} {b} {c}" for i, (a, b, c) in enumerate(codes.tolist())) + "\n")
    t0 = time.monotonic()
    entry = build_catalog("big", path, 151_936, tmp_path, quiet=True)
    t1 = time.monotonic()
    cat = load_catalog(tmp_path, entry)
    t2 = time.monotonic()
    assert entry["num_items"] == n and entry["code_length"] == 3 and entry["layout"] == "csr"
    assert all(level["csr_bytes"] < level["dense_bytes"] for level in entry["layout_bytes"])
    assert t1 - t0 < 10 and t2 - t1 < 2, f"build {t1 - t0:.2f} s, load {t2 - t1:.2f} s"
    sample = rng.choice(n, 1000, replace=False)
    assert cat.item_of(codes[sample]) == [f"i{i}" for i in sample]


def test_artifact_records_and_verifies_its_catalogs(tmp_path):
    cat_file = tmp_path / "cat.tsv"
    cat_file.write_text("a\t1 2 3\nb\t1 2 4\n")
    out = build_artifact("embedded:tiny", tmp_path / "art", quiet=True, catalogs={"shop": cat_file})
    art = load_artifact(out)
    (entry,) = art.manifest["catalogs"]
    assert (entry["name"], entry["num_items"], entry["code_length"]) == ("shop", 2, 3)
    assert len(entry["sha256"]) == 64 and len(entry["version"]) == 12
    assert art.catalog_lengths == {"shop": 3}
    assert any(n.type == "beam_allowed" for n in art.beam_dag)
    trie = out / entry["file"]
    trie.write_bytes(trie.read_bytes()[:-1] + b"\x01")
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        load_artifact(out)


def test_build_refuses_a_bad_catalog(tmp_path):
    cat_file = tmp_path / "bad.tsv"
    cat_file.write_text("a\t1 2 3\nb\t1 2 999999\n")
    with pytest.raises(CatalogError, match=r"bad.tsv:2: token id outside"):
        build_artifact("embedded:tiny", tmp_path / "art", quiet=True, catalogs={"shop": cat_file})


def test_blocks_of_lines_parse_as_the_whole_file(tmp_path, monkeypatch):
    """parse_catalog's token part goes a block of lines at a time: blocks of a line or two give the
    whole file's codes, and an error names its line in the file, not in its block."""
    from service.artifact import catalog

    rng = np.random.default_rng(3)
    codes = np.unique(rng.integers(0, 1000, (300, 3)), axis=0)
    path = tmp_path / "c.tsv"
    path.write_text("".join(f"item{i}\t{a} {b}  {c}\r\n" for i, (a, b, c) in enumerate(codes.tolist())))
    whole = parse_catalog(path, 151_936)
    monkeypatch.setattr(catalog, "BLOCK_BYTES", 16)
    ids, got = parse_catalog(path, 151_936)
    assert ids.tolist() == whole[0].tolist() and (got == whole[1]).all() and (got == codes).all()
    lines = path.read_text().split("\n")
    for bad, what in (("item9\t1 2 x", "integer ids"), ("item9\t1 2 1234567890", "more than 9 digits"),
                      ("item9\t1 2", "2 tokens, but line 1 has 3")):
        path.write_text("\n".join(lines[:200] + [bad] + lines[201:]))
        with pytest.raises(CatalogError, match=f"c.tsv:201: .*{what}"):
            parse_catalog(path, 151_936)
