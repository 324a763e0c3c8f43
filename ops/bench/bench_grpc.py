"""Closed-loop gRPC benchmark of `slmrank serve`, and of the Hugging Face peer on the same weights
(BENCHMARKS.md's procedure).

  python -m ops.bench.bench_grpc --workload W1 --levels 1,2,4,8,16,32 --warmup-s 2 --measure-s 10 --out DIR \
      [--peer] [--device cuda|cpu] [--model embedded:qwen3-0.6b | CHECKPOINT_DIR | ARTIFACT_DIR]

Each system runs as its own subprocess on 127.0.0.1 (`python -m service.cli serve --port 0 ...`,
`python -m ops.bench.hf_peer ...`): its bound port is read from its output, then health is polled
until SERVING. The load is `slmrank bench`'s (service/loadgen/loop.py's sweep, the same code): per
level N, N requests in flight over --connections connections (default 1), each next one sent as
soon as the last one completes; warm-up, then a measured window: QPS = RPCs completed OK in the
window / its length; latency = client send -> response, of those RPCs; errors counted by status.
Capacity = the highest QPS of a level with mean < 20 ms and P99 < 80 ms (and at most 0.1% errors);
effective MFU = logical FLOPs per request (service/model/flops.py) x capacity / 989e12 (H200 dense
BF16).

With --peer and an embedded spec, the artifact's weights are written as an HF checkpoint
(ops.bench.bench_executor.save_hf_checkpoint) and BOTH systems load that checkpoint: the same weights.
slmrank is measured first, alone on the host; then the peers start, a few fixed requests go to
every system (their largest difference is reported: "agreement"), and the peers are measured.

Workloads, as service/loadgen/workloads.py defines them: W1..W8 (docs/benchmarks.md), custom:
"score,prefix=0,samples=3,len=8,labels=2" / "beam,prompt=16,beam=4,new=3", or a mix (score-mix,
beam-mix, mixed: drawn within the limits slmrank's ModelInfo gives; effective MFU on the FLOPs of
the requests completed, and the strong peer pads its Score batches to powers of two, warming each
such shape at start-up: hf_peer --warm-mix). Token ids are uniform in [0, min(150000, vocab)),
fixed seed; --pool distinct requests (default 512), drawn before the levels and cycled.
A catalog workload (W7, W8: beams held to the catalog sid-1m) runs against the artifact of --model
built with that catalog (ops.bench.workloads.catalog_artifact: built once into the artifact cache),
or an artifact directory that holds it; the peers have no catalog (--peer / --strong-peer refused):
its unconstrained twin (W7u, W8u) is the run beside it.
Writes DIR/bench_grpc.json; prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ops.bench.workloads import (ID_HIGH, Requests, catalog_artifact, flops_per_request, mix_score_bounds,
                                 parse_workload)
from service.loadgen.loop import Pool, Progress, capacity as capacity_at, sweep
# the server's view of a window; overload_bench and the tests read them from here too
from service.loadgen.server_view import SAMPLE as _SAMPLE, scrape, server_breakdown, window_delta  # noqa: F401
from service.serving.proto_gen import load as load_stubs

ROOT = Path(__file__).resolve().parents[2]  # the repository root

PEAK_BF16 = 989e12
SLO_MEAN_MS, SLO_P99_MS = 20.0, 80.0
POOL = 512  # distinct requests drawn before the levels, then cycled


# ---- the systems under test, as subprocesses -------------------------------------------------------

class Proc:
    """A server subprocess; its bound port read from a 'listening on HOST:PORT' line of its stdout."""

    def __init__(self, name: str, argv: list[str], log_path: Path, start_timeout_s: float, root: Path = ROOT,
                 cpus: set[int] | None = None) -> None:
        """cpus: the CPUs it (and every process it starts) may run on; default all."""
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        self.name, self.log_path = name, log_path
        self.proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE,
                                     stderr=log_path.open("w"), text=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        self.lines: queue.Queue[str] = queue.Queue()
        self.metrics_url: str | None = None  # slmrank's /metrics, from its announcement
        threading.Thread(target=self._read, daemon=True).start()
        self.port = self._port(start_timeout_s)
        self.target = f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"metrics on (http://\S+/metrics)", line):
                self.metrics_url = m.group(1).replace("0.0.0.0", "127.0.0.1")
            self.lines.put(line)

    def _port(self, timeout_s: float) -> int:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): {self.log_path.read_text()[-3000:]}")
                continue
            if m := re.search(r"listening on [^\s]*:(\d+)", line):
                return int(m.group(1))
        self.stop()
        raise RuntimeError(f"{self.name} did not announce its port within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


async def wait_serving(target: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{target}: not SERVING within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)


# ---- the closed loop: the package's load generator ------------------------------------------------

def capacity(levels: list[dict[str, Any]]) -> dict[str, Any] | None:
    return capacity_at(levels, SLO_MEAN_MS, SLO_P99_MS)


async def bench_system(name: str, target: str, w: dict[str, Any], high: int, args: argparse.Namespace,
                       flops: int | None, metrics_url: str | None = None, cfg: Any = None,
                       limits: Any = None) -> dict[str, Any]:
    """flops: a fixed shape's logical FLOPs a request; None for a mix, whose requests (drawn within
    limits) count their own, on the model of config cfg."""
    reqs = Requests(w, high, seed=args.seed, limits=limits)
    pool = Pool([reqs.next() for _ in range(getattr(args, "pool", POOL))], cfg)

    def on_level(r: dict[str, Any]) -> None:
        level = r["level"]
        print(f"  {name:8s} level {level:4d}: {r['qps']:9.1f} req/s  mean {r['mean_ms']:8.2f} ms  "
              f"p50 {r['p50_ms']:8.2f}  p99 {r['p99_ms']:8.2f}  errors {r['errors'] or 0}", flush=True)
        if r["server"]:
            sv = r["server"]
            outside = (f"; outside the server {r['mean_ms'] - sv['latency_mean_ms']:.2f} ms a request"
                       if sv["latency_mean_ms"] is not None else "")
            print(f"  {'':8s} server: {sv['requests_per_batch']} requests/batch; latency {sv['latency_mean_ms']} ms"
                  f"{outside}; event loop "
                  f"{sv['loop_cpu_ms_per_request']} CPU ms/request, busy {sv['loop_busy']}; stage means (ms) "
                  + " ".join(f"{k} {v:.2f}" for k, v in sv["stage_mean_ms"].items()), flush=True)

    # past --stop-above-ms the higher levels are skipped (bounded in time: past it the loop only measures a queue)
    swept = await sweep(target, pool, levels=args.levels, warmup_s=args.warmup_s, measure_s=args.measure_s,
                        rpc_timeout_s=args.rpc_timeout_s, connections=getattr(args, "connections", 1),
                        stop_above_ms=args.stop_above_ms, metrics_url=metrics_url,
                        progress=Progress() if sys.stderr.isatty() else None, on_level=on_level)
    rows = swept["levels"]
    cap = capacity(rows)
    out: dict[str, Any] = {"target": target, "levels": rows, "skipped_levels": swept["skipped_levels"],
                           "capacity": cap}
    flops_per_s = (cap["qps"] * flops if flops is not None else cap["flops_per_s"]) if cap else 0.0
    out["eff_mfu_bf16"] = flops_per_s / PEAK_BF16
    if flops is None:
        out["pool"] = pool.describe()
    out["max_qps"] = max((r["qps"] for r in rows), default=0.0)
    return out


async def agreement(targets: dict[str, str], w: dict[str, Any], high: int, n: int,
                    limits: Any = None) -> dict[str, Any]:
    """The same n requests to every system: the largest logprob difference, and whether beam ids agree."""
    reqs = Requests(w, high, seed=12345, limits=limits)
    msgs = [reqs.next() for _ in range(n)]
    stubs = load_stubs()
    answers: dict[str, list[Any]] = {}
    for name, target in targets.items():
        async with grpc.aio.insecure_channel(target) as ch:
            stub = stubs.pb2_grpc.RankerStub(ch)
            answers[name] = [await (stub.Score if hasattr(m, "samples") else stub.BeamSearch)(m, timeout=120)
                             for m in msgs]
    a, b = answers["slmrank"], next(v for k, v in answers.items() if k != "slmrank")
    max_diff, ids_equal = 0.0, True
    for x, y in zip(a, b):
        if hasattr(x, "samples"):
            for sx, sy in zip(x.samples, y.samples):
                max_diff = max(max_diff, float(np.max(np.abs(np.array(sx.logprobs) - np.array(sy.logprobs)))))
        else:
            ids_equal &= [list(bx.ids) for bx in x.beams] == [list(by.ids) for by in y.beams]
            max_diff = max(max_diff, max(abs(bx.logprob - by.logprob) for bx, by in zip(x.beams, y.beams)))
    from service.serving.client import to_json

    return {"requests": n, "max_abs_logprob_diff": max_diff, "beam_ids_equal": ids_equal,
            "first": {k: to_json(v[0]) for k, v in answers.items()}}


# ---- main -------------------------------------------------------------------------------------------

async def run(args: argparse.Namespace) -> dict[str, Any]:
    from service.artifact.resolve import resolve_artifact

    w = parse_workload(args.workload, mixes=True)
    is_mix = w["kind"] == "mix"
    model = args.model or w.get("model") or "embedded:tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    served_model = catalog_model(model, w["catalog"]) if w.get("catalog") else model
    artifact = resolve_artifact(served_model, quiet=True)
    cfg = artifact.config
    high = min(ID_HIGH, cfg.vocab_size)
    flops = None if is_mix else flops_per_request(cfg, w)  # a mix: each request its own
    runtime = args.runtime or ("cpp" if args.device == "cuda" else "python")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "git": _git_commit(),
        "workload": w, "model": model, "device": args.device, "runtime": runtime, "dtype": dtype,
        "levels": args.levels, "serve_args": args.serve_args, "server_root": args.server_root,
        "warmup_s": args.warmup_s, "measure_s": args.measure_s,
        "slo": {"mean_ms": SLO_MEAN_MS, "p99_ms": SLO_P99_MS}, "logical_flops_per_request": flops,
        "peak_flops": PEAK_BF16, "id_range": [0, high], "systems": {}}

    tmp = Path(tempfile.mkdtemp(prefix="bench-grpc-"))
    ckpt = None
    peers = {name: extra for name, extra, on in (
        ("hf_peer", [], args.peer),
        # the compiled peer compiles its padded Score shapes at start-up (--warm-score, --warm-mix:
        # added once slmrank's limits are known), not in the windows
        ("hf_strong", ["--max-batch", str(args.strong_peer), "--compile",
                       *(["--warm-score", f"{w['samples']}:{w['len']}:{w['prefix']}"] if w["kind"] == "score" else [])],
         args.strong_peer > 0)) if on}
    if peers:
        ckpt_path = Path(model)
        if ckpt_path.is_dir() and (ckpt_path / "config.json").exists():
            ckpt = str(ckpt_path)  # an HF checkpoint already: both systems load it
        else:
            from ops.bench.bench_executor import save_hf_checkpoint

            ckpt = save_hf_checkpoint(artifact, str(tmp / "hf"))
            served_model = ckpt  # slmrank serves the checkpoint too: the same (bf16-rounded) weights
        result["hf_checkpoint"] = ckpt
    result["served_model"] = served_model

    procs: dict[str, Proc] = {}
    try:
        procs["slmrank"] = Proc("slmrank", [
            sys.executable, "-m", "service.cli", "serve", "--model", served_model, "--host", "127.0.0.1",
            "--port", "0", "--metrics-port", "0", "--runtime", runtime, "--device", args.device, "--dtype", dtype,
            "--grace-s", "5",
            "--capture-graphs", args.capture_graphs, "--kernels", args.kernels, *shlex.split(args.serve_args)],
            out / "slmrank_server.log", args.start_timeout_s, Path(args.server_root))
        await wait_serving(procs["slmrank"].target, args.start_timeout_s)
        result["startup_s"] = round(time.perf_counter() - t0, 2)
        limits = await served_limits(procs["slmrank"].target) if is_mix else None
        if limits is not None and "hf_strong" in peers and w["weights"].get("score"):
            peers["hf_strong"] += ["--warm-mix", "%d:%d" % mix_score_bounds(limits)]
        result["peers"] = peers  # each peer's hf_peer flags
        # slmrank is measured before any peer process exists: a peer beside it, even idle between
        # its batches, shares the host's cores (its torch threads spin after each op, and a
        # compiled peer compiles at its first batches), and slmrank's event loop is CPU-bound
        print(f"slmrank on {procs['slmrank'].target}:", flush=True)
        result["systems"]["slmrank"] = await bench_system("slmrank", procs["slmrank"].target, w, high, args, flops,
                                                          procs["slmrank"].metrics_url, cfg, limits)
        _save_partial(out, result)
        for name, extra in peers.items():
            procs[name] = Proc(name, [
                sys.executable, "-m", "ops.bench.hf_peer", "--checkpoint", ckpt, "--host", "127.0.0.1",
                "--port", "0", "--device", args.device, *extra], out / f"{name}.log", args.start_timeout_s)
            await wait_serving(procs[name].target, args.start_timeout_s)
        if peers:
            result["agreement"] = await agreement({k: p.target for k, p in procs.items()}, w, high,
                                                  args.check_requests, limits)
        for name in peers:
            print(f"{name} on {procs[name].target}:", flush=True)
            result["systems"][name] = await bench_system(name, procs[name].target, w, high, args, flops, None, cfg,
                                                         limits)
            _save_partial(out, result)
    finally:
        for name, p in procs.items():
            rc = p.stop()
            if name in result["systems"]:
                result["systems"][name]["exit_code"] = rc
        shutil.rmtree(tmp, ignore_errors=True)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    result.pop("partial", None)
    (out / "bench_grpc.json").write_text(json.dumps(result, indent=1))
    return result


def catalog_model(model: str, catalog: str) -> str:
    """What slmrank serves for a catalog workload: an artifact directory that holds the catalog as
    it is; else the artifact of the spec / checkpoint built with it (catalog_artifact)."""
    from service.artifact.artifact import MANIFEST, load_artifact

    path = Path(model)
    if (path / MANIFEST).exists():
        if catalog not in load_artifact(path).catalog_lengths:
            raise SystemExit(f"--model {model}: the artifact has no catalog {catalog!r} (build it with "
                             f"ops.bench.workloads.catalog_artifact, or give the spec)")
        return model
    return str(catalog_artifact(model, catalog))


async def served_limits(target: str) -> Any:
    """The server's limits (ModelInfo's), which a mix's requests are drawn within."""
    async with grpc.aio.insecure_channel(target) as ch:
        stubs = load_stubs()
        return (await stubs.pb2_grpc.RankerStub(ch).ModelInfo(stubs.pb2.ModelInfoRequest(), timeout=30)).limits


