"""Catalogs of valid items for constrained beam search: parsed from text, stored as a trie.

  FILE (slmrank build --catalog NAME=FILE): one item a line, `item_id<TAB>tok tok tok`, token ids of
  the model's vocabulary; every item of a catalog has the same code length (new_tokens).
  DIR/catalogs/NAME.trie.safetensors   offsets int64 [nodes + 1], tokens int32 [edges]
  DIR/catalogs/NAME.items              item ids, one a line, in leaf order

The trie is CSR in breadth-first order: level by level, each level's nodes in lexicographic order
of their prefixes, so node n's children are edges offsets[n] .. offsets[n+1]-1 (sorted by token)
and the child of edge e is node e + 1 (the root, node 0, is no edge's child). The leaves are the
last num_items nodes, item i (sorted by code) at node num_nodes - num_items + i.

Layout, measured (`layout_bytes`, recorded per level in the manifest): a dense bitmask level costs
nodes x ceil(V / 32) x 4 bytes, CSR edges x 4 (+ the offsets). Dense is smaller only where a level
averages more than V / 32 children a node (4,748 for Qwen's 151,936 tokens); semantic IDs have at
most a few hundred a node (3 x 256 codes: CSR is 1/19 of dense at the root and 1/74 at level 1),
so every level is CSR.

Parsing and building are numpy (no Python loop per item): 1M items in 1.5 s, 10M in 18 s on a
2-core CPU (ops/bench/catalog_scale.py; docs/performance.md).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from ..model.progress import note

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOKEN_DIGITS = 9  # ids below 10^9: far above any vocabulary, and exact in the float64 digit sum
SUBDIR = "catalogs"
BLOCK_BYTES = 1 << 22  # parse_catalog's block of lines


class CatalogError(ValueError):
    """A catalog file that cannot be built: str(e) names file:line."""


@dataclass(frozen=True, eq=False)
class ItemIds:
    """Item ids as one byte string and each one's place in it: no Python object an item. A list of
    10M str (or bytes) takes about a second to build, split or join, all of it holding the GIL,
    and a server that reads a replacement catalog beside live traffic (Admin.ReplaceCatalog) would
    stall its event loop that long; numpy's array work lets go of the GIL. An id is decoded when
    it is looked up (Catalog.item_of: a beam's few hundred)."""
    data: bytes
    starts: np.ndarray  # int64 [n]: where each id begins in data
    lengths: np.ndarray  # int64 [n]: its bytes

    @classmethod
    def of_lines(cls, data: bytes) -> ItemIds:
        """One id a line, each line ended by a newline (a catalog's items file)."""
        ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        return cls(data, starts[:len(ends)], ends - starts[:len(ends)])

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> str:
        start = int(self.starts[i])
        return self.data[start:start + int(self.lengths[i])].decode()

    def tolist(self) -> list[str]:
        """Every id (a str each: for small catalogs and tests, not a server's path)."""
        return [self[i] for i in range(len(self))]

    def fixed(self) -> np.ndarray:
        """[n] S<longest>, each id zero-padded (no id holds a zero byte: parse_catalog): what numpy
        sorts and compares without the GIL. Built a byte column at a time, not an index an id byte."""
        n, width = len(self), int(self.lengths.max(initial=1))
        buf = np.frombuffer(self.data, dtype=np.uint8)
        rows = np.zeros((n, width), dtype=np.uint8)
        shortest = int(self.lengths.min(initial=0))
        for col in range(width):
            if col < shortest:
                rows[:, col] = buf[self.starts + col]
            else:
                has = self.lengths > col
                rows[has, col] = buf[self.starts[has] + col]
        return rows.view(f"S{width}").reshape(n)

    def lines(self, order: np.ndarray, fixed: np.ndarray | None = None) -> ItemIds:
        """These ids in `order`, one a line (the items file's bytes); fixed: self.fixed(), if made."""
        fixed, lengths = (self.fixed() if fixed is None else fixed)[order], self.lengths[order]
        n, width = len(fixed), fixed.dtype.itemsize
        rows = np.zeros((n, width + 1), dtype=np.uint8)
        rows[:, :width] = fixed.view(np.uint8).reshape(n, width)
        rows[np.arange(n), lengths] = 10
        return ItemIds.of_lines(rows[np.arange(width + 1) <= lengths[:, None]].tobytes())


@dataclass(frozen=True)
class Catalog:
    name: str
    offsets: np.ndarray  # int64 [num_nodes + 1]
    tokens: np.ndarray  # int32 [num_edges]
    item_ids: ItemIds  # leaf order (items sorted by code), one a line: the items file
    code_length: int
    version: str = ""  # the first 12 hex digits of sha256(trie file's sha256 + items file's sha256)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.offsets) - 1

    @cached_property
    def code_tokens(self) -> np.ndarray:
        """The distinct tokens of its items, at any level, ascending (int64): what a request
        normalised over the codes (BeamRequest.normalization "codes") is normalised over."""
        return np.unique(self.tokens).astype(np.int64)

    @cached_property
    def edge_keys(self) -> tuple[np.ndarray, int]:
        """(keys [edges] int64, span): edge e of node n has key n * span + its token, sorted (BFS
        order, tokens sorted within a node). Computed once (load_catalog: at load), not per lookup:
        at 10M items it is 0.1 s and 80 MB."""
        parent = np.repeat(np.arange(self.num_nodes, dtype=np.int64), np.diff(self.offsets))
        span = int(self.tokens.max(initial=0)) + 1
        return parent * span + self.tokens, span

    def item_of(self, codes: np.ndarray) -> list[str | None]:
        """codes [k, code_length] -> each code's item id, None for a code that is no item. Walks the
        trie a level at a time for all k codes at once (a binary search of edge_keys a level)."""
        node = np.zeros(len(codes), dtype=np.int64)
        keys, span = self.edge_keys
        found = np.ones(len(codes), dtype=bool)
        for level in range(self.code_length):
            want = node * span + np.clip(codes[:, level], 0, span - 1)
            edge = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
            found &= (keys[edge] == want) & (codes[:, level] < span)
            node = edge + 1
        first_leaf, ids = self.num_nodes - self.num_items, self.item_ids
        return [ids[n - first_leaf] if ok else None for n, ok in zip(node.tolist(), found.tolist())]


def parse_catalog(path: Path, vocab_size: int) -> tuple[ItemIds, np.ndarray]:
    """(item ids, codes [n, L] int64) in file order; CatalogError naming file:line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data += b"\n"
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)  # [n]: each line's newline
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    if len(ends) == 0:
        raise CatalogError(f"{path}: no items")
    tabs = np.flatnonzero(buf == 9)
    line_of_tab = np.searchsorted(ends, tabs)
    _fail_where(path, np.bincount(line_of_tab, minlength=len(ends)) != 1, "needs exactly one TAB: item_id<TAB>tokens")
    _fail_where(path, tabs == starts, "empty item id")
    # token part: a block of whole lines at a time (its bool and int8 arrays stay in the cache,
    # a 10M-item file parses in half the CPU time of the whole file at once: 4.8-5.6 s vs 10.1 s)
    values, per_line, non_digit, too_long = [], [], [], []
    cuts = np.unique(np.concatenate([[0], np.searchsorted(ends, np.arange(BLOCK_BYTES, len(buf), BLOCK_BYTES)),
                                     [len(ends)]]))
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        base = int(starts[lo])
        v, n, bad, long = _parse_tokens(buf[base:ends[hi - 1] + 1], ends[lo:hi] - base, tabs[lo:hi] - base,
                                        starts[lo:hi] - base)
        values.append(v)
        per_line.append(n)
        non_digit.append(bad + lo)
        too_long.append(long + lo)
    _fail_lines(path, np.concatenate(non_digit), "tokens must be integer ids separated by spaces")
    _fail_lines(path, np.concatenate(too_long), f"a token id has more than {MAX_TOKEN_DIGITS} digits")
    values, per_line = np.concatenate(values), np.concatenate(per_line)
    _fail_where(path, per_line == 0, "no tokens")
    _fail_where(path, per_line != per_line[0],
                f"{'{'}n{'}'} tokens, but line 1 has {per_line[0]}: every item of a catalog has one code length",
                counts=per_line)
    codes = values.reshape(len(ends), int(per_line[0]))
    _fail_where(path, (codes >= vocab_size).any(axis=1), f"token id outside the model's vocabulary [0, {vocab_size})")
    # the ids (before each TAB): no zero byte (ItemIds.fixed pads with them), UTF-8 (a gRPC string)
    zeros = np.flatnonzero(buf == 0)
    _fail_lines(path, np.searchsorted(ends, zeros)[zeros < tabs[np.searchsorted(ends, zeros)]],
                "an item id holds a zero byte")
    if (buf >= 128).any():  # not all ASCII: decode once (the token parts are ASCII by now)
        try:
            data.decode()
        except UnicodeDecodeError as e:
            raise CatalogError(f"{path}:{int(np.searchsorted(ends, e.start)) + 1}: the item id is not UTF-8") from None
    return ItemIds(data, starts, tabs - starts), codes


def _parse_tokens(buf: np.ndarray, ends: np.ndarray, tabs: np.ndarray,
                  starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lines of exactly one TAB each (buf: their bytes, ends / tabs / starts: each line's newline,
    TAB and first byte within buf) -> (their tokens' values in order, tokens a line, the lines with
    a byte other than a digit or space after the TAB, the lines with a token of more than
    MAX_TOKEN_DIGITS digits). The token part is after a line's TAB, before its newline: digits and
    spaces (\r of a CRLF file counts as a space). Every array over the bytes is a bool or int8 one;
    a byte's line is looked up (searchsorted in `ends`) only for the bytes that need it."""
    region = np.zeros(len(buf), dtype=np.int8)
    region[tabs + 1] += 1  # tabs + 1 <= the line's newline: a TAB is never the newline
    region[ends] -= 1
    in_codes = np.cumsum(region, dtype=np.int8).view(bool)  # 0 or 1: one TAB a line
    del region
    digit = (buf >= 48) & (buf <= 57)
    digit &= in_codes
    bad = (buf != 32) & (buf != 13)
    bad &= in_codes
    bad &= ~digit
    non_digit = np.searchsorted(ends, np.flatnonzero(bad))
    del bad, in_codes
    after = np.zeros(len(buf), dtype=bool)  # the byte after a digit is one too
    after[:-1] = digit[1:]
    last = np.flatnonzero(digit & ~after)  # each token's last digit (a newline always follows the tokens)
    after[1:] = digit[:-1]  # now: the byte before is a digit
    starts_token = digit & ~after
    del digit, after
    first = np.flatnonzero(starts_token)  # each token's first digit
    per_line = np.add.reduceat(starts_token, starts, dtype=np.int64)  # a line's tokens (no line is empty: its newline)
    del starts_token
    num_digits = last - first + 1
    too_long = np.searchsorted(ends, first[num_digits > MAX_TOKEN_DIGITS])
    values = np.zeros(len(first), dtype=np.int64)
    for d in range(min(int(num_digits.max(initial=0)), MAX_TOKEN_DIGITS)):  # Horner over the digits, all tokens at once
        more = num_digits > d
        values[more] = values[more] * 10 + (buf[first[more] + d] - 48)
    return values, per_line, non_digit, too_long


def _fail_lines(path: Path, lines: np.ndarray, what: str) -> None:
    """CatalogError naming the first of these (0-based) lines, if any."""
    if len(lines):
        raise CatalogError(f"{path}:{int(lines.min()) + 1}: {what}")


def _fail_where(path: Path, bad: np.ndarray, what: str, counts: np.ndarray | None = None) -> None:
    if bad.any():
        line = int(np.argmax(bad))
        message = what.replace("{n}", str(counts[line])) if counts is not None else what
        raise CatalogError(f"{path}:{line + 1}: {message}")


def build_trie(name: str, ids: ItemIds, codes: np.ndarray, path: Path) -> Catalog:
    """Sorts the items by code and lays out the BFS trie; CatalogError for duplicate ids or codes."""
    n, length = codes.shape
    bits = max(int(codes.max(initial=0)).bit_length(), 1)
    if bits * length <= 63:  # the code packed into one int64 key, in the same order: one argsort, not a lexsort
        key = np.zeros(n, dtype=np.int64)
        for level in range(length):
            key = (key << bits) | codes[:, level]
        order = np.argsort(key, kind="stable")
        key = key[order]  # one int64 gathered a row, not `length`; the sorted codes unpacked from it
        codes = np.stack([(key >> (bits * (length - 1 - level))) & ((1 << bits) - 1) for level in range(length)],
                         axis=1)
        del key
    else:
        order = np.lexsort(codes.T[::-1])
        codes = codes[order]
    same = (codes[1:] == codes[:-1]).all(axis=1)
    if same.any():
        i = int(np.argmax(same))
        a, b = sorted((int(order[i]) + 1, int(order[i + 1]) + 1))
        raise CatalogError(f"{path}:{b}: duplicate item code (the same tokens as line {a})")
    id_fixed = ids.fixed()  # sorted here and compared, without the GIL (no object an id)
    by_id = np.argsort(id_fixed, kind="stable")
    same_id = id_fixed[by_id[1:]] == id_fixed[by_id[:-1]]
    if same_id.any():
        i = int(np.argmax(same_id))
        a, b = int(by_id[i]), int(by_id[i + 1])
        raise CatalogError(f"{path}:{b + 1}: duplicate item id {ids[b]!r} (also line {a + 1})")
    del by_id, same_id
    new = np.arange(n) == 0  # row starts a new prefix of the current length
    level_sizes, edge_tokens, child_counts = [1], [], []
    parent_of_row = np.zeros(n, dtype=np.int64)  # the row's node index within the previous level
    for level in range(length):
        new = new.copy()
        new[1:] |= codes[1:, level] != codes[:-1, level]
        starts = np.flatnonzero(new)
        child_counts.append(np.bincount(parent_of_row[starts], minlength=level_sizes[-1]))
        edge_tokens.append(codes[starts, level])
        parent_of_row = np.cumsum(new) - 1
        level_sizes.append(len(starts))
    child_counts.append(np.zeros(n, dtype=np.int64))  # the leaves
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(child_counts))]).astype(np.int64)
    tokens = np.concatenate(edge_tokens).astype(np.int32)
    return Catalog(name, offsets, tokens, ids.lines(order, id_fixed), length)


