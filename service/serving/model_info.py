"""The ModelInfo RPC's answer: what a server serves, built once when the model is loaded.

artifact_sha256 is the sha256 of the artifact's manifest, which itself holds the sha256 of the
weights and of every tokenizer file: two servers with the same value serve the same bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from ..artifact.acceptance import value_of
from ..artifact.artifact import MANIFEST, Artifact, sha256_file
from ..artifact.catalog import Catalog


def server_version() -> str:
    try:
        return metadata.version("slmrank")
    except metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def artifact_identity(artifact: Artifact) -> str:
    return sha256_file(artifact.path / MANIFEST)


def model_info(pb2: Any, spec: str, artifact: Artifact, runtime: Any, catalogs: Sequence[Catalog] | None = None) -> Any:
    """A ModelInfoResponse; runtime: the PythonRuntime / CppRuntime serving the artifact; catalogs:
    those served (a server's may have replaced the artifact's: Scheduler.catalogs), default the artifact's."""
    cfg = artifact.config
    # a runtime stand-in (tests wrap one) may lack these: then the artifact's own dtype, "cpu"
    dtype = getattr(runtime, "dtype", artifact.weight_dtype)
    device = getattr(getattr(runtime, "device", None), "type", "cpu")
    return pb2.ModelInfoResponse(
        model=spec, source=str(artifact.manifest.get("source", "")), artifact_sha256=artifact_identity(artifact),
        arch=cfg.arch, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
        num_labels=cfg.num_labels, weights_dtype=str(artifact.manifest["weights"]["dtype"]),
        weights_fp8=list(artifact.manifest["weights"].get("fp8", [])), weights_fp8_min_rows=artifact.fp8_min_rows,
        compute_dtype=str(dtype).removeprefix("torch."), runtime=runtime.name, device=str(device),
        kernels=getattr(runtime, "kernels", "aten"), beam_graphs=getattr(runtime, "beam_graphs", ""),
        limits=pb2.Limits(**dataclasses.asdict(artifact.limits)),
        score_buckets=[pb2.ScoreBucket(**dataclasses.asdict(b)) for b in artifact.buckets.score],
        beam_buckets=[pb2.BeamBucket(**dataclasses.asdict(b)) for b in artifact.buckets.beam],
        server_version=server_version(), bucket_origin=bucket_origin(pb2, artifact.manifest),
        catalogs=catalog_entries(pb2, artifact.catalogs if catalogs is None else catalogs),
        acceptance=acceptance(pb2, artifact))


def catalog_entries(pb2: Any, catalogs: Sequence[Catalog]) -> list[Any]:
    """ModelInfo's catalogs: name, items, code length, version, code tokens."""
    return [pb2.Catalog(name=c.name, num_items=c.num_items, code_length=c.code_length, version=c.version,
                        num_codes=len(c.code_tokens)) for c in catalogs]


def acceptance(pb2: Any, artifact: Artifact) -> Any:
    """The artifact's acceptance record (service/artifact/acceptance.py), None where it has none."""
    rec, entry = artifact.acceptance, artifact.manifest.get("acceptance")
    if rec is None or entry is None:
        return None
    checks = [pb2.AcceptanceCheck(name=c["name"], bound=c["bound"], limit=c["limit"], measured=c["value"] is not None,
                                  value=value_of(c["value"]) or 0.0, passed=c["passed"]) for c in rec["checks"]]
    counts = rec["requests"]
    return pb2.Acceptance(passed=rec["passed"], baseline_sha256=rec["baseline"]["sha256"],
                          requests_sha256=counts["sha256"], date=rec["date"], record_sha256=entry["sha256"],
                          evaluated_sha256=rec["candidate"]["sha256"],
                          requests=int(counts.get("score", 0)) + int(counts.get("beam", 0)), checks=checks)


def bucket_origin(pb2: Any, manifest: dict[str, Any]) -> Any:
    """The manifest's bucket_origin (an artifact built before it was recorded: the default table)."""
    origin = manifest.get("bucket_origin") or {"source": "default"}
    padding = [pb2.KindPadding(kind=kind, requests=k["requests"], batches=k["packed"]["batches"],
                               packed=k["packed"]["padding"] or 0.0, alone=k["alone"]["padding"] or 0.0,
                               default_packed=k["default_packed"]["padding"] or 0.0)
               for kind, k in origin.get("kinds", {}).items()]
    return pb2.BucketOrigin(source=origin["source"], log_sha256=origin.get("log_sha256", ""),
                            log_requests=origin.get("log_requests", 0), padding=padding)
