"""Validity of catalog-constrained BeamSearch over many random requests (issue 28: zero invalid items
in 100,000): every returned beam is an item of the request's catalog with its own item_id, exactly
min(beam width, catalog size) beams come back, best first, all finite; unconstrained requests mixed
in come back whole and without item ids.

  python -m ops.bench.catalog_validity [--requests 100000] [--model embedded:tiny] [--runtime cpp]
                                      [--device cpu] [--seed 28] [--codes-share 0.25] [--out FILE.json]

Seeded random catalogs (service/loadgen/catalogs.py) of 2, 3 and 4 levels, from 40 items (fewer
than many requests' beams) to 200,000; requests of 1-64 beams and 1-96 prompt tokens, a catalog
drawn per request (one in eight unconstrained), --codes-share of the constrained ones normalised over
their catalog's code tokens (normalization "codes": batches of their own), run through the engine as
it batches them (requests of several catalogs share batches). Progress on stderr (a line every 10% when
not on a terminal); a summary line last; exit 1 on any invalid
answer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from service.artifact.artifact import build_artifact, load_artifact
from service.artifact.catalog import parse_catalog
from service.loadgen.catalogs import write_catalog
from service.model.progress import Progress
from service.runtime.engine import execute
from service.runtime.factory import make_runtime
from service.runtime.requests import BeamRequest, BeamResult

# name: (items, levels, codes a level)
CATALOGS = {"l2": (3_000, 2, 64), "l3": (200_000, 3, 256), "l3few": (40, 3, 256), "l4": (20_000, 4, 32)}
CHUNK = 256  # requests handed to the engine at a time


def _items(path: Path, vocab_size: int) -> dict[tuple[int, ...], str]:
    """code -> item id, read by the build's own parser."""
    ids, codes = parse_catalog(path, vocab_size)
    return dict(zip(map(tuple, codes.tolist()), ids.tolist()))


def check(req: BeamRequest, res: object, items: dict[tuple[int, ...], str] | None) -> str | None:
    """What is wrong with one answer (None: valid)."""
    if not isinstance(res, BeamResult):
        return f"no beams: {res!r}"[:200]
    scores = [b.logprob for b in res.beams]
    if scores != sorted(scores, reverse=True) or not all(s > float("-inf") and s == s for s in scores):
        return "scores not finite and best first"
    if items is None:
        if len(res.beams) != req.beam_width or any(b.item_id is not None for b in res.beams):
            return "unconstrained: wrong beam count or an item id"
        return None
    if len(res.beams) != min(req.beam_width, len(items)):
        return f"{len(res.beams)} beams, expected {min(req.beam_width, len(items))}"
    for b in res.beams:
        if items.get(tuple(b.ids)) != b.item_id or b.item_id is None:
            return f"beam {b.ids} ({b.item_id}) is no item of {req.catalog}"
    if len({tuple(b.ids) for b in res.beams}) != len(res.beams):
        return "a beam twice"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--model", default="embedded:tiny")
    p.add_argument("--runtime", default="cpp", choices=["cpp", "python"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=28)
    p.add_argument("--codes-share", type=float, default=0.25,
                   help="of the constrained requests, this share normalised over the codes")
    p.add_argument("--out")
    args = p.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for i, (name, (n, levels, codes)) in enumerate(CATALOGS.items()):
            files[name] = write_catalog(Path(tmp) / f"{name}.tsv", n, args.seed + i, levels, codes)
        art = load_artifact(build_artifact(args.model, Path(tmp) / "art", quiet=True, catalogs=files))
        items = {name: _items(path, art.config.vocab_size) for name, path in files.items()}
        runtime = make_runtime(args.runtime, art, args.device, None)
        names = [*CATALOGS, ""]
        invalid: list[str] = []
        done, beams, num_codes, t0 = 0, 0, 0, time.monotonic()
        with Progress("catalog validity", args.requests) as bar:
            while done < args.requests:
                reqs = []
                for k in range(min(CHUNK, args.requests - done)):
                    cat = rng.choice(names) if rng.random() < 7 / 8 else ""
                    levels = CATALOGS[cat][1] if cat else rng.randint(1, 4)
                    prompt = tuple(rng.randrange(art.config.vocab_size) for _ in range(rng.randint(1, 96)))
                    norm = "codes" if cat and rng.random() < args.codes_share else "vocab"
                    num_codes += norm == "codes"
                    reqs.append(BeamRequest(prompt, rng.randint(1, 64), levels, id=str(done + k), catalog=cat,
                                            normalization=norm))
                for req, res in zip(reqs, execute(art, runtime, reqs)):
                    problem = check(req, res, items[req.catalog] if req.catalog else None)
                    beams += len(getattr(res, "beams", ()))
                    if problem:
                        invalid.append(f"request {req.id} ({req.catalog or 'free'}, {req.normalization}, "
                                       f"B={req.beam_width}): {problem}")
                done += len(reqs)
                bar.advance(len(reqs), f"{beams:,} beams, {len(invalid)} invalid")
        if hasattr(runtime, "shutdown"):
            runtime.shutdown()
    summary = {"requests": done, "codes_normalised": num_codes, "beams": beams, "invalid": len(invalid),
               "first_invalid": invalid[:20],
               "catalogs": {k: v[0] for k, v in CATALOGS.items()}, "model": args.model, "runtime": args.runtime,
               "device": args.device, "seed": args.seed, "seconds": round(time.monotonic() - t0, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    sys.exit(1 if invalid else 0)


if __name__ == "__main__":
    main()
