"""Catalog scale (issue 28, point 1: "10 million items must fit in <= 2 GB of GPU memory and load in
<= 30 s"): build and load times, device bytes and peak RSS of seeded random semantic-ID catalogs.

  python -m ops.bench.catalog_scale [--items 1000000,10000000] [--seed 28] [--cpp] [--replace] [--dir DIR] [--out FILE]

Per size, a catalog of 3-token items over 3 x 256 code tokens (service/loadgen/catalogs.py:
write_catalog, token ids from 1000, distinct per level, inside Qwen's 151,936) is written under
--dir (default a temp dir, removed after), then each phase runs in its own subprocess, so that its
peak RSS (ru_maxrss) is its own:
  build: `slmrank build`'s catalog step, build_catalog (parse_catalog + build_trie + writing the trie
         and item files with their sha256), against Qwen's vocabulary of 151,936;
  load:  load_catalog (the files -> numpy, the item ids' lines found) + trie_forest (the beam_allowed
         constants, to --device, cpu by default) + the first Catalog.item_of of 400 codes; the
         bytes are the forest tensors' (what the device holds) and layout_bytes' CSR sum (what the
         files hold);
  replace (--replace): phase_replace, a replacement while serving (Admin.ReplaceCatalog) by a
         catalog of the same size (the next seed): read, forest built, written in place;
  cpp (--cpp): an embedded:tiny artifact (vocabulary 4,096: the tokens fit) built with the catalog,
         then load_artifact (sha256 of every file, load_catalog) and CppRuntime construction on the
         CPU (artifact_loader.cpp reads the trie files itself, catalog_forest.cpp builds the forest),
         beside the same artifact without the catalog.
Wall times (_s) and each phase's CPU seconds (cpu_s: user + system, which a machine shared with
other work inflates less). Prints one line a phase; --out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QWEN_VOCAB = 151_936


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s() -> float:
    """This process's CPU seconds (user + system): on a shared machine, what the wall times are not."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def phase_build(file: Path, out: Path) -> dict[str, Any]:
    from service.artifact import catalog as c

    spent: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = time.perf_counter() - t
        return wrapper

    parse, trie = c.parse_catalog, c.build_trie
    c.parse_catalog, c.build_trie = timed("parse_s", parse), timed("trie_s", trie)
    try:
        t = time.perf_counter()
        entry = c.build_catalog("sid", file, QWEN_VOCAB, out, quiet=True)
        total = time.perf_counter() - t
    finally:
        c.parse_catalog, c.build_trie = parse, trie
    (out / "entry.json").write_text(json.dumps(entry))
    return {"build_s": total, **spent, "write_s": total - sum(spent.values()),
            "csr_bytes": sum(level["csr_bytes"] for level in entry["layout_bytes"]),
            "file_bytes": file.stat().st_size}


