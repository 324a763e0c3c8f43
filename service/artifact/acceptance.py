"""An artifact's acceptance record: what `slmrank evaluate` found when it ran this artifact (the
candidate) beside a baseline on a request set (service/evaluate/).

  DIR/acceptance.json   the record: format + version, passed, date (UTC), the baseline's and this
                        artifact's identity (manifest sha256s) and weights, the request set's
                        sha256, the tolerances, every check (limit, value, passed) and the metrics
  manifest "acceptance" {file, sha256 of the file, passed, baseline_sha256, requests_sha256, date}

The manifest's entry holds the file's sha256, so the manifest's own sha256 (manifest.sha256) covers
the record; both loaders check the entry's fields and, when they verify the files, the file's
sha256 (cpp_dag/artifact_loader.cpp too). Writing a record rewrites the manifest and its digest
through manifest.write_manifest (artifact.record_acceptance): the artifact's identity changes, and
the record names the identity it was measured on (candidate.sha256). Like the manifest's hash,
this is no signature: whoever can write the directory can write a record.

JSON has no infinity: a value that is not finite (a NaN answer, an unbounded difference) is written
as the string "inf", "-inf" or "nan".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..model.files import read_bounded
from .manifest import (ACCEPTANCE, ArtifactError, _fail, array, boolean, integer, mapping, number, plain, record,
                       sha256_hex, text)

RECORD_FORMAT = "slmrank-acceptance"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 16 << 20  # a record is a few KB; per-request details stay in `evaluate --out`
NON_FINITE = ("inf", "-inf", "nan")


def _value(value: Any, field: str) -> None:
    """A check's measured value: a number, one of NON_FINITE, or null (not measured)."""
    if value is None or value in NON_FINITE:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(field, f"a finite number, one of {', '.join(NON_FINITE)}, or null", value)


_CHECK = record({"name": text(), "bound": text(("max", "min")), "limit": number(-1, 1e12, open_lo=False),
                 "value": _value, "passed": boolean}, others=plain())
RECORD_SCHEMA = record({
    "format": text((RECORD_FORMAT,)),
    "version": integer(RECORD_VERSION, RECORD_VERSION),
    "passed": boolean,
    "date": text(),
    "baseline": record({"sha256": sha256_hex}, others=plain()),
    "candidate": record({"sha256": sha256_hex}, others=plain()),
    "requests": record({"sha256": sha256_hex}, others=plain()),
    "tolerances": mapping(text(), number(-1, 1e12, open_lo=False)),
    "checks": array(_CHECK, 1),
}, others=plain())


def finite_json(value: Any) -> Any:
    """value with every float that is not finite as its NON_FINITE string (for JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def record_bytes(rec: dict[str, Any]) -> bytes:
    """The record as its file holds it (sorted keys; checked against RECORD_SCHEMA, so nothing is
    written that the loader would refuse)."""
    rec = finite_json(rec)
    try:
        RECORD_SCHEMA(rec, "")
    except ArtifactError as e:
        raise ArtifactError(f"{ACCEPTANCE}: {e}") from None
    return (json.dumps(rec, indent=1, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n").encode()


def manifest_entry(rec: dict[str, Any], file_sha256: str) -> dict[str, Any]:
    """What the manifest says of a record: the file, its sha256, and the result in brief."""
    return {"file": ACCEPTANCE, "sha256": file_sha256, "passed": rec["passed"],
            "baseline_sha256": rec["baseline"]["sha256"], "requests_sha256": rec["requests"]["sha256"],
            "date": rec["date"]}


def read_record(path: Path) -> dict[str, Any]:
    """The record file at path (the caller has checked its sha256 where it verifies), checked
    against RECORD_SCHEMA; ArtifactError naming the file otherwise."""
    raw = read_bounded(path, MAX_RECORD_BYTES, ArtifactError)
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not an acceptance record ({e})") from None
    try:
        RECORD_SCHEMA(rec, "")
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}") from None
    return rec


def value_of(v: Any) -> float | None:
    """A check's value as a float (NON_FINITE strings back to floats), None when not measured."""
    return None if v is None else float(v)
