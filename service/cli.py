"""The `slmrank` command line: build an artifact, run request files through a runtime, serve, evaluate a candidate."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

# torch (behind .artifact) is imported only by the commands that run a model: `slmrank client`
# and `slmrank trace` start in a fraction of a second.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# ServingLimits fields settable at `slmrank build` (the defaults cover BENCHMARKS.md's W1-W6)
LIMIT_FLAGS = {"max_prompt_tokens": "BeamSearch prompt tokens (1024)", "max_beam_width": "beam width (400)",
               "max_new_tokens": "BeamSearch new tokens (5)", "max_samples": "Score samples a request (64)",
               "max_score_tokens": "Score prefix + sample tokens a request (2048)",
               "max_labels": "label ids a Score request (16)"}


def _cmd_build(args: argparse.Namespace) -> int:
    from .artifact.artifact import build_artifact, load_artifact
    from .model.fp8_policy import fp8_text, parse_fp8_policy

    limits = {name: getattr(args, name) for name in LIMIT_FLAGS if getattr(args, name) is not None}
    if args.traffic is None and (args.max_graphs or args.max_activation_mib):
        raise ValueError("--max-graphs and --max-activation-mib bound a table chosen with --traffic LOG")
    table, origin = _traffic_table(args, limits) if args.traffic is not None else (None, None)
    auto = args.fp8 == "auto"
    fp8, floors = parse_fp8_policy("none" if auto else args.fp8)
    out = build_artifact(args.model, args.out, dtype=args.dtype, quiet=args.quiet, limit_overrides=limits,
                         buckets=table, bucket_origin=origin, catalogs=_catalog_files(args.catalog), fp8=fp8,
                         fp8_min_rows=floors, fp8_auto=auto)
    art = load_artifact(out)
    if "fp8_measured" in art.manifest["weights"]:
        from .artifact.fp8_measure import format_table

        print(format_table(art.manifest["weights"]["fp8_measured"], art.fp8, art.fp8_min_rows))
    fp8_note = f" (fp8 e4m3: {fp8_text(art.fp8, art.fp8_min_rows)})" if art.fp8 else ""
    print(f"built {out}: {art.config.arch}, {art.config.num_layers} layers, weights {art.manifest['weights']['dtype']}"
          f"{fp8_note}, "
          f"{len(art.buckets.score)} score + {len(art.buckets.beam)} beam buckets; limits {art.limits.to_dict()}")
    for entry in art.manifest["catalogs"]:
        print(f"catalog {entry['name']}: {entry['num_items']:,} items of {entry['code_length']} tokens, "
              f"version {entry['version']}")
    return 0


def _catalog_files(specs: list[str] | None) -> dict[str, str]:
    """--catalog NAME=FILE (repeatable) -> {NAME: FILE}."""
    files: dict[str, str] = {}
    for spec in specs or []:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise ValueError(f"--catalog {spec!r}: expected NAME=FILE")
        if name in files:
            raise ValueError(f"--catalog {name}: given twice")
        files[name] = file
    return files


def _traffic_table(args: argparse.Namespace, limit_overrides: dict[str, int]):
    """`build --traffic LOG`: the bucket table chosen for the log within the budgets, printed."""
    from .artifact.buckets import default_bucket_table
    from .loadgen.tiers import Budget, choose_from_log, default_budget, format_choice
    from .model.checkpoint import weight_source
    from .model.config import ServingLimits

    cfg, _, _ = weight_source(args.model)
    limits = ServingLimits.for_model(cfg, **limit_overrides)
    default = default_budget(default_bucket_table(limits), cfg, limits)
    budget = Budget(args.max_graphs or default.max_graphs,
                    int(args.max_activation_mib * 2**20) if args.max_activation_mib else default.max_activation_bytes)
    table, origin = choose_from_log(args.traffic, cfg, limits, budget, quiet=args.quiet)
    print(format_choice(origin))
    return table, origin


def _cmd_run(args: argparse.Namespace) -> int:
    from .artifact.resolve import resolve_artifact
    from .runtime.engine import execute
    from .runtime.factory import make_runtime
    from .runtime.jsonl import artifact_labels, format_result, read_request_file
    from .runtime.placement import resolve_placement
    from .runtime.requests import ExecutionError, RequestError
    from .serving.settings import RUN_SETTINGS, resolve

    values = resolve(RUN_SETTINGS, args)
    placement = resolve_placement(values["runtime"], values["device"], values["dtype"])
    artifact = resolve_artifact(values["model"], quiet=args.quiet)
    runtime = make_runtime(placement.runtime, artifact, placement.device, placement.dtype, values["kernels"])
    lines = read_request_file(args.requests, artifact_labels(artifact))
    ids = [rid for rid, _ in lines]
    parsed: list = [req for _, req in lines]
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
    from .observe.logs import announce, configure_logging
    from .runtime.placement import resolve_placement
    from .serving.server import load_model, serve
    from .serving.settings import SERVE_SETTINGS, resolve

    # every mistake that can be seen before binding is a ValueError here: one line from main(), exit 2
    defaulted: set[str] = set()
    values = resolve(SERVE_SETTINGS, args, defaulted=defaulted)
    unused_lanes = lanes_and_slots(values, defaulted)
    config = _server_config(values)
    placement = resolve_placement(values["runtime"], values["device"], values["dtype"])
    if placement.runtime != "cpp" and values["beam_graphs"] != "bucket":
        raise ValueError(f"--beam-graphs {values['beam_graphs']}: a C++ runtime setting; this server runs the "
                         f"{placement.runtime} runtime (--runtime cpp)")
    configure_logging("warning" if args.quiet else values["log_level"], values["log_format"])
    if unused_lanes:
        logging.getLogger("slmrank.server").warning("%s", unused_lanes)
    from .artifact.resolve import check_model
    check_model(values["model"])  # a bad --model fails here, before the port is bound and "listening" said
    host = values["host"]
    target_host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]", "") else host

    def on_ready(server) -> None:
        target = f"{target_host}:{server.port}"
        tok, vocab = server.model.tokenizer, server.model.artifact.config.vocab_size
        # the labels of the example (a relevance question): " yes" and " no" as texts where each is one
        # token of this tokenizer, else the ids of their first tokens
        words = (" yes", " no")
        encoded = [tok.encode(w) for w in words]
        if all(len(ids) == 1 and ids[0] < vocab for ids in encoded):
            labels = "--label-texts " + " ".join(f"'{w}'" for w in words)
        else:
            labels = "--labels " + (" ".join(str(ids[0]) for ids in encoded if ids and ids[0] < vocab) or "0 1")
        tls = " --tls-ca CA.pem" if config.tls_cert else ""
        announce(f"serving {values['model']} ({placement.describe()}) on {target}; send a request with:")
        announce(f"  slmrank client score --target {target}{tls} --prefix 'Query: running shoes. Relevant?' "
                 f"--samples ' Trail runner' ' Garden hose' {labels}")
        announce(f"  slmrank client beam --target {target}{tls} --prompt 'The best running shoes are' "
                 "--beam-width 4 --new-tokens 3")

    def loader():
        return load_model(values["model"], placement.runtime, placement.device, placement.dtype,
                          kernels=values["kernels"], quiet=args.quiet, capture_graphs=values["capture_graphs"] != "lazy",
                          capture_lanes_at_once=values["capture_graphs"] == "parallel", num_lanes=values["lanes"],
                          beam_graphs=values["beam_graphs"],
                          catalog_headroom=config.catalog_headroom if config.catalog_dir else 1.0)

    return serve(config, loader, announce, on_ready)


def lanes_and_slots(values: dict, defaulted: set[str]) -> str:
    """Ties the batcher's in-flight slots to the lanes: with --lanes N above the slots' default (2)
    and --batcher-max-inflight not given, the slots become N (a lane no batch can be handed to would
    only hold device memory). Returns a warning when slots were given below the lanes, else "".
    ValueError: lanes < 0."""
    lanes = values["lanes"]
    if lanes < 0:
        raise ValueError(f"--lanes: must be >= 0 (0: the runtime's default), got {lanes}")
    if "batcher_max_inflight" in defaulted:
        values["batcher_max_inflight"] = max(values["batcher_max_inflight"], lanes)
        return ""
    if lanes > values["batcher_max_inflight"]:
        return (f"--lanes {lanes} with --batcher-max-inflight {values['batcher_max_inflight']}: at most "
                f"{values['batcher_max_inflight']} batches are handed to the runtime at once, so "
                f"{lanes - values['batcher_max_inflight']} lane(s) only hold device memory")
    return ""


def _server_config(values: dict):
    """ServerConfig from the resolved settings; the tracing settings are checked here too, so that
    a mistake is a usage error before the model loads (ValueError: exit 2)."""
    import importlib

    from .observe.tracing import OTLP_PACKAGES
    from .sched.admission import AdmissionConfig
    from .sched.batcher import BatcherConfig
    from .serving.server import ServerConfig
    from .serving.settings import section

    # the public settings only; every other field keeps its config dataclass's default (resolve()
    # has refused an SLMRANK_TRACE_* variable that is no setting, so TracingConfig.from_env reads none)
    config = ServerConfig(
        host=values["host"], port=values["port"], grace_s=values["grace_s"], fronts=values["fronts"],
        send_timeout_s=values["send_timeout_s"], catalog_dir=values["catalog_dir"],
        catalog_headroom=values["catalog_headroom"],
        health_port=values["health_port"],
        tls_cert=values["tls_cert"], tls_key=values["tls_key"], tls_client_ca=values["tls_client_ca"],
        admission=AdmissionConfig(**section(values, "admission_")),
        batcher=BatcherConfig(**section(values, "batcher_"), validate_requests=False),
        metrics_host=values["metrics_host"], metrics_port=values["metrics_port"], trace_port=values["trace_port"],
        trace_sample_rate=values["trace_sample_rate"], trace_slow_ms=values["trace_slow_ms"],
        otlp_endpoint=values["otlp_endpoint"], trace_file=values["trace_file"], access_log=values["access_log"])
    tracing = config.tracing()  # ValueError: a value out of range
    if tracing.otlp_endpoint:
        module, package = OTLP_PACKAGES[tracing.otlp_protocol]
        try:
            importlib.import_module(module)
        except ImportError:
            message = (f"OTLP export to {tracing.otlp_endpoint} ({tracing.otlp_protocol}) needs the Python package "
                       f"{package}, which is not installed: pip install {package}")
            if values["otlp_endpoint"]:  # asked for here: a usage error
                raise ValueError(message) from None
            # only the standard OTEL_* environment asks (the OpenTelemetry Operator injects it): serve anyway
            logging.getLogger("slmrank.tracing").warning("%s; serving without span export", message)
            config = dataclasses.replace(config, otlp_endpoint="")
    if config.trace_file is not None:
        parent = Path(config.trace_file).resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--trace-file: the directory {parent} does not exist")
    return config


def _cmd_client(args: argparse.Namespace) -> int:
    import json

    import grpc

    from .serving.client import RankerClient, describe_error, info_summary, parse_ids, to_json

    with RankerClient(args.target, timeout_s=args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                      tls_key=args.tls_key, tls_server_name=args.tls_server_name) as client:
        try:
            if args.kind == "info":
                response = client.model_info()
            elif args.kind == "tokenize":
                response = client.tokenize(args.text or "", parse_ids(args.ids) if args.ids is not None else ())
            elif args.kind == "score":
                samples = args.samples or [parse_ids(s) for s in args.sample_ids]
                prefix = parse_ids(args.prefix_ids) if args.prefix_ids is not None else args.prefix
                response = client.score(samples, args.labels, prefix, args.priority, label_texts=args.label_texts)
            elif args.kind == "replace-catalog":
                response = client.replace_catalog(args.name, args.file)
            else:
                prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
                response = client.beam(prompt, args.beam_width, args.new_tokens, args.priority, catalog=args.catalog,
                                       normalization=args.normalization)
        except grpc.RpcError as e:
            print(f"slmrank client: {describe_error(e)}", file=sys.stderr)
            return 1
    if args.kind == "info" and not args.json:
        print(info_summary(response))
        return 0
    print(json.dumps(to_json(response), ensure_ascii=False))
    return 0


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """The settings' flags, only for the command that runs: the registry imports torch (through
    the batcher), and `slmrank client` / `slmrank trace` start in a fraction of a second."""
    if parser.prog.split()[-1] != command:
        return
    from .serving.settings import RUN_SETTINGS, SERVE_SETTINGS, add_arguments

    add_arguments(parser, SERVE_SETTINGS if command == "serve" else RUN_SETTINGS)


def _add_serve_parsers(sub: argparse._SubParsersAction, command: str) -> None:
    s = sub.add_parser("serve", help="serve Score / BeamSearch over gRPC (health, reflection, graceful drain)",
                       description="Every setting below is also an SLMRANK_* environment variable and a key of the "
                                   "--config file; a flag wins over the variable, the variable over the file.")
    _add_settings(s, command)
    s.add_argument("--quiet", action="store_true", help="no progress bars; log warnings and errors only")
    s.set_defaults(func=_cmd_serve)

    c = sub.add_parser("client", help="send one Score or BeamSearch request to a server; prints JSON")
    kinds = c.add_subparsers(dest="kind", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    common.add_argument("--priority", default="unspecified", choices=["unspecified", "online", "normal", "background"])
    common.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    from .serving.client_flags import add_tls_arguments
    add_tls_arguments(common)
    info = kinds.add_parser("info", parents=[common], help="ModelInfo: the model, artifact sha256, runtime, limits, buckets")
    info.add_argument("--json", action="store_true", help="all of ModelInfo as JSON (every bucket) instead of a summary")
    sc = kinds.add_parser("score", parents=[common], help="Score: label log-probs per sample")
    samples = sc.add_mutually_exclusive_group(required=True)
    samples.add_argument("--samples", nargs="+", metavar="TEXT")
    samples.add_argument("--sample-ids", nargs="+", metavar="IDS", help="one '1,2,3' list per sample")
    prefix = sc.add_mutually_exclusive_group()
    prefix.add_argument("--prefix", metavar="TEXT")
    prefix.add_argument("--prefix-ids", metavar="IDS")
    labels = sc.add_mutually_exclusive_group()
    labels.add_argument("--labels", nargs="*", type=int, default=[], metavar="ID", help="label token ids")
    labels.add_argument("--label-texts", nargs="+", default=[], metavar="TEXT",
                        help="the labels as texts of one token each, e.g. ' yes' ' no' (instead of --labels)")
    bm = kinds.add_parser("beam", parents=[common], help="BeamSearch: best sequences of new tokens")
    prompt = bm.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-ids", metavar="IDS")
    bm.add_argument("--beam-width", type=int, required=True)
    bm.add_argument("--new-tokens", type=int, required=True)
    bm.add_argument("--catalog", default="", metavar="NAME", help="only items of this catalog (ModelInfo lists them)")
    bm.add_argument("--normalization", default="vocab", choices=["vocab", "codes"],
                    help="with --catalog: log-probs over the whole vocabulary (default), or over the catalog's code "
                         "tokens only")
    rc = kinds.add_parser("replace-catalog", parents=[common],
                          help="Admin.ReplaceCatalog: swap a catalog of the server's for a file under its "
                               "--catalog-dir, while it serves")
    rc.add_argument("--name", required=True, help="the catalog (ModelInfo lists them)")
    rc.add_argument("--file", required=True, help="a catalog file, as a path relative to the server's --catalog-dir")
    tk = kinds.add_parser("tokenize", parents=[common], help="Tokenize: text -> ids, or ids -> text, with the "
                                                             "server's tokenizer")
    what = tk.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="TEXT")
    what.add_argument("--ids", metavar="IDS", help="'1,2,3'")
    c.set_defaults(func=_cmd_client)


def _cmd_trace(args: argparse.Namespace) -> int:
    from .observe.trace_report import report

    print(report(args.file))
    return 0


def _add_trace_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("trace", help="latency breakdown of a Chrome trace file written by the server: where the time went")
    t.add_argument("file", help="a Chrome/Perfetto trace JSON (the server's /trace, or ChromeTraceWriter.write)")
    t.set_defaults(func=_cmd_trace)


def _cmd_traffic(args: argparse.Namespace) -> int:
    from .loadgen.traffic import main as traffic_main  # numpy; torch only for the padding

    return traffic_main(args)


def _add_traffic_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("traffic", help="the request distribution of a server's JSON access log: shapes, arrivals "
                                       "over time, in flight, the padding of bucket tables")
    t.add_argument("log", help="the server's log (serve --access-log --log-format json): one JSON object a line")
    t.add_argument("--png", metavar="OUT.png", help="write arrivals per second over time as a PNG chart")
    t.add_argument("--json", metavar="OUT.json", help="write the whole report (per-second counts, every malformed "
                                                      "line) as JSON")
    t.add_argument("--bucket-table", nargs="+", action="extend", metavar="ARTIFACT_DIR_OR_MODEL",
                   help="the padding of these tables: a built artifact's own, or the default table of a model "
                        "(embedded:NAME, a checkpoint directory); default: the default table of the limits in the "
                        "log's 'model loaded' record")
    t.set_defaults(func=_cmd_traffic)


def _version() -> str:
    """The installed package's version, from its metadata (not the artifact format's: reading it
    imports torch, seconds for a flag that should answer at once)."""
    from importlib import metadata

    try:
        return metadata.version("slmrank")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown (not installed: run ops/setup)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    p = argparse.ArgumentParser(prog="slmrank", description="Bounded Score / BeamSearch serving for small Qwen models.")
    p.add_argument("--version", action="version", version=f"slmrank {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build a deployment artifact from an embedded spec or a local HF checkpoint")
    b.add_argument("--model", required=True, help="embedded:tiny | embedded:qwen2.5-0.5b | embedded:qwen3-0.6b | "
                                                  "embedded:qwen3-1.7b | a local HF checkpoint directory")
    b.add_argument("--out", required=True, help="artifact directory to write")
    b.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="weight dtype (auto: the source's)")
    for name, what in LIMIT_FLAGS.items():
        b.add_argument("--" + name.replace("_", "-"), type=int, default=None, metavar="N",
                       help=f"serving limit: {what} (default: the model's, see the manifest)")
    b.add_argument("--traffic", metavar="LOG", help="choose the bucket tiers that pad this access log's requests "
                                                    "least (serve --access-log --log-format json; see `slmrank "
                                                    "traffic`), within --max-graphs and --max-activation-mib")
    b.add_argument("--max-graphs", type=int, metavar="N", help="with --traffic: at most N buckets, a CUDA graph each "
                                                               "(default: the default table's count)")
    b.add_argument("--max-activation-mib", type=float, metavar="MIB", help="with --traffic: the activation memory of "
                                                                          "any one bucket (default: the default table's "
                                                                          "largest)")
    b.add_argument("--catalog", action="append", metavar="NAME=FILE",
                   help="a catalog for constrained BeamSearch (repeatable): FILE has one item a line, "
                        "item_id<TAB>tok tok tok (token ids, one code length per catalog)")
    b.add_argument("--fp8", default="none", metavar="PARTS",
                   help="linear layers stored as float8_e4m3fn with per-output-channel scales, activations "
                        "quantized per token at run time: none (default) | mlp | mlp,attn | mlp,attn,head; "
                        "PART:ROWS keeps that part in the model dtype too and runs a GEMM of fewer activation "
                        "rows on it, e.g. mlp:2048,attn:2048; auto: times every part at the buckets' rows on this "
                        "machine's GPU and chooses (docs/operations.md, FP8 linear layers)")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=_cmd_build)

    r = sub.add_parser("run", help="run a JSONL request file through a runtime",
                       description="The model settings are also SLMRANK_* environment variables and keys of the "
                                   "--config file (as for `slmrank serve`).")
    r.add_argument("--requests", required=True, help="input JSONL, one request per line")
    r.add_argument("--out", required=True, help="output JSONL, one result per line, in input order")
    _add_settings(r, command)
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=_cmd_run)
    _add_serve_parsers(sub, command)
    _add_trace_parser(sub)
    from .loadgen.command import add_bench_parser  # its flags only: grpc loads when `slmrank bench` runs

    add_bench_parser(sub)
    _add_traffic_parser(sub)
    from .evaluate.command import add_evaluate_parser  # its flags only: torch loads when `slmrank evaluate` runs

    add_evaluate_parser(sub)

    args, extra = p.parse_known_args(argv)
    if extra:  # as parse_args would, but in one line where the command's own usage errors are one line
        message = f"unrecognized arguments: {' '.join(extra)}"
        if args.cmd == "evaluate":
            print(f"slmrank evaluate: error: {message} (see --help)", file=sys.stderr)
            return 2
        p.error(message)
    from .runtime.requests import BindError

    try:
        return args.func(args)
    # every start-up mistake is one line and exit 2: ArtifactError, ConfigError, RequestError, SettingsError,
    # PlacementError and the TLS checks are ValueErrors; a missing or unreadable file an OSError
    except (OSError, ValueError, BindError) as e:
        print(f"slmrank {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