def layout_bytes(cat: Catalog, vocab_size: int) -> list[dict[str, int]]:
    """Per level with children: its bytes as dense bitmasks and as CSR (the measurement behind the layout)."""
    words = (vocab_size + 31) // 32
    out, sizes, node = [], [1], 0
    counts = np.diff(cat.offsets)
    for level in range(cat.code_length):
        edges = int(counts[node:node + sizes[-1]].sum())
        out.append({"level": level, "nodes": sizes[-1], "edges": edges, "dense_bytes": sizes[-1] * words * 4,
                    "csr_bytes": edges * 4 + (sizes[-1] + 1) * 8})
        node += sizes[-1]
        sizes.append(edges)
    return out


def build_catalog(name: str, path: str | Path, vocab_size: int, out_dir: Path, quiet: bool = False) -> dict:
    """Parses FILE, writes the trie and the item ids under out_dir/catalogs/; returns its manifest entry."""
    cat, (trie_bytes, items_bytes), (trie_sha, items_sha) = _read(name, path, vocab_size, quiet, "--catalog ")
    (out_dir / SUBDIR).mkdir(parents=True, exist_ok=True)
    trie_file, items_file = f"{SUBDIR}/{name}.trie.safetensors", f"{SUBDIR}/{name}.items"
    (out_dir / trie_file).write_bytes(trie_bytes)
    (out_dir / items_file).write_bytes(items_bytes)
    return {"name": name, "file": trie_file, "sha256": trie_sha, "items_file": items_file, "items_sha256": items_sha,
            "num_items": cat.num_items, "code_length": cat.code_length, "version": cat.version,
            "layout": "csr", "layout_bytes": layout_bytes(cat, vocab_size)}


