"""The evaluation report of every FP8 policy on the embedded models (issue 29): for each model, one
baseline artifact (the model's own dtype) and one candidate per policy (`slmrank build --fp8 P`),
one request file of Score and BeamSearch lines at the workloads' shapes, and `slmrank evaluate
--truth float64` of each candidate against the baseline, so FP8's error against float64 stands beside
the baseline's (bfloat16 on a GPU: `--dtype auto`). Prints one row per (model, policy) last.

  python -m ops.bench.fp8_policies [--models qwen2.5-0.5b,qwen3-0.6b] [--policies mlp,mlp+attn,mlp+attn+head]
      [--score 24] [--beam 12] [--device auto] [--dir DIR] [--out FILE.json]

A policy is written with '+' between parts here (the build's `--fp8` takes them comma-separated).
The requests are random ids (the embedded models have random weights): Score lines of 15 samples of
8-48 tokens after a 16-64-token prefix with two labels, BeamSearch lines of 32-128 prompt tokens,
16-100 beams and 3-5 new tokens; seeded.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from service.cli import main as cli_main

POLICIES = ("mlp", "mlp+attn", "mlp+attn+head")
VOCAB_IDS = 150000  # below both embedded models' vocabulary (151,936)


def write_requests(path: Path, score: int, beam: int, seed: int) -> Path:
    """score Score lines and beam BeamSearch lines, interleaved, as `slmrank run` reads them."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(VOCAB_IDS) for _ in range(n)]
    lines = []
    for i in range(max(score, beam)):
        if i < score:
            lines.append({"id": f"s{i}", "kind": "score", "prefix_ids": ids(rng.randint(16, 64)),
                          "samples": [ids(rng.randint(8, 48)) for _ in range(15)], "label_ids": ids(2)})
        if i < beam:
            lines.append({"id": f"b{i}", "kind": "beam", "prompt_ids": ids(rng.randint(32, 128)),
                          "beam_width": rng.choice([16, 50, 100]), "new_tokens": rng.randint(3, 5)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _cli(*args: str) -> int:
    """slmrank's exit status (evaluate's 1, a rejected candidate, is a result here, not a failure)."""
    try:
        return int(cli_main(list(args)) or 0)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 2


def _row(model: str, policy: str, report: dict[str, Any], rc: int, seconds: float) -> dict[str, Any]:
    m = report["metrics"]
    pick = lambda side, key: m.get(side, {}).get(key)
    return {"model": model, "policy": policy, "passed": report["passed"], "rc": rc, "seconds": round(seconds, 1),
            **{f"{side}.{key}": pick(side, key) for side in ("candidate_vs_baseline", "baseline_vs_truth",
                                                             "candidate_vs_truth")
               for key in ("score.abs_logprob_max", "score.abs_logprob_p99", "score.kendall_tau_mean",
                           "score.top1_agreement", "beam.overlap_mean", "beam.top1_agreement",
                           "beam.best_logprob_delta_max")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-0.5b,qwen3-0.6b")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--score", type=int, default=24, help="Score lines")
    p.add_argument("--beam", type=int, default=12, help="BeamSearch lines")
    p.add_argument("--seed", type=int, default=29)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dir", default="/tmp/fp8-policies", help="where the artifacts and reports go")
    p.add_argument("--out", default=None, help="write the rows here as JSON")
    args = p.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    requests = write_requests(root / "requests.jsonl", args.score, args.beam, args.seed)
    rows = []
    for model in filter(None, args.models.split(",")):
        base = root / f"{model}.base"
        if not (base / "manifest.msgpack").exists() and not base.exists():
            t = time.monotonic()
            if _cli("build", "--model", f"embedded:{model}", "--out", str(base), "--quiet"):
                sys.exit(f"fp8_policies: building {model} failed")
            print(f"[fp8_policies] {model}: baseline built in {time.monotonic() - t:.1f} s", file=sys.stderr)
        for policy in filter(None, args.policies.split(",")):
            cand = root / f"{model}.fp8-{policy}"
            if not cand.exists():
                t = time.monotonic()
                if _cli("build", "--model", f"embedded:{model}", "--out", str(cand), "--fp8", policy.replace("+", ","),
                        "--quiet"):
                    sys.exit(f"fp8_policies: building {model} --fp8 {policy} failed")
                print(f"[fp8_policies] {model} --fp8 {policy}: built in {time.monotonic() - t:.1f} s", file=sys.stderr)
            report = root / f"{model}.fp8-{policy}.json"
            t = time.monotonic()
            rc = _cli("evaluate", "--baseline", str(base), "--candidate", str(cand), "--requests", str(requests),
                      "--truth", "float64", "--device", args.device, "--no-record", "--out", str(report))
            if rc not in (0, 1) or not report.exists():
                sys.exit(f"fp8_policies: evaluate {model} {policy} exited {rc}")
            rows.append(_row(model, policy, json.loads(report.read_text()), rc, time.monotonic() - t))
            if args.out:
                Path(args.out).write_text(json.dumps(rows, indent=1))
    fmt = lambda v: "-" if v is None else f"{v:.4g}"
    print(f"\n{'model':13s} {'policy':14s} {'pass':>4s} | {'vs base: max|d|':>15s} {'p99':>7s} {'tau':>6s} "
          f"{'ovl':>6s} | {'base vs f64: max|d|':>19s} {'ovl':>6s} | {'fp8 vs f64: max|d|':>18s} {'ovl':>6s}")
    for r in rows:
        cb, bt, ct = "candidate_vs_baseline.", "baseline_vs_truth.", "candidate_vs_truth."
        print(f"{r['model']:13s} {r['policy']:14s} {str(r['passed'])[0]:>4s} | {fmt(r[cb + 'score.abs_logprob_max']):>15s} "
              f"{fmt(r[cb + 'score.abs_logprob_p99']):>7s} {fmt(r[cb + 'score.kendall_tau_mean']):>6s} "
              f"{fmt(r[cb + 'beam.overlap_mean']):>6s} | {fmt(r[bt + 'score.abs_logprob_max']):>19s} "
              f"{fmt(r[bt + 'beam.overlap_mean']):>6s} | {fmt(r[ct + 'score.abs_logprob_max']):>18s} "
              f"{fmt(r[ct + 'beam.overlap_mean']):>6s}")


if __name__ == "__main__":
    main()
