"""`slmrank bench --target HOST:PORT`: size a running server. Closed loop at levels (requests in
flight) or open loop at rates (Poisson arrivals), a workload (W1..W8, a mix, a custom shape) or a
`slmrank run` request file; per level QPS, latency, errors by status code; the capacity at the
SLO; effective MFU where the model's shape is known; bench.json, bench.csv and two PNG charts.

This module only defines the command's flags when `slmrank` starts (no grpc import): the rest
loads when the command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..serving.client_flags import add_tls_arguments

PEAK_TFLOPS = 989.0  # the H200's dense BF16 peak: effective MFU's denominator (docs/benchmarks.md)
DEFAULT_LEVELS = "1,2,4,8,16,32,64"


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, where it has one (not "None")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="load a running server: QPS and latency per level, the capacity at the SLO",
                       description=__doc__.split("\n\n")[0].replace("\n", " "),
                       formatter_class=_Defaults)
    b.add_argument("--target", required=True, help="HOST:PORT of the server's gRPC API")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None,
                     help="W1..W8 (W7u, W8u, W7c, W8c), score-mix, beam-mix, mixed, or a custom shape 'score,prefix=0,samples=3,len=8,"
                          "labels=2' / 'beam,prompt=16,beam=4,new=3' (default W1; docs/benchmarks.md)")
    src.add_argument("--requests", default=None, metavar="FILE",
                     help="a `slmrank run` JSONL request file (label_ids or label_texts), sent in order and cycled")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--levels", default=None,
                      help=f"closed loop: requests in flight per level, comma list (default {DEFAULT_LEVELS})")
    load.add_argument("--rate", default=None, metavar="R[,R...]",
                      help="open loop: Poisson arrivals at R req/s per level, comma list")
    b.add_argument("--refine", type=int, default=0, metavar="N",
                   help="closed loop: up to N more levels after --levels, each halfway between the highest level "
                        "within the SLO and the lowest above it that is not (the capacity to the level)")
    b.add_argument("--warmup-s", type=float, default=2.0, help="a level's warm-up, not measured")
    b.add_argument("--measure-s", type=float, default=10.0, help="a level's measured window")
    b.add_argument("--connections", type=int, default=4, help="client connections (TCP) the requests spread over")
    b.add_argument("--slo-mean-ms", type=float, default=20.0, help="the SLO: a level's mean latency below this")
    b.add_argument("--slo-p99-ms", type=float, default=80.0, help="the SLO: a level's P99 latency below this")
    b.add_argument("--out", default="slmrank-bench", metavar="DIR", help="bench.json, bench.csv and the PNGs")
    b.add_argument("--seed", type=int, default=7, help="the requests' and the arrivals' generator")
    b.add_argument("--pool", type=int, default=512, help="distinct requests drawn before the levels, then cycled")
    b.add_argument("--priority", default="unspecified", choices=["unspecified", "online", "normal", "background"],
                   help="the requests' admission lane")
    b.add_argument("--rpc-timeout-s", type=float, default=60.0, help="each RPC's deadline")
    b.add_argument("--stop-above-ms", type=float, default=2000.0,
                   help="skip the higher levels once a level's mean latency exceeds this")
    b.add_argument("--metrics", default=None, metavar="URL",
                   help="the server's /metrics (http://HOST:9464/metrics): its own view of each window too")
    b.add_argument("--model", default=None, metavar="SPEC",
                   help="the served model's shape for the FLOPs, where ModelInfo does not tell it: an embedded "
                        "spec, an artifact or a Hugging Face checkpoint directory")
    b.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="effective MFU's denominator")
    add_tls_arguments(b)
    b.add_argument("--quiet", action="store_true", help="no progress line, no per-level lines: the table only")
    b.set_defaults(func=main)


def _numbers(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma list of numbers") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{flag}: every value must be > 0, got {text!r}")
    return values


def check(args: argparse.Namespace) -> None:
    """Every flag's mistake before anything is sent: a ValueError naming the flag (exit 2)."""
    for flag in ("measure_s", "slo_mean_ms", "slo_p99_ms", "rpc_timeout_s", "stop_above_ms", "peak_tflops"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be > 0, got {getattr(args, flag)}")
    if args.warmup_s < 0:
        raise ValueError(f"--warmup-s: must be >= 0, got {args.warmup_s}")
    for flag in ("connections", "pool"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag}: must be >= 1, got {getattr(args, flag)}")
    args.level_list = _numbers(args.levels or DEFAULT_LEVELS, "--levels", int) if args.rate is None else None
    args.rate_list = _numbers(args.rate, "--rate", float) if args.rate is not None else None
    if args.refine < 0 or (args.refine and args.rate is not None):
        raise ValueError(f"--refine: a count >= 0 of more closed-loop levels (not with --rate), got {args.refine}")


def model_config(spec: str) -> Any:
    """The ModelConfig of an embedded spec, an artifact directory or a Hugging Face checkpoint
    directory on this machine."""
    from ..model.checkpoint import embedded_spec, load_hf_config

    if spec.startswith("embedded:"):
        return embedded_spec(spec).config
    path = Path(spec)
    if (path / "config.json").is_file():
        return load_hf_config(path)  # read within its bound, like the server's
    from ..artifact.artifact import MANIFEST, load_artifact

    if (path / MANIFEST).is_file():
        return load_artifact(path, verify=False).config
    raise ValueError(f"--model: {spec!r} is not an embedded spec, an artifact nor a checkpoint directory here")


def served_config(info: Any, override: str | None) -> tuple[Any, str]:
    """The served model's config for the FLOPs and where it came from: --model; else ModelInfo's
    model when this machine can read it (an embedded spec, a directory here); else the embedded
    spec of ModelInfo's architecture, layers, width and vocabulary (the real Qwen checkpoints have
    their shapes); else (None, why). Its label head is ModelInfo's."""
    import dataclasses

    from ..model.checkpoint import EMBEDDED

    def own(cfg: Any) -> Any:
        return dataclasses.replace(cfg, num_labels=info.num_labels)

    if override:
        return own(model_config(override)), f"--model {override}"
    try:
        return own(model_config(info.model)), f"ModelInfo.model {info.model}"
    except (ValueError, OSError):
        pass
    key = (info.arch, info.num_layers, info.hidden_size)
    same = [name for name, spec in EMBEDDED.items()
            if (spec.config.arch, spec.config.num_layers, spec.config.hidden_size) == key]
    if len(same) == 1:
        cfg = dataclasses.replace(EMBEDDED[same[0]].config, vocab_size=info.vocab_size)
        return own(cfg), f"the shape of embedded:{same[0]} ({info.arch}, {info.num_layers} layers, hidden {info.hidden_size})"
    return None, f"unknown: {info.model!r} ({info.arch}, {info.num_layers} layers, hidden {info.hidden_size}); pass --model"


def _credentials(args: argparse.Namespace) -> Any:
    import grpc

    if args.tls_ca is None:
        return None
    read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731 -- three files, one rule
    return grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))


