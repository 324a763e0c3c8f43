"""The `slmrank` command line: build an artifact, run request files through a runtime."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

from .artifact import DTYPES, MANIFEST, Artifact, ArtifactError, build_artifact, load_artifact
from .config import ConfigError


def cache_dir() -> Path:
    return Path(os.environ.get("SLMRANK_CACHE", Path.home() / ".cache" / "slmrank"))


def _checkpoint_fingerprint(ckpt: Path) -> str:
    """Path plus every file's name, size and mtime: a changed checkpoint gets a fresh artifact."""
    parts = [str(ckpt.resolve())]
    if ckpt.is_dir():
        for f in sorted(ckpt.iterdir()):
            if f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def resolve_artifact(model: str, quiet: bool = False) -> Artifact:
    """An artifact directory as it is; an embedded spec or a checkpoint is built once into the cache."""
    path = Path(model)
    if path.is_dir() and (path / MANIFEST).exists():
        return load_artifact(path)
    key = model if model.startswith("embedded:") else _checkpoint_fingerprint(path)
    out = cache_dir() / "artifacts" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (out / MANIFEST).exists():
        try:
            return load_artifact(out)
        except ArtifactError as e:
            print(f"[slmrank] rebuilding cached artifact {out}: {e}", file=sys.stderr)
    if not quiet:
        print(f"[slmrank] building artifact for {model} into {out}", file=sys.stderr)
    build_artifact(model, out, quiet=quiet)
    return load_artifact(out)


def _cmd_build(args: argparse.Namespace) -> int:
    out = build_artifact(args.model, args.out, dtype=args.dtype, quiet=args.quiet)
    art = load_artifact(out)
    print(f"built {out}: {art.config.arch}, {art.config.num_layers} layers, weights {art.manifest['weights']['dtype']}, "
          f"{len(art.buckets.score)} score + {len(art.buckets.beam)} beam buckets")
    return 0


def make_runtime(name: str, artifact: Artifact, device: str, dtype: str | None):
    torch_dtype = DTYPES[dtype] if dtype else None
    if name == "python":
        from .python_runtime import PythonRuntime

        return PythonRuntime(artifact, device=device, dtype=torch_dtype)
    if name == "cpp":
        from .cpp_runtime import CppRuntime

        return CppRuntime(artifact, device=device, dtype=torch_dtype)
    raise ValueError(f"--runtime: {name!r} is not one of python, cpp")


def _cmd_run(args: argparse.Namespace) -> int:
    from .engine import execute
    from .jsonl import format_result, parse_request
    from .requests import ExecutionError, RequestError

    artifact = resolve_artifact(args.model, quiet=args.quiet)
    runtime = make_runtime(args.runtime, artifact, args.device, args.dtype)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="slmrank", description="Bounded Score / BeamSearch serving for small Qwen models.")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="build a deployment artifact from an embedded spec or a local HF checkpoint")
    b.add_argument("--model", required=True, help="embedded:tiny | embedded:qwen2.5-0.5b | embedded:qwen3-0.6b | "
                                                  "embedded:qwen3-1.7b | a local HF checkpoint directory")
    b.add_argument("--out", required=True, help="artifact directory to write")
    b.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weight dtype (auto: the source's)")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=_cmd_build)

    r = sub.add_parser("run", help="run a JSONL request file through a runtime")
    r.add_argument("--model", required=True, help="an artifact directory, an embedded spec or a checkpoint directory")
    r.add_argument("--runtime", default="python", choices=["python", "cpp"],
                   help="python: the reference, node by node; cpp: the C++ DAG executor (CUDA graphs on a GPU)")
    r.add_argument("--requests", required=True, help="input JSONL, one request per line")
    r.add_argument("--out", required=True, help="output JSONL, one result per line, in input order")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (default: the weights')")
    r.add_argument("--quiet", action="store_true")
    r.set_defaults(func=_cmd_run)

    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ArtifactError, ConfigError, FileNotFoundError, ValueError) as e:
        print(f"slmrank {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
