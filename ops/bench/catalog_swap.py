"""A catalog replaced again and again while `slmrank serve` answers constrained BeamSearch under load
(issue 28: "a swap under load with zero errors", at real sizes on the GPU):

  python -m ops.bench.catalog_swap [--model embedded:qwen2.5-0.5b] [--items 1000000] [--beam 100]
      [--prompt 128] [--clients 8] [--duration-s 20] [--swaps 4] [--device cuda] [--out DIR]

1. An artifact of --model built with a seeded catalog `swap` of --items random 3-token semantic IDs
   over 3 x 256 code tokens (service/loadgen/catalogs.py; cached under the artifact cache, keyed by
   the model and the items), and the same catalog under another seed, both written into a catalog
   directory as v1.tsv and v2.tsv.
2. `slmrank serve --catalog-dir DIR` as a subprocess; --clients closed loops of BeamSearch
   (--prompt random ids, --beam, 3 new tokens, catalog `swap`; a refusal's retry-after-ms honoured)
   for --duration-s after a warm-up batch per caller, while
   `Admin.ReplaceCatalog` swaps `swap` to v2, v1, v2, ... --swaps times, evenly spread.
3. Every answer is checked: its catalog_version one of the two, and each beam's ids exactly the item
   its item_id names in that version's file.

Report (DIR/catalog_swap.json, and a table last): answers and errors by status code, beams checked
and invalid, answers per version, each swap's read and pause (ms), latency p50/p99 of the answers
that overlapped a swap's call against the others. Exit 1 if any request failed or any beam was not
an item of the version it names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ops.bench.bench_grpc import Proc, wait_serving
from ops.bench.workloads import cached_catalog_artifact
from service.loadgen.catalogs import catalog_codes, write_catalog
from service.serving.proto_gen import load as load_stubs

NAME = "swap"  # the catalog's name in the artifact and in every request
LEVELS, CODES, BASE = 3, 256, 1000  # service/loadgen/catalogs.py's default code layout
SEEDS = {"v1": 28, "v2": 29}


def swap_artifact(model: str, items: int, catalog_dir: Path, quiet: bool = True) -> Path:
    """The artifact of `model` with catalog NAME = v1 (cached, keyed by the model and the items); v1.tsv
    and v2.tsv written into catalog_dir."""
    catalog_dir.mkdir(parents=True, exist_ok=True)
    for version, seed in SEEDS.items():
        write_catalog(catalog_dir / f"{version}.tsv", items, seed, LEVELS, CODES, BASE)
    key = json.dumps([model, NAME, items, SEEDS["v1"], LEVELS, CODES, BASE])
    return cached_catalog_artifact(model, NAME, lambda: catalog_dir / "v1.tsv", key, "swap-", quiet=quiet)


class Items:
    """A version's items as write_catalog numbers them: item `i<k>` is row k of the seeded codes."""

    def __init__(self, items: int, seed: int) -> None:
        self.ids = catalog_codes(items, seed, LEVELS, CODES) + BASE + CODES * np.arange(LEVELS)

    def holds(self, item_id: str, ids: list[int]) -> bool:
        if not (item_id.startswith("i") and item_id[1:].isdigit()) or int(item_id[1:]) >= len(self.ids):
            return False
        return self.ids[int(item_id[1:])].tolist() == list(ids)