def _save_partial(out: Path, result: dict[str, Any]) -> None:
    """bench_grpc.json with the systems measured so far, marked partial: a run cut by a time limit
    (the peer's compile, say) keeps slmrank's figures. The last write replaces it, without the mark."""
    (out / "bench_grpc.json").write_text(json.dumps({**result, "partial": True}, indent=1))


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def print_table(result: dict[str, Any]) -> None:
    flops = result["logical_flops_per_request"]
    print(f"\n== {result['workload']['name']} on {result['model']} ({result['device']}, {result['dtype']}); "
          + (f"{flops / 1e12:.4f} TFLOP/request ==" if flops is not None else "each request's own FLOPs =="))
    print(f"{'system':8s} {'level':>5s} {'req/s':>9s} {'mean ms':>9s} {'p50 ms':>9s} {'p99 ms':>9s} {'errors':>6s}")
    for name, s in result["systems"].items():
        for r in s["levels"]:
            print(f"{name:8s} {r['level']:5d} {r['qps']:9.1f} {r['mean_ms']:9.2f} {r['p50_ms']:9.2f} "
                  f"{r['p99_ms']:9.2f} {r['num_errors']:6d}")
        cap = s["capacity"]
        print(f"{name:8s} capacity: " + (f"{cap['qps']:.1f} req/s at level {cap['level']}, eff. MFU "
                                         f"{s['eff_mfu_bf16']:.2%}" if cap else "none within the SLO"))
    if "agreement" in result:
        a = result["agreement"]
        print(f"agreement on {a['requests']} requests: max |logprob diff| {a['max_abs_logprob_diff']:.2e}, "
              f"beam ids equal: {a['beam_ids_equal']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", required=True,
                   help="W1..W8 (W7u, W8u, W7c, W8c), score-mix, beam-mix, mixed, or 'score,prefix=0,samples=3,len=8,labels=2' / "
                        "'beam,prompt=16,beam=4,new=3'")
    p.add_argument("--levels", default=None, help="requests in flight, comma list (default 1,2,...,64; W6: 1)")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=10.0)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_grpc"))
    p.add_argument("--peer", action="store_true",
                   help="also the naive Hugging Face peer (one request at a time), on the same weights")
    p.add_argument("--strong-peer", type=int, default=0, metavar="N",
                   help="also the strong peer: up to N waiting requests in one batched call, Score under "
                        "torch.compile (ops.bench.hf_peer --max-batch N --compile)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None, help="embedded spec, HF checkpoint or artifact dir (default: the workload's)")
    p.add_argument("--runtime", default=None, choices=["python", "cpp"], help="default: cpp on cuda, python on cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--capture-graphs", default="all", choices=["all", "parallel", "lazy"],
                   help="slmrank serve --capture-graphs (lazy: each bucket's graph on its first batch, in warm-up)")
    p.add_argument("--kernels", default="auto", choices=["auto", "aten", "triton"], help="slmrank serve --kernels")
    p.add_argument("--server-root", default=str(ROOT),
                   help="the source tree slmrank's server runs from (default: this one); an A/B run measures "
                        "another version of the server with the same client (ops/device/capacity AB_ROUNDS)")
    p.add_argument("--serve-args", default="",
                   help="more `slmrank serve` flags, one string (e.g. '--lanes 1 --batcher-max-inflight 1')")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--pool", type=int, default=POOL, help="distinct requests drawn before the levels, then cycled")
    p.add_argument("--connections", type=int, default=1, help="client connections the requests in flight spread over")
    p.add_argument("--check-requests", type=int, default=2, help="requests sent to both systems to compare answers")
    p.add_argument("--stop-above-ms", type=float, default=2000.0,
                   help="skip the higher levels once a level's mean latency exceeds this")
    p.add_argument("--rpc-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    w = parse_workload(args.workload, mixes=True)
    args.levels = [int(x) for x in (args.levels or w.get("levels") or "1,2,4,8,16,32,64").split(",")]
    if w.get("catalog") and (args.peer or args.strong_peer):
        raise SystemExit(f"--workload {args.workload}: the peers have no catalog; compare it with its unconstrained "
                         f"twin ({args.workload}u)")
    if args.warmup_s < 0 or args.measure_s <= 0 or min(args.levels) < 1 or args.pool < 1 or args.connections < 1:
        raise SystemExit("--warmup-s >= 0, --measure-s > 0, levels >= 1, --pool >= 1, --connections >= 1")
    result = asyncio.run(run(args))
    print_table(result)
    return result


if __name__ == "__main__":
    main()
