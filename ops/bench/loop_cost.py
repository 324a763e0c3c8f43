"""CPU time of `slmrank serve`'s event-loop thread per request: the serial part of the server.

  python -m ops.bench.loop_cost --kind score --requests 200 [--samples 15 --len 64] [--deadline-s 0.004]
  python -m ops.bench.loop_cost --kind beam --requests 40 --beam 100

Every request passes through the one event loop (gRPC, parsing, admission, packing, the response),
so its CPU per request bounds the requests per second the process can take at all, whatever the
GPU does. The server runs as a subprocess (`--model`, default embedded:tiny, on the CPU unless
--device cuda); 8 client threads send --requests requests after a warm-up of 16; the loop thread's
CPU is read from /proc/PID/task/PID/stat (Linux) before and after. With --deadline-s shorter than
any request's run, every request is refused at admission: the cost of a refusal. With --bare the
server is a bare grpc.aio Ranker on uvloop that answers Score at once (no model, no admission, no
tracing): the floor that gRPC alone puts under every request on this host. With --instant the
server is slmrank's own (`serve`'s config defaults, --model, the C++ runtime) with the executor's
time taken out: each bucket's first batch runs for real and every later batch of that bucket is
answered at once, from a worker thread through the loop as the C++ runtime answers, with that
first batch's outputs (the answers are not the requests' own: a load instrument, not a server).
The loop's CPU is then slmrank's whole serving path without a GPU and without the CPU runtime's
threads competing with the loop, which they do on a small host (a 2-core machine: ~8 ms a
request with the tiny model's real batches, against ~0.3 ms for --bare).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from service.observe.metrics import thread_cpu_seconds
from service.runtime.timings import BatchTimings
from service.serving.client import RankerClient

ROOT = Path(__file__).resolve().parents[2]  # the repository root: the servers' cwd


def thread_cpu_s(pid: int, tid: int) -> float:
    return thread_cpu_seconds(tid, pid) or 0.0


def process_cpu_s(pid: int) -> float:
    return sum(thread_cpu_s(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["score", "beam"], default="score")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--len", type=int, default=64, help="tokens per sample (score) or prompt (beam)")
    p.add_argument("--beam", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=5)
    p.add_argument("--deadline-s", type=float, default=0.0, help="per-request deadline (0: none)")
    p.add_argument("--model", default="embedded:tiny")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--runtime", default="cpp", choices=["cpp", "python"])
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="also cProfile the server's event loop (SLMRANK_PROFILE_LOOP) into FILE and print "
                        "its top functions; the profiler slows the loop, so the CPU figures are then higher")
    p.add_argument("--bare", action="store_true", help="a bare grpc.aio server instead of slmrank (the floor)")
    p.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)  # the --bare server itself
    p.add_argument("--instant", action="store_true",
                   help="slmrank's server with the executor's time taken out (each bucket runs once for real)")
    p.add_argument("--serve-instant", action="store_true", help=argparse.SUPPRESS)  # the --instant server itself
    args = p.parse_args()
    if args.serve_bare:
        serve_bare()
        return
    if args.serve_instant:
        serve_instant(args.model, args.device)
        return
    if args.bare and args.kind != "score":
        raise SystemExit("loop_cost: --bare answers Score only")
    if args.bare and args.instant:
        raise SystemExit("loop_cost: --bare or --instant, not both")
    if args.instant and args.runtime != "cpp":
        raise SystemExit("loop_cost: --instant answers as the C++ runtime does (--runtime cpp)")
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("loop_cost: needs Linux /proc for per-thread CPU time")

    this = [sys.executable, "-m", "ops.bench.loop_cost"]  # the --bare / --instant server: this module
    argv = [*this, "--serve-bare"] if args.bare else [
        *this, "--serve-instant", "--model", args.model, "--device", args.device] if args.instant else [
        sys.executable, "-m", "service.cli", "serve", "--model", args.model, "--port", "0", "--metrics-port", "0",
        "--runtime", args.runtime, "--device", args.device, "--grace-s", "2"]
    env = dict(os.environ)
    if args.profile:
        if args.bare:
            raise SystemExit("loop_cost: --profile profiles slmrank's server, not --bare")
        env["SLMRANK_PROFILE_LOOP"] = str(Path(args.profile).resolve())
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = None
        for line in proc.stdout:  # type: ignore[union-attr]
            if m := re.search(r"listening on [^\s]*:(\d+)", line):
                port = int(m.group(1))
                break
        if port is None:
            raise SystemExit(f"loop_cost: the server exited ({proc.wait()}) before listening")
        client = RankerClient(f"127.0.0.1:{port}", timeout_s=300)
        end = time.monotonic() + 600
        while not args.bare:
            try:
                client.model_info(timeout_s=1)
                break
            except Exception:  # noqa: BLE001 -- still loading
                if time.monotonic() > end or proc.poll() is not None:
                    raise SystemExit("loop_cost: the server did not become ready")
                time.sleep(0.2)
        rng = np.random.default_rng(0)
        deadline = args.deadline_s or None
        codes: dict[str, int] = {}

        def one(_: int) -> None:
            try:
                if args.kind == "beam":
                    client.beam(rng.integers(0, 1000, args.len).tolist(), beam_width=args.beam,
                                new_tokens=args.new_tokens, timeout_s=deadline)
                else:
                    client.score([rng.integers(0, 1000, args.len).tolist() for _ in range(args.samples)],
                                 label_ids=[3, 9], timeout_s=deadline)
                code = "OK"
            except Exception as e:  # noqa: BLE001 -- a refusal is what --deadline-s measures
                code = getattr(e, "code", lambda: type(e).__name__)()
                code = getattr(code, "name", str(code))
            codes[code] = codes.get(code, 0) + 1

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(16)))  # warm-up: first batches, lazily built tables
            codes.clear()
            loop0, all0, t0 = thread_cpu_s(proc.pid, proc.pid), process_cpu_s(proc.pid), time.monotonic()
            list(pool.map(one, range(args.requests)))
            loop1, all1, t1 = thread_cpu_s(proc.pid, proc.pid), process_cpu_s(proc.pid), time.monotonic()
        client.close()
        n = args.requests
        print(f"{args.kind}: {n} requests in {t1 - t0:.2f} s {codes}; event-loop thread CPU "
              f"{1e3 * (loop1 - loop0) / n:.3f} ms/request; whole process {1e3 * (all1 - all0) / n:.2f} ms/request")
    finally:
        proc.terminate()
        proc.wait(30)
    if args.profile:
        import pstats

        stats = pstats.Stats(args.profile)
        for key in ("tottime", "cumulative"):
            print(f"== the event loop's top functions by {key} (warm-up and measured requests together) ==")
            stats.sort_stats(key).print_stats(25)


class InstantRuntime:
    """A loaded C++ runtime whose batches take no time after the first of each bucket (see the
    module's doc): submit() answers from a worker thread through loop.call_soon_threadsafe, the
    C++ runtime's own way back to the loop. Everything else is the runtime's."""

    def __init__(self, inner: Any) -> None:
        import queue

        self.inner = inner
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._kept: dict[str, tuple[list[Any], BatchTimings]] = {}  # bucket key -> (outputs, timings)
        threading.Thread(target=self._work, name="instant-runtime", daemon=True).start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(self, batch: Any) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, batch, time.monotonic_ns()))
        return fut

    def _work(self) -> None:
        from service.runtime.batch import ScoreBatch
        from service.runtime.cpp_runtime import _resolve

        while True:
            loop, fut, batch, submit_ns = self._jobs.get()
            try:
                key = batch.bucket.key
                if key not in self._kept:  # the bucket's one real run: its outputs and node timings
                    outputs = ([self.inner.run_score(batch)] if isinstance(batch, ScoreBatch)
                               else list(self.inner.run_beam(batch)))
                    self._kept[key] = (outputs, self.inner.last_timings)
                outputs, timings = self._kept[key]
                now = time.monotonic_ns()
                timings = dataclasses.replace(timings, submit_ns=submit_ns, start_ns=now, h2d_end_ns=now,
                                              launch_ns=now, d2h_end_ns=now, done_ns=now)
                loop.call_soon_threadsafe(_resolve, fut, (outputs, timings), None)
            except Exception as e:  # noqa: BLE001 -- the batch fails, as a runtime's would
                loop.call_soon_threadsafe(_resolve, fut, None, f"{type(e).__name__}: {e}")


def serve_instant(model: str, device: str) -> None:
    """slmrank's server on 127.0.0.1 (an ephemeral port, metrics too) with an InstantRuntime."""
    import dataclasses

    from service.serving.server import ServerConfig, load_model, serve

    def loader() -> Any:
        loaded = load_model(model, "cpp", device)
        return dataclasses.replace(loaded, runtime=InstantRuntime(loaded.runtime))

    serve(ServerConfig(host="127.0.0.1", port=0, metrics_port=0, grace_s=2), loader,
          lambda line: print(line, flush=True))


def serve_bare() -> None:
    """A Ranker with nothing behind it: Score answers a log-prob pair per sample at once."""
    import asyncio

    import grpc
    import uvloop

    from service.serving.proto_gen import load as load_stubs

    stubs = load_stubs()
    pb2 = stubs.pb2

    class Bare(stubs.pb2_grpc.RankerServicer):
        async def Score(self, request, context):  # noqa: N802 -- the proto's name
            return pb2.ScoreResponse(samples=[pb2.SampleScore(logprobs=[-1.0, -2.0]) for _ in request.samples])

    async def run() -> None:
        server = grpc.aio.server()
        stubs.pb2_grpc.add_RankerServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"listening on 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    uvloop.run(run())


if __name__ == "__main__":
    main()
