"""The `slmrank` command line: build an artifact, run request files through a runtime."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# torch (behind .artifact) is imported only by the commands that run a model: `slmrank client`
# and `slmrank trace` start in a fraction of a second.
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _cmd_build(args: argparse.Namespace) -> int:
    from .artifact.artifact import build_artifact, load_artifact

    out = build_artifact(args.model, args.out, dtype=args.dtype, quiet=args.quiet)
    art = load_artifact(out)
    print(f"built {out}: {art.config.arch}, {art.config.num_layers} layers, weights {art.manifest['weights']['dtype']}, "
          f"{len(art.buckets.score)} score + {len(art.buckets.beam)} beam buckets")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .artifact.resolve import resolve_artifact
    from .runtime.engine import execute
    from .runtime.factory import make_runtime
    from .runtime.jsonl import format_result, parse_request
    from .runtime.requests import ExecutionError, RequestError

    artifact = resolve_artifact(args.model, quiet=args.quiet)
    runtime = make_runtime(args.runtime, artifact, args.device, args.dtype, args.kernels)
    # split on "\n" only: U+2028 and friends are legal inside JSON strings
    text = Path(args.requests).read_text(encoding="utf-8")
    lines = [(n, ln) for n, ln in enumerate(text.split("\n"), 1) if ln.strip()]
    parsed: list = []
    ids: list = []
    for n, ln in lines:
        try:
            req = parse_request(ln)
            parsed.append(req)
            ids.append(req.id)
        except RequestError as e:
            if e.field == "line":  # say which line when there is no id to go by
                e = RequestError(f"line {n}", str(e).removeprefix("line: "))
            parsed.append(e)
            ids.append(getattr(e, "request_id", None))
    runnable = [(i, r) for i, r in enumerate(parsed) if not isinstance(r, RequestError)]
    t0 = time.monotonic()
    results = execute(artifact, runtime, [r for _, r in runnable])
    elapsed = time.monotonic() - t0
    for (i, _), res in zip(runnable, results):
        parsed[i] = res
    with open(args.out, "w", encoding="utf-8") as fh:
        for rid, res in zip(ids, parsed):
            fh.write(format_result(rid, res) + "\n")
    num_errors = sum(isinstance(r, (RequestError, ExecutionError)) for r in parsed)
    if not args.quiet:
        print(f"[slmrank] {len(parsed)} requests ({num_errors} errors) through the {runtime.name} runtime "
              f"in {elapsed:.2f} s -> {args.out}", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from .serving.server import ServerConfig, load_model, serve

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="[slmrank] %(message)s")
    config = ServerConfig(host=args.host, port=args.port, grace_s=args.grace_s, metrics_port=args.metrics_port,
                          trace_sample_rate=args.trace_sample_rate, trace_slow_ms=args.trace_slow_ms,
                          otlp_endpoint=args.otlp_endpoint, trace_file=args.trace_file)
    _check_tracing(config)
    target_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "[::]", "") else args.host

    def announce(line: str) -> None:
        print(f"[slmrank] {line}", flush=True)

    def on_ready(server) -> None:
        target = f"{target_host}:{server.port}"
        tok, vocab = server.model.tokenizer, server.model.artifact.config.vocab_size
        labels = [i for w in (" yes", " no") for i in tok.encode(w)[:1] if i < vocab] or [0, 1]
        announce(f"serving {args.model} ({args.runtime} runtime, {args.device}) on {target}; send a request with:")
        announce(f"  slmrank client score --target {target} --prefix 'Query: running shoes. Relevant?' "
                 f"--samples ' Trail runner' ' Garden hose' --labels {' '.join(map(str, labels))}")
        announce(f"  slmrank client beam --target {target} --prompt 'The best running shoes are' "
                 "--beam-width 4 --new-tokens 3")

    def loader():
        return load_model(args.model, args.runtime, args.device, args.dtype, kernels=args.kernels, quiet=args.quiet,
                          capture_graphs=args.capture_graphs == "all")

    return serve(config, loader, announce, on_ready)


def _check_tracing(config) -> None:
    """Bad tracing settings (flags or environment) fail before the model loads, as a usage error."""
    import importlib

    from .observe.tracing import OTLP_PACKAGES

    tracing = config.tracing()  # ValueError: a value out of range
    if tracing.otlp_endpoint:
        module, package = OTLP_PACKAGES[tracing.otlp_protocol]
        try:
            importlib.import_module(module)
        except ImportError:
            raise ValueError(f"OTLP export to {tracing.otlp_endpoint} ({tracing.otlp_protocol}) needs the Python "
                             f"package {package}, which is not installed: pip install {package}") from None
    if config.trace_file is not None:
        parent = Path(config.trace_file).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--trace-file: the directory {parent} does not exist")


def _cmd_client(args: argparse.Namespace) -> int:
    import json

    import grpc

    from .serving.client import RankerClient, describe_error, parse_ids, to_json

    with RankerClient(args.target, timeout_s=args.timeout) as client:
        try:
            if args.kind == "score":
                samples = args.samples or [parse_ids(s) for s in args.sample_ids]
                prefix = parse_ids(args.prefix_ids) if args.prefix_ids is not None else args.prefix
                response = client.score(samples, args.labels, prefix, args.priority)
            else:
                prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
                response = client.beam(prompt, args.beam_width, args.new_tokens, args.priority)
        except grpc.RpcError as e:
            print(f"slmrank client: {describe_error(e)}", file=sys.stderr)
            return 1
    print(json.dumps(to_json(response), ensure_ascii=False))
    return 0


def _add_serve_parsers(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="serve Score / BeamSearch over gRPC (health, reflection, graceful drain)")
    s.add_argument("--model", required=True, help="an artifact directory, an embedded spec or a checkpoint directory")
    s.add_argument("--port", type=int, default=50051, help="0: any free port (the bound one is printed)")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--runtime", default="python", choices=["python", "cpp"])
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--dtype", default=None, choices=list(DTYPE_NAMES), help="compute dtype (default: the weights')")
    s.add_argument("--kernels", default="aten", choices=["aten", "triton"],
                   help="decoder-layer kernels: aten (default) or the fused Triton kernels (CUDA)")
    s.add_argument("--capture-graphs", default="all", choices=["all", "lazy"],
                   help="C++ runtime on a GPU: capture every bucket's CUDA graph before SERVING (all), "
                        "or each one at its first batch (lazy: faster start, slower first requests)")
    s.add_argument("--grace-s", type=float, default=20.0,
                   help="SIGTERM/SIGINT: finish in-flight requests for at most this long, then exit")
    o = s.add_argument_group("observability", "tracing flags override SLMRANK_TRACE_SAMPLE_RATE, "
                             "SLMRANK_TRACE_SLOW_MS and OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT")
    o.add_argument("--metrics-port", type=int, default=None,
                   help="serve GET /metrics (Prometheus) and GET /trace (Chrome trace) on this port; "
                        "0: any free port (printed); default: not served")
    o.add_argument("--trace-sample-rate", type=float, default=None,
                   help="share of the requests that are not slow whose trace is kept (default 0.01)")
    o.add_argument("--trace-slow-ms", type=float, default=None,
                   help="a request at least this long is always traced (default 20; 0: every request)")
    o.add_argument("--otlp-endpoint", default=None,
                   help="export the kept traces as OpenTelemetry spans over OTLP to this endpoint")
    o.add_argument("--trace-file", default=None,
                   help="write the Chrome/Perfetto trace of the kept requests here when the server stops "
                        "(read it with `slmrank trace FILE`)")
    s.add_argument("--quiet", action="store_true")
    s.set_defaults(func=_cmd_serve)

    c = sub.add_parser("client", help="send one Score or BeamSearch request to a server; prints JSON")
    kinds = c.add_subparsers(dest="kind", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    common.add_argument("--priority", default="unspecified", choices=["unspecified", "online", "normal", "background"])
    common.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    sc = kinds.add_parser("score", parents=[common], help="Score: label log-probs per sample")
    samples = sc.add_mutually_exclusive_group(required=True)
    samples.add_argument("--samples", nargs="+", metavar="TEXT")
    samples.add_argument("--sample-ids", nargs="+", metavar="IDS", help="one '1,2,3' list per sample")
    prefix = sc.add_mutually_exclusive_group()
    prefix.add_argument("--prefix", metavar="TEXT")
    prefix.add_argument("--prefix-ids", metavar="IDS")
    sc.add_argument("--labels", nargs="*", type=int, default=[], metavar="ID", help="label token ids")
    bm = kinds.add_parser("beam", parents=[common], help="BeamSearch: best sequences of new tokens")
    prompt = bm.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-ids", metavar="IDS")
    bm.add_argument("--beam-width", type=int, required=True)
    bm.add_argument("--new-tokens", type=int, required=True)
    c.set_defaults(func=_cmd_client)


def _cmd_trace(args: argparse.Namespace) -> int:
    from .observe.trace_report import report

    print(report(args.file))
    return 0


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("trace", help="latency breakdown of a Chrome trace file written by the server: where the time went")
    t.add_argument("file", help="a Chrome/Perfetto trace JSON (the server's /trace, or ChromeTraceWriter.write)")
    t.set_defaults(func=_cmd_trace)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slmrank", description="Bounded Score / BeamSearch serving for small Qwen models.")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build a deployment artifact from an embedded spec or a local HF checkpoint")
    b.add_argument("--model", required=True, help="embedded:tiny | embedded:qwen2.5-0.5b | embedded:qwen3-0.6b | "
                                                  "embedded:qwen3-1.7b | a local HF checkpoint directory")
    b.add_argument("--out", required=True, help="artifact directory to write")
    b.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="weight dtype (auto: the source's)")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=_cmd_build)

    r = sub.add_parser("run", help="run a JSONL request file through a runtime")
    r.add_argument("--model", required=True, help="an artifact directory, an embedded spec or a checkpoint directory")
    r.add_argument("--runtime", default="python", choices=["python", "cpp"],
                   help="python: the reference, node by node; cpp: the C++ DAG executor (CUDA graphs on a GPU)")
    r.add_argument("--requests", required=True, help="input JSONL, one request per line")
    r.add_argument("--out", required=True, help="output JSONL, one result per line, in input order")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--dtype", default=None, choices=list(DTYPE_NAMES), help="compute dtype (default: the weights')")
    r.add_argument("--kernels", default="aten", choices=["aten", "triton"],
                   help="decoder-layer kernels: aten (default) or the fused Triton kernels (CUDA)")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=_cmd_run)
    _add_serve_parsers(sub)
    _add_trace_parser(sub)

    args = p.parse_args(argv)
    from .runtime.requests import BindError

    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, BindError) as e:  # ArtifactError, ConfigError, RequestError: ValueErrors
        print(f"slmrank {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