def phase_load(out: Path, device: str) -> dict[str, Any]:
    import numpy as np
    import torch

    from service.artifact.catalog import load_catalog, trie_forest

    entry = json.loads((out / "entry.json").read_text())
    t = time.perf_counter()
    cat = load_catalog(out, entry)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    forest = trie_forest([cat], torch.device(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_forest = time.perf_counter() - t
    codes = np.random.default_rng(0).integers(0, 256, (400, 3)) + np.array([1000, 1256, 1512])  # a beam's 400 codes
    t = time.perf_counter()
    cat.item_of(codes)
    t_item = time.perf_counter() - t
    return {"load_catalog_s": t_load, "trie_forest_s": t_forest, "load_s": t_load + t_forest,
            "item_of_400_s": t_item, "nodes": cat.num_nodes, "edges": len(cat.tokens),
            "device_bytes": sum(v.numel() * v.element_size() for v in forest.values()),
            "window_k": int(forest["catalog.window"].numel())}


def phase_replace(file: Path, out: Path, device: str) -> dict[str, Any]:
    """What a replacement while serving costs (Admin.ReplaceCatalog): the built catalog's forest with
    the server's default room (headroom 1.25) on the device, then another catalog of the same size
    read (read_catalog: parse, trie, version), its forest built on the host (while batches run) and
    written over the first in place (write_s: what constrained batches wait for)."""
    import torch

    from service.artifact.catalog import forest_capacity, load_catalog, read_catalog, trie_forest

    cat = load_catalog(out, json.loads((out / "entry.json").read_text()))
    capacity = forest_capacity([cat], 1.25)
    forest = trie_forest([cat], torch.device(device), capacity)
    exact_bytes = sum(v.numel() * v.element_size() for v in trie_forest([cat], torch.device("cpu")).values())
    t = time.perf_counter()
    new = read_catalog("sid", file, QWEN_VOCAB)
    t_read = time.perf_counter() - t
    t = time.perf_counter()
    host = trie_forest([new], torch.device("cpu"), capacity)
    t_build = time.perf_counter() - t
    t = time.perf_counter()
    for name, value in host.items():
        forest[name].copy_(value)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_write = time.perf_counter() - t
    return {"read_s": t_read, "forest_build_s": t_build, "write_s": t_write, "version": new.version,
            "roomy_device_bytes": sum(v.numel() * v.element_size() for v in forest.values()),
            "exact_device_bytes": exact_bytes}


def phase_cpp(file: Path, out: Path) -> dict[str, Any]:
    from service.artifact.artifact import build_artifact, load_artifact
    from service.runtime.cpp_runtime import CppRuntime

    row: dict[str, Any] = {}
    for key, catalogs in (("with", {"sid": file}), ("without", None)):
        art_dir = out / f"tiny-{key}"
        t = time.perf_counter()
        build_artifact("embedded:tiny", art_dir, quiet=True, catalogs=catalogs)
        row[f"{key}_build_artifact_s"] = time.perf_counter() - t
        t = time.perf_counter()
        art = load_artifact(art_dir)
        row[f"{key}_load_artifact_s"] = time.perf_counter() - t
        t = time.perf_counter()
        rt = CppRuntime(art, device="cpu")
        row[f"{key}_cpp_runtime_s"] = time.perf_counter() - t
        del rt, art
        shutil.rmtree(art_dir)
    return row


def child(args: argparse.Namespace) -> None:
    file, out = Path(args.file), Path(args.art)
    out.mkdir(parents=True, exist_ok=True)
    cpu0 = cpu_s()
    row = {"build": lambda: phase_build(file, out), "load": lambda: phase_load(out, args.device),
           "replace": lambda: phase_replace(file.with_name(file.stem + "-next.tsv"), out, args.device),
           "cpp": lambda: phase_cpp(file, out)}[args.child]()
    row["cpu_s"] = cpu_s() - cpu0  # the phase's CPU seconds, the imports before it left out
    row["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(row), flush=True)


def run_phase(phase: str, file: Path, art: Path, device: str) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ops.bench.catalog_scale", "--child", phase, "--file", str(file),
                           "--art", str(art), "--device", device], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"catalog_scale {phase} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t  # with the interpreter's start and imports
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", default="1000000,10000000", help="comma list of catalog sizes")
    p.add_argument("--seed", type=int, default=28)
    p.add_argument("--device", default="cpu", help="where trie_forest puts the forest (cpu, cuda)")
    p.add_argument("--cpp", action="store_true", help="also CppRuntime construction on an artifact with the catalog")
    p.add_argument("--replace", action="store_true", help="also a replacement while serving: another catalog of the "
                                                          "size read and written over the first's forest")
    p.add_argument("--dir", default=None, help="where the catalogs and tries go (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="write the rows here as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--art", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return []
    from service.loadgen.catalogs import write_catalog

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="catalog-scale-"))
    rows = []
    try:
        for items in (int(x) for x in args.items.split(",")):
            file = base / f"sid-{items}-seed{args.seed}.tsv"
            t = time.perf_counter()
            write_catalog(file, items, args.seed)
            row: dict[str, Any] = {"items": items, "generate_s": time.perf_counter() - t, "cpus": os.cpu_count(),
                                   "loadavg": os.getloadavg()[0]}
            print(f"{items:,} items: generated {file.stat().st_size / 2**20:.0f} MiB in {row['generate_s']:.1f} s",
                  flush=True)
            if args.replace:  # the catalog it is replaced with: the same size, the next seed
                write_catalog(file.with_name(file.stem + "-next.tsv"), items, args.seed + 1)
            for phase in ("build", "load") + (("replace",) if args.replace else ()) + (("cpp",) if args.cpp else ()):
                art = base / f"art-{items}"
                r = run_phase(phase, file, art, args.device)
                row[phase] = r
                print(f"  {phase}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
                                                for k, v in r.items()), flush=True)
            rows.append(row)
            shutil.rmtree(base / f"art-{items}", ignore_errors=True)
            file.unlink()
            file.with_name(file.stem + "-next.tsv").unlink(missing_ok=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