async def load(target: str, args: argparse.Namespace, stop: threading.Event,
               answers: list[tuple[float, float, Any]]) -> None:
    """--clients closed loops until stop: (sent_s, answered_s, response or grpc error) each."""
    stubs = load_stubs()
    pb2, pb2_grpc = stubs.pb2, stubs.pb2_grpc
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.RankerStub(channel)

        async def caller(i: int) -> None:
            rng = np.random.default_rng(i)
            while not stop.is_set():
                msg = pb2.BeamSearchRequest(prompt=pb2.Segment(ids=rng.integers(1, BASE, args.prompt).tolist()),
                                            beam_width=args.beam, new_tokens=LEVELS, catalog=NAME)
                t0 = time.perf_counter()
                try:
                    out: Any = await stub.BeamSearch(msg, timeout=args.deadline_s)
                except grpc.aio.AioRpcError as e:
                    out = e
                answers.append((t0, time.perf_counter(), out))
                if isinstance(out, grpc.aio.AioRpcError):  # a refusal's hint is honoured, as a client would
                    retry = next((int(v) for k, v in (out.trailing_metadata() or ()) if k == "retry-after-ms"), 0)
                    await asyncio.sleep(min(retry, 2000) / 1e3)

        await asyncio.gather(*(caller(i) for i in range(args.clients)))


async def warm_up(target: str, args: argparse.Namespace, rounds: int = 3) -> None:
    """Before the measured load: a request alone, then rounds of --clients at once (not counted), so
    that the server has measured the batches the load forms."""
    stubs = load_stubs()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = stubs.pb2_grpc.RankerStub(channel)
        msg = stubs.pb2.BeamSearchRequest(prompt=stubs.pb2.Segment(ids=list(range(1, args.prompt + 1))),
                                          beam_width=args.beam, new_tokens=LEVELS, catalog=NAME)
        await stub.BeamSearch(msg, timeout=600)
        for _ in range(rounds):
            await asyncio.gather(*(stub.BeamSearch(msg, timeout=600) for _ in range(args.clients)))


def swaps(target: str, args: argparse.Namespace, t_start: float) -> list[dict[str, Any]]:
    """ReplaceCatalog --swaps times, v2 first, evenly over --duration-s; each one's times."""
    from service.serving.client import RankerClient

    done = []
    with RankerClient(target, timeout_s=120) as client:
        for k in range(args.swaps):
            time.sleep(max(0.0, t_start + (k + 1) * args.duration_s / (args.swaps + 1) - time.perf_counter()))
            version = "v2" if k % 2 == 0 else "v1"
            t0 = time.perf_counter()
            resp = client.replace_catalog(NAME, f"{version}.tsv")
            done.append({"file": f"{version}.tsv", "version": resp.catalog.version, "items": resp.catalog.num_items,
                         "read_ms": round(resp.read_ms, 1), "pause_ms": round(resp.pause_ms, 2),
                         "call_ms": round((time.perf_counter() - t0) * 1e3, 1), "start_s": t0, "end_s": time.perf_counter()})
    return done


