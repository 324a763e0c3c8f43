"""The benchmarks' workloads: the definitions live in the package, service/loadgen/workloads.py
(W1..W8's shapes and models, custom shapes, the variable-shape mixes, the requests of a workload
from a seed as gRPC messages, a request's logical FLOPs), since `slmrank bench` ships in the wheel
and ops/ does not; this module re-exports them for the benches, and adds what only the benches
that drive the executor directly need (bench_executor's requests per batch, the runtime's
requests of a shape, a mix's requests as the runtime takes them, the artifact a catalog workload
runs against).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from service.loadgen.workloads import (  # noqa: F401  (re-exported: the benches import them from here)
    ID_HIGH, MIXES, SCORE_MIX, WORKLOADS, Requests, WorkloadError, flops_per_request, message_flops)
from service.loadgen.workloads import parse_workload as _parse_workload
from service.loadgen.catalogs import num_codes
from service.model.flops import beam_flops, score_flops


def parse_workload(text: str, mixes: bool = False) -> dict[str, Any]:
    """service.loadgen.workloads.parse_workload's shapes, its mistake a one-line exit of the bench.
    A mix varies per request: only a bench that counts each request's FLOPs takes one (mixes=True)."""
    try:
        w = _parse_workload(text)
    except WorkloadError as e:
        raise SystemExit(str(e)) from None
    if w["kind"] == "mix" and not mixes:
        raise SystemExit(f"--workload: {text} varies per request: measure it with `slmrank bench --workload {text}`")
    return w


# requests per batch where the executor is driven directly (bench_executor): W6 is one request at
# a time (latency); a mix's batch: at most MIX_BATCH consecutive requests that one bucket holds
EXECUTOR_BATCH = {"W1": 8, "W2": 8, "W3": 4, "W4": 8, "W5": 2, "W6": 1, "W7": 8, "W7u": 8, "W7c": 8, "W8": 2, "W8u": 2,
                  "W8c": 2}
MIX_BATCH = 8
MIX_MODEL = "embedded:qwen3-0.6b"  # the mixes run on `slmrank serve`'s default model


def runtime_request(w: dict[str, Any], g: Any) -> Any:
    """One request of the shape as the runtime takes it (a ScoreRequest / BeamRequest), its ids
    uniform in [0, ID_HIGH) from the torch.Generator g (the samples before the prefix); a Score's
    label ids are 1000, 2000, ..."""
    import torch

    from service.runtime.requests import BeamRequest, ScoreRequest

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, ID_HIGH, (n,), generator=g).tolist())

    if w["kind"] == "score":
        samples = tuple(ids(w["len"]) for _ in range(w["samples"]))
        labels = tuple(1000 * (i + 1) for i in range(w["labels"]))
        return ScoreRequest(samples=samples, label_ids=labels, prefix_ids=ids(w["prefix"]) if w["prefix"] else ())
    return BeamRequest(prompt_ids=ids(w["prompt"]), beam_width=w["beam"], new_tokens=w["new"],
                       catalog=w.get("catalog", ""), normalization=w.get("normalization", "vocab"))


def request_flops(cfg: Any, req: Any) -> int:
    """The logical FLOPs of a runtime request (ScoreRequest / BeamRequest), whatever its shape."""
    from service.runtime.requests import ScoreRequest

    if isinstance(req, ScoreRequest):
        return score_flops(cfg, len(req.prefix_ids), [len(s) for s in req.samples])
    width = num_codes(req.catalog) if req.normalization == "codes" else None  # the head over the codes
    return beam_flops(cfg, len(req.prompt_ids), req.beam_width, req.new_tokens, width)


def mix_requests(name: str, cfg: Any, limits: Any, n: int, seed: int = 7) -> list[Any]:
    """n requests of a mix as the runtime takes them: the very requests `slmrank bench --workload
    name --seed seed` draws against a server of these limits (Requests), converted (runtime_of)."""
    reqs = Requests(_parse_workload(name), min(ID_HIGH, cfg.vocab_size), seed=seed, limits=limits)
    return [runtime_of(reqs.next()) for _ in range(n)]


def mix_score_bounds(limits: Any) -> tuple[int, int]:
    """(the most samples of a mix's Score request, the most tokens of one of its samples, prefix
    included) within a server's limits: what the strong peer's padded shapes must cover."""
    m = SCORE_MIX
    return min(m["samples"][1], limits.max_samples), min(m["prefix"][1] + m["len"][1], limits.max_score_tokens)


def runtime_of(msg: Any) -> Any:
    """A ScoreRequest / BeamSearchRequest message of token ids as the runtime takes it."""
    from service.runtime.requests import BeamRequest, ScoreRequest

    if hasattr(msg, "samples"):
        return ScoreRequest(samples=tuple(tuple(s.ids) for s in msg.samples), label_ids=tuple(msg.label_ids),
                            prefix_ids=tuple(msg.prefix.ids))
    return BeamRequest(prompt_ids=tuple(msg.prompt.ids), beam_width=msg.beam_width, new_tokens=msg.new_tokens,
                       catalog=msg.catalog, normalization="codes" if msg.normalization == 1 else "vocab")


def catalog_artifact(model: str, catalog: str, out: str | Path | None = None, quiet: bool = True) -> Path:
    """The artifact of an embedded spec or checkpoint `model` built with the catalog CATALOGS[catalog]
    (service/loadgen/catalogs.py, seeded: the same items every time) under that name: what a catalog
    workload (W7, W8) runs against. Built once into out (default: the artifact cache, keyed by the
    model, the catalog's name and its definition), the catalog file beside it; later calls load the
    one there (rebuilt if it does not load)."""
    import json

    from service.artifact.resolve import cache_dir
    from service.loadgen.catalogs import CATALOGS, catalog_file

    if catalog not in CATALOGS:
        raise SystemExit(f"catalog {catalog!r} is not one of {', '.join(CATALOGS)}")
    key = json.dumps([model, catalog, CATALOGS[catalog]], sort_keys=True)
    return cached_catalog_artifact(model, catalog, lambda: catalog_file(catalog, cache_dir() / "catalogs"),
                                   key, "catalog-", out, quiet)


def cached_catalog_artifact(model: str, name: str, file: Callable[[], Path], key: str, prefix: str,
                            out: str | Path | None = None, quiet: bool = True) -> Path:
    """The artifact of `model` with the catalog file() under `name`, in out (default: the artifact
    cache, $SLMRANK_CACHE/artifacts/<prefix><sha256 of key>): the one there when its manifest holds
    that catalog, else built afresh (a cached one that did not load is removed first); file() is
    called only then."""
    import hashlib
    import shutil

    from service.artifact.artifact import build_artifact, load_artifact
    from service.artifact.manifest import ArtifactError
    from service.artifact.resolve import cache_dir

    cached = not out
    out = Path(out) if out else cache_dir() / "artifacts" / (prefix + hashlib.sha256(key.encode()).hexdigest()[:16])
    if (out / "manifest.msgpack").exists():
        try:
            if name in load_artifact(out).catalog_lengths:
                return out
        except ArtifactError:
            if cached:
                shutil.rmtree(out, ignore_errors=True)
    build_artifact(model, out, quiet=quiet, catalogs={name: file()})
    return out
