"""`slmrank bench`'s report: the table it prints, and bench.json, bench.csv, latency_vs_load.png,
latency_histogram.png in its --out directory."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from .png import line_chart

CSV_FIELDS = ("mode", "level", "rate", "qps", "completed", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms",
              "num_errors", "errors", "sent", "not_sent", "client_cpu", "tflops_per_s", "eff_mfu", "within_slo")


def load_of(row: dict[str, Any]) -> str:
    return str(row["level"]) if row["mode"] == "closed" else f"{row['rate']:g}/s"


def _ms(v: float) -> str:
    return f"{v:9.2f}" if not math.isnan(v) else f"{'-':>9s}"


def table(result: dict[str, Any]) -> str:
    """The levels, one line each; the errors by status code; the capacity at the SLO."""
    slo, peak = result["slo"], result["peak_flops"]
    head = "level" if result["mode"] == "closed" else "rate"
    lines = [f"{head:>9s} {'req/s':>9s} {'mean ms':>9s} {'p50 ms':>9s} {'p90 ms':>9s} {'p99 ms':>9s} "
             f"{'max ms':>9s} {'errors':>7s} {'TFLOP/s':>8s} {'MFU':>7s} {'client':>6s}  SLO"]
    for r in result["levels"]:
        tf = r.get("flops_per_s")
        lines.append(f"{load_of(r):>9s} {r['qps']:9.1f} {_ms(r['mean_ms'])} {_ms(r['p50_ms'])} {_ms(r['p90_ms'])} "
                     f"{_ms(r['p99_ms'])} {_ms(r['max_ms'])} {r['num_errors']:7d} "
                     + (f"{tf / 1e12:8.3f} {tf / peak:7.2%}" if tf is not None else f"{'-':>8s} {'-':>7s}")
                     + f" {r['client_cpu']:6.2f}  {'ok' if r['within_slo'] else 'over'}")
    for r in result["levels"]:  # a mix: each kind on its own, so that one starving the other shows
        kinds = r.get("by_method") or {}
        if len(kinds) > 1:
            lines.append(f"by kind at {load_of(r)}: " + "; ".join(
                f"{m} {k['qps']:.1f} req/s, mean {k['mean_ms']:.2f} / P99 {k['p99_ms']:.2f} ms"
                for m, k in kinds.items()))
    for r in result["levels"]:  # --metrics: the server's own view of the window (batching, where the time went)
        if sv := r.get("server"):
            lines.append(f"server at {load_of(r)}: {sv['requests_per_batch']} requests/batch ({sv['batches']} batches)"
                         + "".join(f", {stage} {ms:.2f}" for stage, ms in sv["stage_mean_ms"].items())
                         + (" ms a request" if sv["stage_mean_ms"] else "")
                         + (f"; event loop busy {sv['loop_busy']:.0%}" if sv.get("loop_busy") is not None else ""))
    for r in result["levels"]:
        if r["errors"]:
            lines.append(f"errors at {load_of(r)}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())))
    if result.get("skipped_levels"):
        lines.append(f"skipped (a lower level's mean was over {result['stop_above_ms']:g} ms): "
                     + ", ".join(str(x) if result["mode"] == "closed" else f"{x:g}/s" for x in result["skipped_levels"]))
    cap = result["capacity"]
    where = f"mean < {slo['mean_ms']:g} ms, P99 < {slo['p99_ms']:g} ms"
    if cap is None:
        best = max(result["levels"], key=lambda r: r["qps"], default=None)
        lines.append(f"capacity at {where}: none within the SLO"
                     + (f" (the most: {best['qps']:.1f} req/s at {load_of(best)}, mean {best['mean_ms']:.2f} / "
                        f"P99 {best['p99_ms']:.2f} ms)" if best else ""))
    else:
        at = f"level {cap['level']}" if cap["level"] is not None else f"{cap['rate']:g} req/s offered"
        mfu = (f"; effective MFU {result['eff_mfu']:.2%} of {peak / 1e12:g} TFLOPS" if result["eff_mfu"] is not None
               else "; effective MFU: the model's shape is unknown (--model)")
        lines.append(f"capacity at {where}: {cap['qps']:.1f} req/s at {at} (mean {cap['mean_ms']:.2f} ms, "
                     f"P99 {cap['p99_ms']:.2f} ms){mfu}")
    busy = [r for r in result["levels"] if r["client_cpu"] > 0.9]
    if busy:
        lines.append(f"note: the client used > 0.9 CPU at {', '.join(load_of(r) for r in busy)}: "
                     "the client may be what limits those levels (run several `slmrank bench` processes, or from "
                     "a bigger machine)")
    return "\n".join(lines)


def write_csv(path: Path, result: dict[str, Any]) -> None:
    peak = result["peak_flops"]
    with path.open("w", newline="") as fh:
        out = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        out.writeheader()
        for r in result["levels"]:
            tf = r.get("flops_per_s")
            out.writerow({**{k: r.get(k) for k in CSV_FIELDS},
                          "errors": ";".join(f"{k}={v}" for k, v in sorted(r["errors"].items())),
                          "tflops_per_s": None if tf is None else tf / 1e12,
                          "eff_mfu": None if tf is None else tf / peak})


def _json_safe(value: Any) -> Any:
    """NaN (a level with no completed RPC) as null: bench.json is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def plots(out: Path, result: dict[str, Any]) -> list[Path]:
    """latency_vs_load.png (mean, P50, P90, P99 against the QPS of each level, the SLO's lines, the
    capacity circled) and latency_histogram.png (each level's share of RPCs per latency bucket)."""
    rows = [r for r in result["levels"] if r["completed"]]
    slo, name = result["slo"], result["workload"]["name"]
    cap = result["capacity"]
    paths = [out / "latency_vs_load.png", out / "latency_histogram.png"]
    line_chart(paths[0], f"{name}: latency against load ({result['mode']} loop)", "completed req/s", "latency ms",
               [(q.upper().replace("_MS", ""), [(r["qps"], r[q]) for r in rows])
                for q in ("mean_ms", "p50_ms", "p90_ms", "p99_ms")],
               log_y=True, hlines=[(f"SLO mean {slo['mean_ms']:g} ms", slo["mean_ms"]),
                                   (f"SLO P99 {slo['p99_ms']:g} ms", slo["p99_ms"])],
               marks=[(f"capacity {cap['qps']:.1f} req/s", cap["qps"], cap["mean_ms"])] if cap else [],
               notes=[(load_of(r), r["qps"], r["p99_ms"]) for r in rows])  # each P99 point names its level
    series = []
    for r in rows:
        edges, counts = r["histogram"]["edges_ms"], r["histogram"]["counts"]
        total = sum(counts) or 1
        pts = [(e, 100.0 * n / total) for e, n in zip(edges, counts)]
        if edges:  # up from 0 at the first edge, down to 0 at the last
            pts = [(edges[0], 0.0), *pts, (edges[-1], pts[-1][1]), (edges[-1], 0.0)]
        series.append((f"{'level' if r['mode'] == 'closed' else 'rate'} {load_of(r)}", pts))
    line_chart(paths[1], f"{name}: latency histogram per level", "latency ms (10 buckets a decade)", "% of RPCs",
               series, log_x=True, steps=True)
    return paths


def write(out: Path, result: dict[str, Any]) -> list[Path]:
    """bench.json, bench.csv and the two PNGs under out (made if missing); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(_json_safe(result), indent=1))
    write_csv(out / "bench.csv", result)
    return [out / "bench.json", out / "bench.csv", *plots(out, result)]
