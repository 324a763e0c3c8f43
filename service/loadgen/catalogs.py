"""Seeded random catalogs of semantic-ID items, for the catalog workloads (W7, W8) and the catalog
scale benchmark (ops/bench/catalog_scale.py): `slmrank build --catalog NAME=FILE`'s file format
(service/artifact/catalog.py), one item a line, `item_id<TAB>tok tok tok`.

An item's code is `levels` tokens, level l's token one of `codes` consecutive ids from
base + l * codes (so the token ids of different levels are distinct; the default 3 x 256 from 1000
lies inside both Qwen's vocabulary of 151,936 and the `tiny` model's 4,096). The items' codes are
distinct, drawn without replacement from all codes^levels; item k (file order) is `i<k>`, k
zero-padded. Same (items, seed, levels, codes, base): the same bytes.

Numpy over blocks of lines (no Python loop per item): 10M items in a few seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

# the catalogs the workloads name: the same name, the same catalog, in every benchmark
CATALOGS: dict[str, dict[str, Any]] = {
    "sid-1m": dict(items=1_000_000, levels=3, codes=256, base=1000, seed=28),
}
BLOCK = 1 << 20  # lines formatted at a time


def num_codes(name: str) -> int | None:
    """The code tokens of a generated catalog (levels x codes a level: its items use every one), None
    for a name that is not one of CATALOGS."""
    spec = CATALOGS.get(name)
    return None if spec is None else spec["levels"] * spec["codes"]


def _digits(values: np.ndarray, width: int) -> np.ndarray:
    """values [n] (non-negative, < 10^width) -> their decimal digits [n, width] as ASCII, zero-padded."""
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    return ((values[:, None] // powers) % 10 + 48).astype(np.uint8)


def catalog_codes(items: int, seed: int, levels: int = 3, codes: int = 256) -> np.ndarray:
    """items distinct codes [items, levels] of values in [0, codes), in a seeded random order."""
    space = codes ** levels
    if not 0 < items <= space:
        raise ValueError(f"{items} items: a catalog of {levels} x {codes} codes holds 1 to {space}")
    flat = np.random.default_rng(seed).choice(space, size=items, replace=False).astype(np.int64)
    powers = codes ** np.arange(levels - 1, -1, -1, dtype=np.int64)
    return (flat[:, None] // powers) % codes


def write_catalog(path: str | Path, items: int, seed: int, levels: int = 3, codes: int = 256,
                  base: int = 1000) -> Path:
    """Writes the catalog file; returns its path."""
    path = Path(path)
    code = catalog_codes(items, seed, levels, codes)
    id_width = len(str(items - 1))
    tok_width = len(str(base + levels * codes - 1))  # zero-padded where base has fewer digits: "0999" is 999
    line = 1 + id_width + 1 + levels * (tok_width + 1)  # i<k> TAB tok (SPACE tok)* NEWLINE
    offsets = base + codes * np.arange(levels, dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        for start in range(0, items, BLOCK):
            k = np.arange(start, min(start + BLOCK, items), dtype=np.int64)
            rows = np.empty((len(k), line), dtype=np.uint8)
            rows[:, 0] = ord("i")
            rows[:, 1:1 + id_width] = _digits(k, id_width)
            col = 1 + id_width
            rows[:, col] = ord("\t")
            col += 1
            for level in range(levels):
                rows[:, col:col + tok_width] = _digits(code[start:start + len(k), level] + offsets[level], tok_width)
                col += tok_width
                rows[:, col] = ord(" ") if level < levels - 1 else ord("\n")
                col += 1
            fh.write(rows.tobytes())
    return path


def catalog_file(name: str, directory: str | Path) -> Path:
    """CATALOGS[name]'s file under directory, written once (kept while its size is the expected one)."""
    spec = CATALOGS[name]
    path = Path(directory) / f"{name}-seed{spec['seed']}.tsv"
    id_width = len(str(spec["items"] - 1))
    tok_width = len(str(spec["base"] + spec["levels"] * spec["codes"] - 1))
    size = spec["items"] * (2 + id_width + spec["levels"] * (tok_width + 1))
    if not (path.is_file() and path.stat().st_size == size):
        tmp = path.with_suffix(".tmp")
        write_catalog(tmp, spec["items"], spec["seed"], spec["levels"], spec["codes"], spec["base"])
        tmp.replace(path)
    return path
