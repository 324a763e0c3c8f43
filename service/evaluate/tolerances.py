"""The tolerances of `slmrank evaluate`: named bounds on the candidate-vs-baseline metrics, fixed
before anything runs (flags, or a JSON file of the same names; a flag wins over the file).

Each is a bound on one metric of service/evaluate/compare.py: "max" passes when the metric is at
most the limit, "min" when it is at least the limit. A check whose metric was not measured (a
request set without BeamSearch lines has no beam metric) is reported as such and holds. One check
is not a tolerance: every request the baseline answers, the candidate must answer too (and the
other way round): "answers".

The defaults are a starting point for a lower-precision candidate of the same checkpoint (bfloat16
beside float32, FP8 beside bfloat16) on ranking-sized requests; docs/operations.md ("Accepting a
candidate artifact") says how to set them for your traffic. Imported when `slmrank` starts: no torch,
no numpy here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    name: str  # the flag is --name with '-' for '_'; the key in a --tolerances file
    bound: str  # "max" | "min"
    metric: str  # the metric it bounds (compare.py)
    default: float
    what: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


TOLERANCES: tuple[Tolerance, ...] = (
    Tolerance("max_abs_logprob", "max", "score.abs_logprob_max", 0.5,
              "Score: the largest |Δ log-prob| over every sample and label"),
    Tolerance("max_p99_abs_logprob", "max", "score.abs_logprob_p99", 0.15,
              "Score: the 99th percentile of |Δ log-prob| over every sample and label"),
    Tolerance("min_kendall_tau", "min", "score.kendall_tau_mean", 0.9,
              "Score: Kendall's tau-b of the order of each request's samples, the mean over requests"),
    Tolerance("min_top1_agreement", "min", "score.top1_agreement", 0.9,
              "Score: the share of requests whose best sample is the same"),
    Tolerance("min_top3_agreement", "min", "score.top3_agreement", 0.9,
              "Score: the shared part of each request's 3 best samples, the mean over requests"),
    Tolerance("min_beam_overlap", "min", "beam.overlap_mean", 0.8,
              "BeamSearch: |A∩B|/|A| of the beams' token sequences, the mean over requests"),
    Tolerance("min_beam_top1_agreement", "min", "beam.top1_agreement", 0.9,
              "BeamSearch: the share of requests whose best sequence is the same"),
    Tolerance("max_beam_logprob_delta", "max", "beam.best_logprob_delta_max", 0.5,
              "BeamSearch: the largest |Δ| of a request's best log-prob"),
)
BY_NAME = {t.name: t for t in TOLERANCES}


def read_tolerance_file(path: str | Path) -> dict[str, float]:
    """{name: limit} from a JSON object of tolerance names (ValueError naming the key otherwise)."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--tolerances {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--tolerances {path}: must be a JSON object of tolerance names to limits")
    limits = {}
    for key, value in obj.items():
        if key not in BY_NAME:
            raise ValueError(f"--tolerances {path}: {key!r} is no tolerance (one of {', '.join(BY_NAME)})")
        limits[key] = check_limit(key, value, f"--tolerances {path}: {key}")
    return limits


def check_limit(name: str, value: Any, where: str) -> float:
    """A limit must be a finite number; a "min" one of a share or tau in [-1, 1] or [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: must be a finite number, got {value!r}")
    t = BY_NAME[name]
    lo = -1.0 if "tau" in name else 0.0
    hi = 1.0 if t.bound == "min" else math.inf
    if not lo <= value <= hi:
        raise ValueError(f"{where}: must be in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def resolve_limits(file_limits: dict[str, float], flag_limits: dict[str, float | None]) -> dict[str, float]:
    """Every tolerance's limit: the flag's, else the file's, else the default."""
    out = {}
    for t in TOLERANCES:
        flag = flag_limits.get(t.name)
        out[t.name] = flag if flag is not None else file_limits.get(t.name, t.default)
    return out


ANSWERS_METRIC = "answers.mismatched"  # requests answered by one side only


def check(limits: dict[str, float], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry a tolerance, after "answers": name, bound, limit, value (None: not measured),
    passed. A NaN value fails."""
    mismatched = metrics[ANSWERS_METRIC]
    out: list[dict[str, Any]] = [{"name": "answers", "bound": "max", "limit": 0, "value": mismatched,
                                  "passed": mismatched == 0}]
    for t in TOLERANCES:
        limit, value = limits[t.name], metrics.get(t.metric)
        if value is None:
            passed = True
        elif math.isnan(value):
            passed = False
        else:
            passed = value <= limit if t.bound == "max" else value >= limit
        out.append({"name": t.name, "bound": t.bound, "limit": limit, "value": value, "passed": passed})
    return out