def check(answers: list[tuple[float, float, Any]], versions: dict[str, Items],
          swapped: list[dict[str, Any]]) -> dict[str, Any]:
    codes: dict[str, int] = {}
    per_version = {v: 0 for v in versions}
    beams = invalid = 0
    during, outside = [], []
    examples = []
    for sent, answered, out in answers:
        if isinstance(out, grpc.RpcError):
            code = out.code().name
            codes[code] = codes.get(code, 0) + 1
            if len(examples) < 3:
                examples.append(f"{code}: {out.details()}")
            continue
        codes["OK"] = codes.get("OK", 0) + 1
        items = versions.get(out.catalog_version)
        if items is None:
            invalid += len(out.beams) or 1
            if len(examples) < 3:
                examples.append(f"catalog_version {out.catalog_version!r} is neither version")
            continue
        per_version[out.catalog_version] += 1
        for b in out.beams:
            beams += 1
            if not items.holds(b.item_id, list(b.ids)):
                invalid += 1
                if len(examples) < 3:
                    examples.append(f"beam {list(b.ids)} is not item {b.item_id!r} of {out.catalog_version}")
        overlaps = any(sent < s["end_s"] and answered > s["start_s"] for s in swapped)
        (during if overlaps else outside).append((answered - sent) * 1e3)

    def pct(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"n": 0, "p50_ms": None, "p99_ms": None}
        return {"n": len(values), "p50_ms": round(float(np.percentile(values, 50)), 2),
                "p99_ms": round(float(np.percentile(values, 99)), 2)}

    return {"codes": codes, "answers_per_version": per_version, "beams_checked": beams, "invalid": invalid,
            "latency_overlapping_a_swap": pct(during), "latency_otherwise": pct(outside), "examples": examples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:qwen2.5-0.5b")
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--swaps", type=int, default=4)
    p.add_argument("--deadline-s", type=float, default=10.0, help="every request's deadline")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--serve-args", default="", help="more `slmrank serve` flags, one string")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--out", default="/tmp/catalog_swap")
    args = p.parse_args(argv)
    if args.swaps < 1 or args.items < 1 or args.clients < 1:
        p.error("--swaps, --items and --clients must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    art = swap_artifact(args.model, args.items, out / "catalogs")
    versions_by_file = {v: Items(args.items, seed) for v, seed in SEEDS.items()}
    print(f"[catalog_swap] artifact {art} and two catalogs of {args.items:,} items in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    server = Proc("slmrank", [
        sys.executable, "-m", "service.cli", "serve", "--model", str(art), "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "off", "--device", args.device, "--catalog-dir", str(out / "catalogs"), "--grace-s", "10",
        *args.serve_args.split()], out / "slmrank_server.log", args.start_timeout_s)
    answers: list[tuple[float, float, Any]] = []
    stop = threading.Event()
    try:
        asyncio.run(wait_serving(server.target, args.start_timeout_s))
        from service.serving.client import RankerClient

        with RankerClient(server.target, timeout_s=30) as client:
            first = next(c.version for c in client.model_info().catalogs if c.name == NAME)
        asyncio.run(warm_up(server.target, args))
        loader = threading.Thread(target=asyncio.run, args=(load(server.target, args, stop, answers),))
        t_start = time.perf_counter()
        loader.start()
        try:
            swapped = swaps(server.target, args, t_start)
            time.sleep(max(0.0, t_start + args.duration_s - time.perf_counter()))
        finally:
            stop.set()
            loader.join(args.deadline_s + 30)
    finally:
        server.stop()
    # the artifact's v1 is the first version; each swap's response names the version of its file
    version_of = {"v1.tsv": first, **{s["file"]: s["version"] for s in swapped}}
    versions = {version_of[f"{v}.tsv"]: items for v, items in versions_by_file.items() if f"{v}.tsv" in version_of}
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "model": args.model,
              "items": args.items, "prompt": args.prompt, "beam": args.beam, "clients": args.clients,
              "duration_s": args.duration_s, "device": args.device,
              "swaps": [{k: v for k, v in s.items() if not k.endswith("_s")} for s in swapped],
              **check(answers, versions, swapped)}
    (out / "catalog_swap.json").write_text(json.dumps(result, indent=1))
    print(f"{'swap':>4s} {'file':>7s} {'items':>10s} {'read ms':>9s} {'pause ms':>9s} {'call ms':>9s}")
    for k, s in enumerate(result["swaps"]):
        print(f"{k + 1:4d} {s['file']:>7s} {s['items']:10,d} {s['read_ms']:9.1f} {s['pause_ms']:9.2f} {s['call_ms']:9.1f}")
    d, o = result["latency_overlapping_a_swap"], result["latency_otherwise"]
    print(f"answers {result['codes']}; per version {result['answers_per_version']}; beams checked "
          f"{result['beams_checked']:,}, invalid {result['invalid']}")
    print(f"latency p50 / p99 ms: overlapping a swap {d['p50_ms']} / {d['p99_ms']} (n {d['n']}); "
          f"otherwise {o['p50_ms']} / {o['p99_ms']} (n {o['n']})")
    for e in result["examples"]:
        print(f"  {e}")
    return result


if __name__ == "__main__":
    res = main()
    failed = sum(n for code, n in res["codes"].items() if code != "OK")
    sys.exit(1 if failed or res["invalid"] or not res["beams_checked"] else 0)
