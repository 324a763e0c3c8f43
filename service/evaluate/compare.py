"""One request set through a baseline and a candidate artifact (and, optionally, the float64
truth of the baseline's weights), the metrics of their agreement, the checks against the
tolerances, the report and its table.

Each side runs in-process, one after the other (one model in memory at a time), on the runtime,
device and dtype `slmrank run` would pick (service/runtime/placement.py), its requests parsed with
its own tokenizer and validated against its own limits. Results are compared line by line:

  Score       every label log-prob (or head output) of every sample: |Δ| (metrics.abs_delta),
              its max and p99 over the whole set; per request the order of its samples by
              metrics.rank_key: Kendall tau-b, top-1 and top-3 agreement
  BeamSearch  per request: the overlap of the two beam sets, top-1 agreement, |Δ| of the best
              log-prob, and the largest |Δ| of a sequence both sides returned
  answers     a line one side answers and the other refuses (or fails) is a mismatch; refused by
              both (a malformed line), it is counted and left out

Metrics are "reference vs other": candidate vs baseline (what the tolerances bound), and with the
truth, baseline vs truth and candidate vs truth (the truth is the reference: beam overlap is
|truth ∩ side| / |truth|), reported beside them and bound by nothing.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact.artifact import MANIFEST, Artifact, load_artifact, sha256_file
from ..model.progress import Progress
from ..runtime.engine import execute
from ..runtime.jsonl import artifact_labels, read_request_file
from ..runtime.requests import BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult
from . import metrics as mx
from .tolerances import ANSWERS_METRIC, TOLERANCES, check

CHUNK = 64  # requests a call of the engine: progress between calls
Answer = ScoreResult | BeamResult | RequestError | ExecutionError | None  # None: not run (the truth's skips)


class Side:
    """One artifact's answers to the request file's lines."""

    def __init__(self, label: str, artifact: Artifact, answers: list[Answer], kinds: list[str | None],
                 seconds: float, runtime: str) -> None:
        self.label, self.artifact, self.answers, self.kinds = label, artifact, answers, kinds
        self.seconds, self.runtime = seconds, runtime


def identity(artifact: Artifact) -> str:
    """The artifact's sha256: its manifest's (which holds every file's), as ModelInfo says it."""
    return sha256_file(artifact.path / MANIFEST)


def check_comparable(baseline: Artifact, candidate: Artifact) -> None:
    """Token ids mean the same on both sides, and the answers have one shape (ValueError otherwise)."""
    b, c = baseline.config, candidate.config
    if b.vocab_size != c.vocab_size:
        raise ValueError(f"--candidate: vocabulary of {c.vocab_size} tokens, the baseline's has {b.vocab_size}: "
                         "token ids would not mean the same")
    if baseline.tokenizer["files"] != candidate.tokenizer["files"]:
        raise ValueError("--candidate: its tokenizer files differ from the baseline's (their sha256s): token ids "
                         "would not mean the same")
    if b.num_labels != c.num_labels:
        raise ValueError(f"--candidate: num_labels {c.num_labels}, the baseline's {b.num_labels}: one has a "
                         "classification head and the other not, or heads of other sizes")


def run_side(label: str, artifact: Artifact, requests: Path, make_runtime: Callable[[Artifact], Any],
             quiet: bool = False) -> Side:
    """The request file through the artifact on a runtime made for it (then released)."""
    lines = read_request_file(requests, artifact_labels(artifact))
    answers: list[Answer] = [req if isinstance(req, RequestError) else None for _, req in lines]
    kinds = [_kind(req) for _, req in lines]
    runnable = [i for i, (_, req) in enumerate(lines) if not isinstance(req, RequestError)]
    runtime = make_runtime(artifact)
    name = runtime.name
    t0 = time.monotonic()
    try:
        with Progress(f"evaluate {label}", len(runnable), quiet=quiet) as bar:
            for at in range(0, len(runnable), CHUNK):
                idx = runnable[at:at + CHUNK]
                for i, res in zip(idx, execute(artifact, runtime, [lines[i][1] for i in idx])):
                    answers[i] = res
                bar.advance(len(idx))
    finally:
        if hasattr(runtime, "shutdown"):
            runtime.shutdown()
        del runtime
        gc.collect()
        _empty_device_cache()
    return Side(label, artifact, answers, kinds, time.monotonic() - t0, name)


def run_truth(baseline: Artifact, requests: Path, answered: Sequence[bool], device: str, quiet: bool = False) -> Side:
    """The float64 truth of the baseline's weights for every line the baseline answered (None elsewhere)."""
    from .truth import Float64Model

    lines = read_request_file(requests, artifact_labels(baseline))
    model = Float64Model(baseline, device)
    answers: list[Answer] = [None] * len(lines)
    t0 = time.monotonic()
    todo = [i for i, ok in enumerate(answered) if ok]
    with Progress("evaluate truth float64", len(todo), quiet=quiet) as bar:
        for i in todo:
            req = lines[i][1]
            answers[i] = model.score(req) if isinstance(req, ScoreRequest) else model.beam(req)  # type: ignore
            bar.advance(1)
    del model
    gc.collect()
    _empty_device_cache()
    return Side("truth", baseline, answers, [_kind(req) for _, req in lines], time.monotonic() - t0, "float64")


def _kind(req: Any) -> str | None:
    return "score" if isinstance(req, ScoreRequest) else "beam" if isinstance(req, BeamRequest) else None


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_answer(a: Answer) -> bool:
    return isinstance(a, (ScoreResult, BeamResult))


# ---- the metrics of one pair -------------------------------------------------------------------------

def compare_score(ref: ScoreResult, other: ScoreResult, rank_by: str) -> tuple[np.ndarray, dict[str, float]]:
    """(|Δ| of every value, the request's order metrics)."""
    a, b = np.asarray(ref.scores, dtype=np.float64), np.asarray(other.scores, dtype=np.float64)
    if a.shape != b.shape:  # never from two artifacts of one vocabulary and head; a broken runtime could
        return np.full(max(a.size, 1), np.inf), {"kendall_tau": 0.0, "top1": 0.0, "top3": 0.0, "abs_max": np.inf}
    deltas = mx.abs_delta(a.ravel(), b.ravel())
    ka, kb = mx.rank_key(ref.scores, rank_by), mx.rank_key(other.scores, rank_by)
    return deltas, {"kendall_tau": mx.kendall_tau_b(ka, kb), "top1": mx.top_k_agreement(ka, kb, 1),
                    "top3": mx.top_k_agreement(ka, kb, 3), "abs_max": float(deltas.max(initial=0.0))}


def compare_beam(ref: BeamResult, other: BeamResult) -> dict[str, float]:
    a = [(tuple(bm.ids), bm.logprob) for bm in ref.beams]
    b = [(tuple(bm.ids), bm.logprob) for bm in other.beams]
    if a and b:
        best = float(mx.abs_delta([a[0][1]], [b[0][1]])[0])
    else:
        best = 0.0 if not a and not b else np.inf
    lp_b = dict(b)
    shared = [(lp, lp_b[ids]) for ids, lp in a if ids in lp_b]
    shared_max = float(mx.abs_delta(*zip(*shared)).max()) if shared else 0.0
    return {"overlap": mx.beam_overlap([s for s, _ in a], [s for s, _ in b]), "top1": float(mx.beam_top1(a, b)),
            "best_logprob_delta": best, "shared_logprob_delta_max": shared_max}


def compare(ref: Side, other: Side, ids: Sequence[Any], rank_by: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics over the set, per-request details) of other against ref, line by line."""
    deltas: list[np.ndarray] = []
    score_rows: list[dict[str, float]] = []
    beam_rows: list[dict[str, float]] = []
    per_request: list[dict[str, Any]] = []
    mismatched = refused_both = 0
    for i, (a, b) in enumerate(zip(ref.answers, other.answers)):
        if a is None or b is None:
            continue  # not run on that side (the truth runs only what the baseline answered)
        kind = ref.kinds[i] or other.kinds[i]
        row: dict[str, Any] = {"line": i + 1, "id": ids[i], "kind": kind}
        if not _is_answer(a) or not _is_answer(b):
            if _is_answer(a) or _is_answer(b):
                mismatched += 1
                row["mismatch"] = {ref.label: _said(a), other.label: _said(b)}
                per_request.append(row)
            else:
                refused_both += 1
            continue
        if isinstance(a, ScoreResult) and isinstance(b, ScoreResult):
            d, m = compare_score(a, b, rank_by)
            deltas.append(d)
            score_rows.append(m)
        elif isinstance(a, BeamResult) and isinstance(b, BeamResult):
            m = compare_beam(a, b)
            beam_rows.append(m)
        else:  # one line, two kinds: cannot happen with one file
            mismatched += 1
            continue
        row.update(m)
        per_request.append(row)
    out: dict[str, Any] = {ANSWERS_METRIC: mismatched, "answers.refused_by_both": refused_both,
                           "score.requests": len(score_rows), "beam.requests": len(beam_rows)}
    if score_rows:
        every = np.concatenate(deltas) if deltas else np.zeros(0)
        taus = [r["kendall_tau"] for r in score_rows]
        out.update({"score.values": int(every.size), "score.abs_logprob_max": float(every.max(initial=0.0)),
                    "score.abs_logprob_p99": mx.p99(every), "score.kendall_tau_mean": float(np.mean(taus)),
                    "score.kendall_tau_min": float(np.min(taus)),
                    "score.top1_agreement": float(np.mean([r["top1"] for r in score_rows])),
                    "score.top3_agreement": float(np.mean([r["top3"] for r in score_rows]))})
    if beam_rows:
        overlaps = [r["overlap"] for r in beam_rows]
        out.update({"beam.overlap_mean": float(np.mean(overlaps)), "beam.overlap_min": float(np.min(overlaps)),
                    "beam.top1_agreement": float(np.mean([r["top1"] for r in beam_rows])),
                    "beam.best_logprob_delta_max": float(max(r["best_logprob_delta"] for r in beam_rows)),
                    "beam.shared_logprob_delta_max": float(max(r["shared_logprob_delta_max"] for r in beam_rows))})
    return out, per_request


def _said(a: Answer) -> str:
    return "answered" if _is_answer(a) else str(a)


# ---- the whole evaluation ----------------------------------------------------------------------------

def evaluate(baseline_dir: str | Path, candidate_dir: str | Path, requests: str | Path, limits: dict[str, float], *,
             make_runtime: Callable[[Artifact], Any], placement: dict[str, Any], truth: str | None = None,
             truth_device: str = "cpu", rank_by: str = "auto", quiet: bool = False) -> dict[str, Any]:
    """The report (a plain dict; see module doc): what ran, the tolerances, the checks, the metrics
    and the per-request details. ValueError / OSError / ArtifactError: usage (exit 2)."""
    requests = Path(requests)
    request_bytes = requests.read_bytes()
    baseline, candidate = _load("--baseline", baseline_dir), _load("--candidate", candidate_dir)
    check_comparable(baseline, candidate)
    ids_seen = read_request_file(requests)  # the ids (label_texts need a tokenizer: parsed again per side)
    if not ids_seen:
        raise ValueError(f"--requests {requests}: no request lines")
    ids = [rid for rid, _ in ids_seen]
    base = run_side("baseline", baseline, requests, make_runtime, quiet)
    cand = run_side("candidate", candidate, requests, make_runtime, quiet)
    metrics, per_request = compare(base, cand, ids, rank_by)
    if metrics["score.requests"] + metrics["beam.requests"] == 0 and metrics[ANSWERS_METRIC] == 0:
        raise ValueError(f"--requests {requests}: no line was answered by both artifacts (every one refused: "
                         f"{_said(base.answers[0])})")
    report_metrics = {"candidate_vs_baseline": metrics}
    timing = {"baseline_s": round(base.seconds, 3), "candidate_s": round(cand.seconds, 3)}
    if truth == "float64":
        gold = run_truth(baseline, requests, [_is_answer(a) for a in base.answers], truth_device, quiet)
        report_metrics["baseline_vs_truth"], _ = compare(gold, base, ids, rank_by)
        report_metrics["candidate_vs_truth"], _ = compare(gold, cand, ids, rank_by)
        timing["truth_s"] = round(gold.seconds, 3)
    checks = check(limits, metrics)
    return {
        "tool": "slmrank evaluate",
        "format": "slmrank-acceptance", "version": 1,
        "passed": all(c["passed"] for c in checks),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "baseline": _describe(baseline, base.runtime),
        "candidate": _describe(candidate, cand.runtime),
        "requests": {"file": str(requests), "sha256": hashlib.sha256(request_bytes).hexdigest(), "lines": len(ids),
                     "score": metrics["score.requests"], "beam": metrics["beam.requests"],
                     "refused_by_both": metrics["answers.refused_by_both"]},
        "placement": {**placement, "rank_by": rank_by, "truth": truth or "none"},
        "tolerances": dict(limits),
        "checks": checks,
        "metrics": report_metrics,
        "seconds": timing,
        "per_request": per_request,
    }


def _load(flag: str, path: str | Path) -> Artifact:
    p = Path(path)
    if not p.is_dir() or not (p / MANIFEST).exists():
        raise ValueError(f"{flag} {path}: not an artifact directory (build one with `slmrank build`)")
    return load_artifact(p)


def _describe(art: Artifact, runtime: str) -> dict[str, Any]:
    return {"path": str(art.path), "sha256": identity(art), "source": str(art.manifest.get("source", "")),
            "weights_dtype": art.manifest["weights"]["dtype"], "weights_fp8": list(art.fp8),
            "weights_sha256": art.manifest["weights"]["sha256"], "runtime": runtime}


def _weights_note(side: dict[str, Any]) -> str:
    """The weights' dtype, and the e4m3 linear layers where there are (`slmrank build --fp8`)."""
    fp8 = side.get("weights_fp8") or []
    return side["weights_dtype"] + (f" + fp8 {','.join(fp8)}" if fp8 else "")


# ---- the table ---------------------------------------------------------------------------------------

COLUMNS = (("candidate_vs_baseline", "candidate vs baseline"), ("baseline_vs_truth", "baseline vs truth"),
           ("candidate_vs_truth", "candidate vs truth"))
# metrics no tolerance bounds, shown under the checks
INFORMATIONAL = (("score.kendall_tau_min", "kendall tau, worst request"),
                 ("beam.overlap_min", "beam overlap, worst request"),
                 ("beam.shared_logprob_delta_max", "beam |Δ log-prob|, shared sequences"))


_SIGN = {"max": "≤", "min": "≥"}


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, int):
        return str(v)
    if not np.isfinite(v):
        return str(v)
    return f"{v:.4g}" if abs(v) >= 1e-4 or v == 0 else f"{v:.2e}"


