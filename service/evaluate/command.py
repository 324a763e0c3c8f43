"""`slmrank evaluate --baseline A --candidate B --requests FILE`: accept or reject a candidate
artifact (another dtype, other kernels' weights, a quantized or damaged copy) against a baseline,
on one request set, against tolerances fixed before it runs (service/evaluate/tolerances.py).

Exit status: 0 every tolerance holds, 1 one or more is exceeded (the table names them), 2 a usage
error (one line: a bad flag or tolerance, an artifact that does not load, artifacts whose token
ids do not mean the same, a request file with nothing to compare). The result is recorded in the
candidate artifact (service/artifact/acceptance.py) unless --no-record.

This module only defines the flags when `slmrank` starts (no torch): the rest loads when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from .tolerances import TOLERANCES, check_limit, read_tolerance_file, resolve_limits

RANK_BY = ("auto", "first", "margin")  # metrics.RANK_BY (numpy: not imported at start-up)


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line and exit 2 (argparse's own prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evaluate", help="accept or reject a candidate artifact beside a baseline: one request set "
                                        "through both, metrics against tolerances, exit 1 when one is exceeded",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    e.__class__ = _OneLineParser  # argparse makes sub-parsers of the parent's class: only error() differs
    e.add_argument("--baseline", required=True, metavar="DIR", help="the artifact the candidate must agree with")
    e.add_argument("--candidate", required=True, metavar="DIR",
                   help="the artifact to accept; the result is recorded in it (acceptance.json)")
    e.add_argument("--requests", required=True, metavar="FILE",
                   help="a `slmrank run` JSONL request file (Score and BeamSearch lines)")
    e.add_argument("--tolerances", metavar="FILE", default=None,
                   help="a JSON object of tolerance names to limits, e.g. {\"max_abs_logprob\": 0.2}; a flag "
                        "below wins over the file")
    tol = e.add_argument_group("tolerances (the candidate against the baseline)")
    for t in TOLERANCES:
        tol.add_argument(t.flag, dest=t.name, type=float, default=None, metavar="X",
                         help=f"{t.what}: at {'most' if t.bound == 'max' else 'least'} X (default {t.default:g})")
    e.add_argument("--truth", choices=["none", "float64"], default="none",
                   help="float64: also run the baseline's weights in float64 (service/evaluate/truth.py) and "
                        "report each side's error against it (reported, not bound; default none)")
    e.add_argument("--rank-by", choices=RANK_BY, default="auto",
                   help="a sample's ranking score for the order metrics: first (the first label's log-prob), "
                        "margin (first minus second, e.g. ' yes' minus ' no'), auto (default: margin with two labels "
                        "or more)")
    e.add_argument("--runtime", default="auto", choices=["auto", "python", "cpp"],
                   help="as `slmrank run` (default auto: the C++ runtime when its extension is built)")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="default auto: cuda when visible")
    e.add_argument("--dtype", default="auto", choices=["auto", "weights", "float32", "bfloat16", "float16"],
                   help="compute dtype of both sides (default auto, as `slmrank serve`: bfloat16 on cuda, else each "
                        "artifact's weights dtype; weights: each artifact's own weights dtype on any device)")
    e.add_argument("--kernels", default="auto", choices=["auto", "aten", "triton"], help="default auto: triton on cuda")
    e.add_argument("--out", metavar="FILE", default=None,
                   help="the whole report as JSON, with every request's metrics")
    e.add_argument("--no-record", action="store_true", help="do not record the result in the candidate artifact")
    e.add_argument("--quiet", action="store_true", help="no progress on stderr")
    e.set_defaults(func=run)


def limits_of(args: argparse.Namespace) -> dict[str, float]:
    """Every tolerance's limit (flags over the file over the defaults); ValueError naming the flag."""
    file_limits = read_tolerance_file(args.tolerances) if args.tolerances else {}
    flags = {}
    for t in TOLERANCES:
        value = getattr(args, t.name)
        flags[t.name] = None if value is None else check_limit(t.name, value, t.flag)
    return resolve_limits(file_limits, flags)


def run(args: argparse.Namespace) -> int:
    limits = limits_of(args)  # every usage mistake before a model loads
    for flag, path in (("--baseline", args.baseline), ("--candidate", args.candidate)):
        if not Path(path).is_dir():
            raise ValueError(f"{flag} {path}: no such artifact directory")
    if not Path(args.requests).is_file():
        raise ValueError(f"--requests {args.requests}: no such file")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ValueError(f"--out {args.out}: the directory {Path(args.out).resolve().parent} does not exist")
    if Path(args.baseline).resolve() == Path(args.candidate).resolve() and not args.no_record:
        raise ValueError("--candidate is the --baseline: recording would change the baseline it names "
                         "(pass --no-record to compare a directory with itself)")

    from ..artifact.artifact import record_acceptance
    from ..artifact.acceptance import finite_json
    from ..runtime.factory import make_runtime
    from ..runtime.placement import resolve_placement
    from .compare import evaluate, format_table

    placement = resolve_placement(args.runtime, args.device, "auto" if args.dtype == "weights" else args.dtype)
    if args.dtype == "weights":
        placement = dataclasses.replace(placement, dtype=None)  # None: the weights' own dtype

    def runtime_for(artifact: Any):
        return make_runtime(placement.runtime, artifact, placement.device, placement.dtype, args.kernels)

    report = evaluate(args.baseline, args.candidate, args.requests, limits, make_runtime=runtime_for,
                      placement={"runtime": placement.runtime, "device": placement.device,
                                 "dtype": placement.dtype or "weights", "kernels": args.kernels},
                      truth=None if args.truth == "none" else args.truth, truth_device=placement.device,
                      rank_by=args.rank_by, quiet=args.quiet)
    if not args.no_record:
        record = {k: v for k, v in report.items() if k != "per_request"}
        report["recorded"] = {"file": str(Path(args.candidate) / "acceptance.json"),
                              "manifest_sha256": record_acceptance(args.candidate, record)}
    if args.out:
        Path(args.out).write_text(json.dumps(finite_json(report), indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                                  encoding="utf-8")
    print(format_table(report))
    if "recorded" in report:
        print(f"recorded in {report['recorded']['file']} (the candidate's manifest sha256 is now "
              f"{report['recorded']['manifest_sha256'][:16]}…)")
    sys.stdout.flush()
    return 0 if report["passed"] else 1