def _probe(client: Any, pool: Any) -> None:
    """One request of each method the pool sends, before the levels: a workload the server refuses
    (over its limits, say) stops here with the server's answer rather than as a table of errors."""
    import grpc

    from ..serving.client import describe_error

    stubs = {"Score": (client.stub.Score, client.pb2.ScoreRequest),
             "BeamSearch": (client.stub.BeamSearch, client.pb2.BeamSearchRequest)}
    for method in sorted({e.method for e in pool.entries}):
        entry = next(e for e in pool.entries if e.method == method)
        call, message = stubs[method]
        try:
            call(message.FromString(entry.payload), timeout=client.timeout_s)
        except grpc.RpcError as e:
            raise ValueError(f"the server refused the workload's first {method} request: {describe_error(e)}") from None


def run(args: argparse.Namespace, stdout: Any = None) -> dict[str, Any]:
    """The whole command: ModelInfo, the pool, the probe, the sweep, the report. The result's dict."""
    import asyncio

    import grpc
    import uvloop
    from google.protobuf.json_format import MessageToDict

    from ..serving.client import RankerClient, describe_error
    from . import report
    from .loop import MAX_ERROR_SHARE, Pool, Progress, capacity, sweep, within_slo
    from .workloads import ID_HIGH, Requests, file_requests, parse_workload

    out_stream = stdout or sys.stdout
    check(args)
    with RankerClient(args.target, timeout_s=args.rpc_timeout_s, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                      tls_key=args.tls_key, tls_server_name=args.tls_server_name) as client:
        try:
            info = client.model_info()
        except grpc.RpcError as e:
            raise ValueError(f"--target {args.target}: ModelInfo failed: {describe_error(e)}") from None
        cfg, shape_from = served_config(info, args.model)
        if args.requests:
            w: dict[str, Any] = {"kind": "file", "name": Path(args.requests).name, "path": str(args.requests)}
            messages = file_requests(args.requests)
        else:
            w = parse_workload(args.workload or "W1")
            if info.num_labels > 0 and w["kind"] in ("score", "mix"):
                w["labels"] = 0  # a classification head scores its own labels: no label ids
            reqs = Requests(w, min(ID_HIGH, info.vocab_size), seed=args.seed, limits=info.limits)
            messages = [reqs.next() for _ in range(args.pool)]
        pool = Pool(messages, cfg, args.priority, codes={c.name: c.num_codes for c in info.catalogs})
        _probe(client, pool)
    mode = "closed" if args.level_list is not None else "open"
    loads = args.level_list if mode == "closed" else args.rate_list
    if not args.quiet:
        print(f"slmrank bench: {w['name']} on {args.target} ({info.model}, {info.runtime} runtime on {info.device}, "
              f"{info.compute_dtype}); {mode} loop over {args.connections} connection(s), {args.warmup_s:g} s warm-up "
              f"+ {args.measure_s:g} s a level", file=out_stream, flush=True)

    def on_level(row: dict[str, Any]) -> None:
        row["within_slo"] = within_slo(row, args.slo_mean_ms, args.slo_p99_ms, MAX_ERROR_SHARE)
        if not args.quiet:
            print(f"  {report.load_of(row):>8s}: {row['qps']:9.1f} req/s  mean {row['mean_ms']:8.2f} ms  "
                  f"p50 {row['p50_ms']:8.2f}  p90 {row['p90_ms']:8.2f}  p99 {row['p99_ms']:8.2f}  "
                  f"errors {row['errors'] or 0}", file=out_stream, flush=True)

    t0 = time.perf_counter()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        swept = runner.run(sweep(
            args.target, pool, levels=args.level_list, rates=args.rate_list, warmup_s=args.warmup_s,
            measure_s=args.measure_s, rpc_timeout_s=args.rpc_timeout_s, connections=args.connections,
            stop_above_ms=args.stop_above_ms, seed=args.seed, metrics_url=args.metrics,
            credentials=_credentials(args), server_name=args.tls_server_name,
            progress=None if args.quiet else Progress(), on_level=on_level, refine=args.refine,
            holds=lambda row: within_slo(row, args.slo_mean_ms, args.slo_p99_ms, MAX_ERROR_SHARE)))
    cap = capacity(swept["levels"], args.slo_mean_ms, args.slo_p99_ms)
    peak = args.peak_tflops * 1e12
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["slmrank", *sys.argv[1:]]),
        "target": args.target, "server": MessageToDict(info, preserving_proto_field_name=True),
        "workload": w, "pool": pool.describe(), "mode": mode, "loads": loads, "connections": args.connections,
        "priority": args.priority, "warmup_s": args.warmup_s, "measure_s": args.measure_s, "seed": args.seed,
        "refine": args.refine,
        "slo": {"mean_ms": args.slo_mean_ms, "p99_ms": args.slo_p99_ms, "max_error_share": MAX_ERROR_SHARE},
        "model_shape": shape_from, "peak_flops": peak, "stop_above_ms": args.stop_above_ms,
        **swept, "capacity": cap,
        "eff_mfu": cap["flops_per_s"] / peak if cap and cap.get("flops_per_s") is not None else None,
        "wall_s": round(time.perf_counter() - t0, 2)}
    written = report.write(Path(args.out), result)
    print(report.table(result), file=out_stream)
    if not args.quiet:
        print(f"model shape for the FLOPs: {shape_from}", file=out_stream)
        print("wrote " + ", ".join(map(str, written)), file=out_stream, flush=True)
    return result


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