def format_table(report: dict[str, Any]) -> str:
    """The report for people: the checks (limit, values, verdict), a few other metrics, the verdict."""
    cols = [(key, title) for key, title in COLUMNS if key in report["metrics"]]
    metric_of = {t.name: t.metric for t in TOLERANCES}
    rows = [["check", "limit", *[t for _, t in cols], ""]]
    for c in report["checks"]:
        metric = metric_of.get(c["name"], ANSWERS_METRIC)
        limit = f"{_SIGN[c['bound']]} {_fmt(c['limit'])}"
        values = [_fmt(report["metrics"][k].get(metric)) for k, _ in cols]
        verdict = "ok" if c["passed"] and c["value"] is not None else "n/a" if c["value"] is None else "EXCEEDED"
        rows.append([c["name"], limit, *values, verdict])
    for metric, title in INFORMATIONAL:
        if metric in report["metrics"]["candidate_vs_baseline"]:
            rows.append([title, "", *[_fmt(report["metrics"][k].get(metric)) for k, _ in cols], ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    b, c, r = report["baseline"], report["candidate"], report["requests"]
    head = [f"baseline   {b['path']} ({_weights_note(b)}, sha256 {b['sha256'][:16]}…, {b['runtime']} runtime)",
            f"candidate  {c['path']} ({_weights_note(c)}, sha256 {c['sha256'][:16]}…, {c['runtime']} runtime)",
            f"requests   {r['file']} (sha256 {r['sha256'][:16]}…): {r['score']} Score, {r['beam']} BeamSearch "
            "compared"
            + (f", {r['refused_by_both']} refused by both" if r["refused_by_both"] else ""), ""]
    failed = [c for c in report["checks"] if not c["passed"]]
    if failed:
        verdict = "REJECTED: " + "; ".join(f"{c['name']} {_fmt(c['value'])} (limit {_SIGN[c['bound']]} "
                                           f"{_fmt(c['limit'])})" for c in failed)
    else:
        verdict = f"ACCEPTED: {sum(c['value'] is not None for c in report['checks'])} checks hold"
    return "\n".join(head + lines + ["", verdict])