def read_catalog(name: str, path: str | Path, vocab_size: int, quiet: bool = True) -> Catalog:
    """FILE parsed and built as `slmrank build --catalog NAME=FILE` would, in memory, with the
    version the artifact would record for it (what a server replacing a catalog loads)."""
    return _read(name, path, vocab_size, quiet, "catalog ")[0]


def _read(name: str, path: str | Path, vocab_size: int, quiet: bool,
          what: str) -> tuple[Catalog, tuple[bytes, bytes], tuple[str, str]]:
    """(the catalog with its version, the bytes of its two files, their sha256); CatalogError naming
    file:line."""
    path = Path(path)
    if not NAME_RE.fullmatch(name):
        raise CatalogError(f"{what}{name}: a name is 1-64 letters, digits, '_', '.', '-'")
    if not path.is_file():
        raise CatalogError(f"{path}: no such catalog file")
    big = path.stat().st_size > 8 << 20
    if big and not quiet:
        note(f"catalog {name}: parsing {path} ({path.stat().st_size >> 20} MiB)")
    ids, codes = parse_catalog(path, vocab_size)
    if big and not quiet:
        note(f"catalog {name}: {len(ids):,} items of {codes.shape[1]} tokens parsed; building the trie")
    cat = build_trie(name, ids, codes, path)
    del ids, codes
    files = catalog_files(cat)
    shas = (hashlib.sha256(files[0]).hexdigest(), hashlib.sha256(files[1]).hexdigest())
    version = hashlib.sha256((shas[0] + shas[1]).encode()).hexdigest()[:12]
    cat = Catalog(cat.name, cat.offsets, cat.tokens, cat.item_ids, cat.code_length, version)
    cat.edge_keys, cat.code_tokens  # noqa: B018  (here, off the event loop: not on the first beams, nor in ModelInfo)
    if big and not quiet:
        note(f"catalog {name}: {cat.num_items:,} items, {cat.num_nodes:,} trie nodes")
    return cat, files, shas


