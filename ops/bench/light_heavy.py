"""Light clients beside heavy ones on one `slmrank serve` (issue 32, point 10's second H200 check):
does a light caller keep its latency while another sends the heaviest requests?

  python -m ops.bench.light_heavy [--light W1] [--heavy W5] [--model SPEC] [--light-clients 4]
      [--heavy-clients 2] [--windows 8] [--window-s 3] [--device cuda] [--kernels triton]
      [--serve-args "..."] [--set SECTION.FIELD=VALUE ...] [--server-root DIR] [--out DIR]

1. `slmrank serve` runs as a subprocess on 127.0.0.1 (ops/bench/bench_grpc.py's Proc), the model the
   light workload names unless --model is given; both workloads' shapes run on it.
2. After a warm-up of each, windows alternate: --light-clients closed loops of the light workload
   alone for --window-s; then the same beside --heavy-clients closed loops of the heavy workload
   (started 0.2 s before, running 1.2 x the window). Alternating puts both conditions on the same
   background; --windows of each.
3. The two callers identify themselves by x-client-id (`light`, `heavy`), as tenants would, so the
   server's per-client share applies. A refusal's retry-after-ms is honoured.

Report (DIR/light_heavy.json, and a table last): the light requests' p50/p99 alone and beside the
heavy ones, their ratio (the target: p99 beside <= 2 x alone), status codes of both, the heavy
requests served; from the server's /metrics, its batches and those started heavy (by why), and
each kind's mean stage times (queue, batch, execute, ...) over the alone windows and over the
beside windows: where the light requests' added time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from ops.bench.bench_grpc import ROOT, Proc, wait_serving
from ops.bench.overload_bench import Outcome, _requests, closed_loop, summarize
from ops.bench.workloads import ID_HIGH, parse_workload
from service.loadgen.server_view import add_deltas, scrape, stage_means_by_kind, window_delta
from service.serving.proto_gen import load as load_stubs


class Windows:
    """The server's /metrics growth over the windows of one condition (alone, beside), summed: the
    per-kind stage means of the requests those windows finished (nothing without a metrics URL)."""

    def __init__(self, url: str | None) -> None:
        self.url, self.total, self._start = url, {}, None

    async def begin(self) -> None:
        self._start = await asyncio.to_thread(scrape, self.url) if self.url else None

    async def end(self) -> None:
        if self._start is not None:
            add_deltas(self.total, window_delta(self._start, await asyncio.to_thread(scrape, self.url)))

    def stage_means(self) -> dict[str, dict[str, float]]:
        return stage_means_by_kind(self.total)


async def alternate(target: str, light: dict[str, Any], heavy: dict[str, Any], high: int, args: argparse.Namespace,
                    seen: dict[str, Windows]) -> tuple[list[Outcome], list[Outcome], list[Outcome]]:
    """(light alone, light beside heavy, heavy) outcomes over the alternating windows; seen["alone"]
    and seen["beside"] gather the server's view of each condition's windows."""
    stubs = load_stubs()
    light_md, heavy_md = [("x-client-id", "light")], [("x-client-id", "heavy")]
    # overload_bench's pools of the workloads' requests, every one NORMAL with the deadline
    _, make_light = _requests(light, high, 11, 0.0, args.deadline_s, args.deadline_s)
    _, make_heavy = _requests(heavy, high, 12, 0.0, args.deadline_s, args.deadline_s)
    async with grpc.aio.insecure_channel(target) as ch_light, grpc.aio.insecure_channel(target) as ch_heavy:
        await ch_light.channel_ready()
        await ch_heavy.channel_ready()
        method = lambda stub, w: stub.Score if w["kind"] == "score" else stub.BeamSearch  # noqa: E731
        call_light = method(stubs.pb2_grpc.RankerStub(ch_light), light)
        call_heavy = method(stubs.pb2_grpc.RankerStub(ch_heavy), heavy)
        await closed_loop(call_light, make_light, args.light_clients, 1.0, metadata=light_md)  # warm-up
        await closed_loop(call_heavy, make_heavy, args.heavy_clients, 1.0, metadata=heavy_md)
        alone: list[Outcome] = []
        beside: list[Outcome] = []
        heavy_out: list[Outcome] = []
        for k in range(args.windows):
            await seen["alone"].begin()
            alone += await closed_loop(call_light, make_light, args.light_clients, args.window_s, metadata=light_md,
                                       first_index=100_000 * k)
            await seen["alone"].end()
            heavy_task = asyncio.ensure_future(closed_loop(call_heavy, make_heavy, args.heavy_clients,
                                                           1.2 * args.window_s, metadata=heavy_md,
                                                           first_index=1_000 * k))
            await asyncio.sleep(0.2)  # the heavy requests are running
            await seen["beside"].begin()
            beside += await closed_loop(call_light, make_light, args.light_clients, args.window_s,
                                        metadata=light_md, first_index=50_000 + 100_000 * k)
            await seen["beside"].end()
            heavy_out += await heavy_task
            print(f"[light_heavy] window {k + 1}/{args.windows}: light {len(alone)} alone, {len(beside)} beside; "
                  f"heavy {len(heavy_out)}", file=sys.stderr, flush=True)
    return alone, beside, heavy_out


def report(alone: list[Outcome], beside: list[Outcome], heavy: list[Outcome], args: argparse.Namespace) -> dict:
    span = args.windows * args.window_s
    a, b, h = summarize(alone, span), summarize(beside, span), summarize(heavy, 1.2 * span)
    ratio = b["ok_p99_ms"] / a["ok_p99_ms"] if a["ok_p99_ms"] and a["ok_p99_ms"] == a["ok_p99_ms"] else None
    return {"light_alone": a, "light_beside_heavy": b, "heavy": h, "p99_ratio": ratio,
            "p99_within_2x": ratio is not None and ratio <= 2.0}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--light", default="W1", help="the light callers' workload (ops/bench/workloads.py)")
    p.add_argument("--heavy", default="W5", help="the heavy callers' workload")
    p.add_argument("--model", default=None, help="default: the light workload's model")
    p.add_argument("--light-clients", type=int, default=4)
    p.add_argument("--heavy-clients", type=int, default=2)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--deadline-s", type=float, default=1.0, help="every request's deadline")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--kernels", default="auto", choices=["auto", "aten", "triton"])
    p.add_argument("--serve-args", default="", help="more `slmrank serve` flags, one string")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a scheduler constant that is no flag, changed for this server (ops/bench/serve_tuned.py)")
    p.add_argument("--server-root", default=str(ROOT),
                   help="the source tree the server runs from (default: this one): an A/B run measures another "
                        "version of the server with the same callers (ops/device/light_heavy AB_ROUNDS)")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--out", default="/tmp/light_heavy")
    args = p.parse_args(argv)
    from service.artifact.resolve import resolve_artifact

    light, heavy = parse_workload(args.light), parse_workload(args.heavy)
    model = args.model or light.get("model") or "embedded:tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    high = min(ID_HIGH, resolve_artifact(model, quiet=True).config.vocab_size)
    # with --set, the server is serve_tuned's (`slmrank serve` with those constants changed)
    command = ([sys.executable, "-m", "ops.bench.serve_tuned", *(a for s in args.set for a in ("--set", s)), "--"]
               if args.set else [sys.executable, "-m", "service.cli", "serve"])
    server = Proc("slmrank", [
        *command, "--model", model, "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--device", args.device, "--kernels", args.kernels, "--grace-s", "10",
        *args.serve_args.split()], out / "slmrank_server.log", args.start_timeout_s, Path(args.server_root))
    try:
        asyncio.run(wait_serving(server.target, args.start_timeout_s))
        seen = {"alone": Windows(server.metrics_url), "beside": Windows(server.metrics_url)}
        alone, beside, heavy_out = asyncio.run(alternate(server.target, light, heavy, high, args, seen))
        # the server's batches over the whole run (warm-up included), and those started heavy, by why
        view = scrape(server.metrics_url) if server.metrics_url else {}
    finally:
        server.stop()
    batches = {"all": sum(v for (name, _), v in view.items() if name == "slmrank_batches_total"),
               **{labels.split('"')[1]: v for (name, labels), v in view.items() if name == "slmrank_heavy_batches_total"}}
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "model": model,
              "light": args.light, "heavy": args.heavy, "light_clients": args.light_clients,
              "heavy_clients": args.heavy_clients, "windows": args.windows, "window_s": args.window_s,
              "device": args.device, "serve_args": args.serve_args, "set": args.set, "server_root": args.server_root, "server_batches": batches,
              # what the requests finished in each condition's windows spent in each stage (the
              # server's histograms, by kind): where the light requests' time went beside the heavy
              "server_stage_ms": {cond: w.stage_means() for cond, w in seen.items()},
              **report(alone, beside, heavy_out, args)}
    (out / "light_heavy.json").write_text(json.dumps(result, indent=1))
    a, b, h = result["light_alone"], result["light_beside_heavy"], result["heavy"]
    print(f"{'':22s} {'sent':>6s} {'p50 ms':>8s} {'p99 ms':>8s}  codes")
    print(f"{args.light + ' alone':22s} {a['sent']:6d} {a['ok_p50_ms']:8.2f} {a['ok_p99_ms']:8.2f}  {a['codes']}")
    print(f"{args.light + ' beside ' + args.heavy:22s} {b['sent']:6d} {b['ok_p50_ms']:8.2f} {b['ok_p99_ms']:8.2f}  "
          f"{b['codes']}")
    print(f"{args.heavy + ' (heavy)':22s} {h['sent']:6d} {h['ok_p50_ms']:8.2f} {h['ok_p99_ms']:8.2f}  {h['codes']}")
    print(f"server batches: {batches.get('all', 0):.0f}, heavy by time {batches.get('time', 0):.0f}, "
          f"by ratio {batches.get('ratio', 0):.0f}")
    stages = result["server_stage_ms"]
    for kind in sorted(set(stages["alone"]) | set(stages["beside"])):
        a_ms, b_ms = stages["alone"].get(kind, {}), stages["beside"].get(kind, {})
        print(f"{kind} stage means, alone -> beside (ms): " + ", ".join(
            f"{s} {a_ms.get(s, float('nan')):.2f} -> {b_ms.get(s, float('nan')):.2f}" for s in sorted(set(a_ms) | set(b_ms))))
    ratio = result["p99_ratio"]
    print(f"light p99 beside / alone: {ratio:.2f} (target <= 2)" if ratio is not None else "light p99: no answer")
    return result


if __name__ == "__main__":
    main()