def catalog_files(cat: Catalog) -> tuple[bytes, bytes]:
    """The bytes of the catalog's two files: the trie (safetensors) and the item ids, a line each."""
    trie = save({"offsets": torch.from_numpy(cat.offsets), "tokens": torch.from_numpy(cat.tokens)})
    return trie, cat.item_ids.data


def load_catalog(art_dir: Path, entry: dict) -> Catalog:
    trie = load_file(str(art_dir / entry["file"]))
    items = ItemIds.of_lines((art_dir / entry["items_file"]).read_bytes())
    cat = Catalog(entry["name"], trie["offsets"].numpy(), trie["tokens"].numpy(), items, int(entry["code_length"]),
                  str(entry["version"]))
    cat.edge_keys, cat.code_tokens  # noqa: B018  (at load, not on the first request's beams)
    return cat


@dataclass(frozen=True)
class ForestCapacity:
    """What the beam_allowed node's trie forest holds room for (its tensors' sizes): trie nodes and
    edges over all catalogs, and the widest node's children (the window every row reads)."""
    nodes: int
    edges: int
    window: int

    def holds(self, other: ForestCapacity) -> bool:
        return other.nodes <= self.nodes and other.edges <= self.edges and other.window <= self.window

    def __str__(self) -> str:
        return f"{self.nodes:,} trie nodes, {self.edges:,} edges, {self.window:,} children at a node"


def forest_size(catalogs: list[Catalog] | tuple[Catalog, ...]) -> ForestCapacity:
    """What these catalogs' forest needs."""
    return ForestCapacity(sum(c.num_nodes for c in catalogs), sum(len(c.tokens) for c in catalogs),
                          max((int(np.diff(c.offsets).max(initial=1)) for c in catalogs), default=1))


def forest_capacity(catalogs: list[Catalog] | tuple[Catalog, ...], headroom: float = 1.0) -> ForestCapacity:
    """Room for these catalogs, each dimension `headroom` times what they need (rounded up): the
    room replacements (Scheduler.replace_catalog) have. 1.0: exactly theirs."""
    if not headroom >= 1.0:
        raise ValueError(f"catalog headroom {headroom}: must be at least 1.0")
    size = forest_size(catalogs)
    return ForestCapacity(*(math.ceil(headroom * v) for v in (size.nodes, size.edges, size.window)))


def trie_forest(catalogs: list[Catalog] | tuple[Catalog, ...], device: torch.device,
                capacity: ForestCapacity | None = None) -> dict[str, torch.Tensor]:
    """Every catalog's trie in one CSR over global node ids (catalog c's nodes after those of the
    catalogs before it), the constants of the beam_allowed node (cpp_dag/catalog_forest.cpp builds
    the same), sized to `capacity` (default: exactly these catalogs; CatalogError when they need more):
      catalog.offsets [capacity.nodes + 1] int64 (the nodes past the last real one: no children);
      catalog.tokens, catalog.child [capacity.edges + 1] int64 (past the real edges, padding edges:
      token 0 and child -1, that a window past a node's children reads; the last one always);
      catalog.roots [C + 1] int64 (each catalog's root, then -1: unconstrained);
      catalog.window [capacity.window] int64 = arange.
    The answers do not depend on the room (a row reads its node's children only), so a forest
    with room can be overwritten in place with other catalogs' (CUDA graphs keep its addresses)."""
    size = forest_size(catalogs)
    cap = capacity or size
    if not cap.holds(size):
        raise CatalogError(f"the catalogs need {size}; the server holds room for {cap}")
    offsets, tokens, child, roots = [np.zeros(1, np.int64)], [], [], []
    node_base = edge_base = 0
    for cat in catalogs:
        offsets.append(cat.offsets[1:] + edge_base)
        tokens.append(cat.tokens.astype(np.int64))
        child.append(np.arange(1, len(cat.tokens) + 1, dtype=np.int64) + node_base)
        roots.append(node_base)
        node_base, edge_base = node_base + cat.num_nodes, edge_base + len(cat.tokens)
    pad_edges = cap.edges - edge_base + 1
    arrays = {"catalog.offsets": np.concatenate(offsets + [np.full(cap.nodes - node_base, edge_base, np.int64)]),
              "catalog.tokens": np.concatenate(tokens + [np.zeros(pad_edges, np.int64)]),
              "catalog.child": np.concatenate(child + [np.full(pad_edges, -1, np.int64)]),
              "catalog.roots": np.array(roots + [-1], dtype=np.int64),
              "catalog.window": np.arange(cap.window, dtype=np.int64)}
    return {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
