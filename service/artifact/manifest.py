"""The artifact's manifest on disk, verified before it is used (issue 32, point 8):

  DIR/manifest.msgpack   the manifest
  DIR/manifest.sha256    its sha256, as `sha256sum` writes it ("<64 hex>  manifest.msgpack\\n")

read_manifest reads the digest, then the manifest (regular files, within their size bounds), compares
the hash before a byte is decoded, checks the format and version, then every field against SCHEMA:
its type and its range, each error naming the field ("model.vocab_size: ..."). Only then do the
dataclasses see it, so a corrupted or hand-edited manifest is one ArtifactError, never a KeyError.
cpp_dag/artifact_loader.cpp checks the same digest and the fields it reads, with the same bounds.

The hash finds corruption and edits made without the builder (a flipped bit, a renamed key); it is
not a signature: whoever can write the directory can rewrite both files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from ..model.checkpoint import FP8_PARTS
from ..model.config import SUPPORTED_ARCHS, ModelConfig, ServingLimits
from ..model.files import read_bounded
from .buckets import BeamBucket, ScoreBucket
from .dag import NODE_TYPES

FORMAT = "slmrank-artifact"
MANIFEST = "manifest.msgpack"
MANIFEST_SHA256 = "manifest.sha256"
WEIGHTS = "weights.safetensors"
ACCEPTANCE = "acceptance.json"  # the acceptance record (service/artifact/acceptance.py), when there is one
MAX_MANIFEST_BYTES = 64 << 20  # a manifest is ~100 KB; more is not a manifest
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # artifact.DTYPES: their torch dtypes

# bounds of the manifest's numbers (cpp_dag/artifact_loader.cpp: kMaxCount, kMaxVocab): beyond them a
# RoPE table, a bucket's buffers or a weight would not fit in any host's memory
MAX_COUNT = 1 << 20  # tokens, positions, widths, sizes, layers, buckets, nodes
MAX_ITEMS = 1 << 32  # a catalog's items (10M is the scale)
MAX_VOCAB = 1 << 22
MAX_TEXT = 4096  # characters of a string field
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SIDECAR = re.compile(rb"([0-9a-f]{64})  " + re.escape(MANIFEST.encode()) + rb"\n?")


class ArtifactError(ValueError):
    """A missing, corrupted or mismatched artifact."""


# ---- the schema: one checker per field, each raising ArtifactError naming the field ---------------

Check = Callable[[Any, str], None]


def _fail(field: str, want: str, value: Any) -> None:
    is_short = isinstance(value, (int, float, str, bool)) and len(repr(value)) < 80
    shown = repr(value) if is_short else f"a {type(value).__name__}"
    raise ArtifactError(f"{field}: must be {want}, got {shown}")


def integer(lo: int, hi: int = MAX_COUNT) -> Check:
    def check(value: Any, field: str) -> None:
        if type(value) is not int or not lo <= value <= hi:  # type(): a bool is no count
            _fail(field, f"an integer in [{lo}, {hi}]", value)
    return check


def number(lo: float, hi: float, *, open_lo: bool = True) -> Check:
    def check(value: Any, field: str) -> None:
        if type(value) not in (int, float) or not math.isfinite(value) or not (
                lo < value if open_lo else lo <= value) or value > hi:
            _fail(field, f"a number in {'(' if open_lo else '['}{lo:.0f}, {hi:.0f}]", value)  # integral bounds
    return check


def boolean(value: Any, field: str) -> None:
    if type(value) is not bool:
        _fail(field, "true or false", value)


def text(choices: tuple[str, ...] = ()) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, str) or not 0 < len(value) <= MAX_TEXT:
            _fail(field, f"a string of 1 to {MAX_TEXT} characters", value)
        if choices and value not in choices:
            _fail(field, f"one of {', '.join(choices)}", value)
    return check


def sha256_hex(value: Any, field: str) -> None:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        _fail(field, "64 lower-case hex digits", value)


def file_name(value: Any, field: str) -> None:
    """A path inside the artifact directory: relative, no '..', no empty part."""
    text()(value, field)
    if value.startswith("/") or any(part in ("", ".", "..") for part in value.split("/")):
        _fail(field, "a path inside the artifact directory", value)


def array(item: Check, lo: int = 0, hi: int = MAX_COUNT) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, list) or not lo <= len(value) <= hi:
            _fail(field, f"an array of {lo} to {hi} items", value)
        for i, v in enumerate(value):
            item(v, f"{field}[{i}]")
    return check


def mapping(key: Check, value_check: Check, hi: int = MAX_COUNT) -> Check:
    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict) or len(value) > hi:
            _fail(field, f"a map of at most {hi} entries", value)
        for k, v in value.items():
            key(k, f"{field} key")
            value_check(v, f"{field}.{k}")
    return check


def plain(depth: int = 6) -> Check:
    """A record's informational part, read by no runtime: strings, numbers, booleans, nulls and
    bounded lists and maps of them, at most depth levels deep."""
    def check(value: Any, field: str) -> None:
        if value is None or isinstance(value, (bool, int, float)):
            return
        if isinstance(value, str):
            if value:  # empty strings are fine here
                text()(value, field)
        elif depth > 0 and isinstance(value, list) and len(value) <= MAX_COUNT:
            for i, v in enumerate(value):
                plain(depth - 1)(v, f"{field}[{i}]")
        elif depth > 0 and isinstance(value, dict) and len(value) <= MAX_COUNT:
            for k, v in value.items():
                text()(k, f"{field} key")
                plain(depth - 1)(v, f"{field}.{k}")
        else:
            _fail(field, f"plain data (strings, numbers, lists and maps, {depth} levels at most)", value)
    return check


def record(fields: dict[str, Check], optional: frozenset[str] = frozenset(), others: Check | None = None) -> Check:
    """A map with these keys (those in `optional` may be absent), each checked; any other key is
    refused, or checked with `others` where given."""
    def check(value: Any, field: str) -> None:
        prefix = f"{field}." if field else ""
        if not isinstance(value, dict):
            _fail(field or "the manifest", "a map", value)
        unknown = sorted(map(str, set(value) - set(fields)))
        if unknown and others is None:
            raise ArtifactError(f"{prefix}{unknown[0]}: unknown field")
        for name in unknown:
            others(value[name], prefix + name)  # type: ignore[misc]
        for name, check_field in fields.items():
            if name in value:
                check_field(value[name], prefix + name)
            elif name not in optional:
                raise ArtifactError(f"{prefix}{name}: missing")
    return check


def of_dataclass(cls: type, special: dict[str, Check]) -> Check:
    """The record of a config dataclass's fields, every one (the builder writes them all): special
    ones as given, other int fields counts in [1, MAX_COUNT], bool fields booleans."""
    fields = {}
    for f in dataclasses.fields(cls):
        if f.name in special:
            fields[f.name] = special[f.name]
        elif f.type in ("int", int):
            fields[f.name] = integer(1)
        elif f.type in ("bool", bool):
            fields[f.name] = boolean
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: give its check ({f.type})")
    return record(fields)


def _fp8_parts(value: Any, field: str) -> None:
    """weights.fp8: the e4m3 linear layers, each of FP8_PARTS at most once (cpp_dag/artifact_loader.cpp
    checks the same)."""
    array(text(FP8_PARTS), 0, len(FP8_PARTS))(value, field)
    if len(set(value)) != len(value):
        _fail(field, f"distinct parts of {', '.join(FP8_PARTS)}", value)


_NODE = record({
    "name": text(), "type": text(NODE_TYPES), "inputs": array(text()), "outputs": array(text()),
    "attrs": record({"layer": integer(0), "step": integer(0), "max_rows": integer(0), "mode": text(),
                     "precision": text(), "weight": text()},
                    optional=frozenset({"layer", "step", "max_rows", "mode", "precision", "weight"})),
})

def _padding(value: Any, field: str) -> None:
    """A padding share (None where a kind had no request)."""
    if value is not None:
        number(0, 1e6, open_lo=False)(value, field)


# bucket_origin (service/loadgen/tiers.py): what ModelInfo reads of it is checked, the rest is plain data
_SHARE = record({"padding": _padding}, others=plain())
_BUCKET_ORIGIN = record({
    "source": text(), "log_sha256": sha256_hex, "log_requests": integer(0),
    "kinds": mapping(text(), record({"requests": integer(0), "packed": record({"batches": integer(0), "padding": _padding},
                                                                               others=plain()),
                                     "alone": _SHARE, "default_packed": _SHARE}, others=plain())),
}, optional=frozenset({"log_sha256", "log_requests", "kinds"}), others=plain())

# the acceptance record's reference (service/artifact/acceptance.py; `slmrank evaluate` writes it): the
# C++ loader checks the same fields (cpp_dag/artifact_loader.cpp kAcceptanceSchema) and the file's sha256
_ACCEPTANCE = record({"file": text((ACCEPTANCE,)), "sha256": sha256_hex, "passed": boolean,
                      "baseline_sha256": sha256_hex, "requests_sha256": sha256_hex, "date": text()})

SCHEMA = record({
    "format": text((FORMAT,)),
    "format_version": integer(1),
    "source": text(),
    "model": of_dataclass(ModelConfig, {
        "arch": text(SUPPORTED_ARCHS), "vocab_size": integer(1, MAX_VOCAB), "num_labels": integer(0),
        "rope_theta": number(0, 1e12), "rms_norm_eps": number(0, 1)}),
    "limits": of_dataclass(ServingLimits, {}),
    "buckets": record({"score": array(of_dataclass(ScoreBucket, {}), 1),
                       "beam": array(of_dataclass(BeamBucket, {}), 1)}),
    "dags": record({"score": array(_NODE, 1), "beam": array(_NODE)}),  # a classification head has no beam DAG
    "weights": record({"file": text((WEIGHTS,)), "dtype": text(WEIGHT_DTYPES), "sha256": sha256_hex,
                       "fp8": _fp8_parts, "fp8_min_rows": mapping(text(FP8_PARTS), integer(1), 3),
                       "fp8_measured": plain()},  # `--fp8 auto`'s timings (service/artifact/fp8_measure.py)
                      optional=frozenset({"fp8_min_rows", "fp8_measured"})),
    "tokenizer": record({"kind": text(), "files": mapping(file_name, sha256_hex)}),
    "build_seconds": number(0, 1e7, open_lo=False),
    "bucket_origin": _BUCKET_ORIGIN,
    "catalogs": array(record({
        "name": text(), "file": file_name, "sha256": sha256_hex, "items_file": file_name, "items_sha256": sha256_hex,
        "num_items": integer(1, MAX_ITEMS), "code_length": integer(1), "version": text(), "layout": text(("csr",)),
        "layout_bytes": array(record({"level": integer(0), "nodes": integer(1, MAX_ITEMS), "edges": integer(0, MAX_ITEMS),
                                      "dense_bytes": integer(0, 1 << 48), "csr_bytes": integer(0, 1 << 48)}))})),
    "acceptance": _ACCEPTANCE,
}, optional=frozenset({"acceptance"}))


# ---- on disk ---------------------------------------------------------------------------------------

def write_manifest(out: Path, manifest: dict[str, Any] | bytes) -> str:
    """Writes the manifest (bytes: as they are, packed already or no manifest at all) and its
    digest; returns the digest."""
    raw = manifest if isinstance(manifest, bytes) else msgpack.packb(manifest)
    digest = hashlib.sha256(raw).hexdigest()
    (out / MANIFEST).write_bytes(raw)
    (out / MANIFEST_SHA256).write_text(f"{digest}  {MANIFEST}\n")
    return digest


def read_manifest(path: Path, format_version: int) -> tuple[dict[str, Any], str]:
    """(the manifest of the artifact directory `path`, checked against SCHEMA; its sha256)."""
    mpath = path / MANIFEST
    if not mpath.exists():
        raise ArtifactError(f"{path}: not an artifact (no {MANIFEST}); build one with `slmrank build`")
    if not (path / MANIFEST_SHA256).exists():
        raise ArtifactError(f"{path / MANIFEST_SHA256}: missing (artifacts of format_version 8 and later have it); "
                            "rebuild the artifact with `slmrank build`")
    sidecar = read_bounded(path / MANIFEST_SHA256, 128, ArtifactError)
    if not (found := _SIDECAR.fullmatch(sidecar)):
        raise ArtifactError(f"{path / MANIFEST_SHA256}: not a sha256 line for {MANIFEST} "
                            "(<64 lower-case hex digits>, two spaces, the name)")
    want = found.group(1).decode()
    raw = read_bounded(mpath, MAX_MANIFEST_BYTES, ArtifactError)
    if (digest := hashlib.sha256(raw).hexdigest()) != want:
        raise ArtifactError(f"{mpath}: sha256 mismatch ({MANIFEST_SHA256} {want[:12]}…, file {digest[:12]}…): "
                            "the manifest is corrupted or was modified")
    try:
        m = msgpack.unpackb(raw)
    except Exception as e:  # noqa: BLE001 -- msgpack raises several unrelated types on corrupt input
        raise ArtifactError(f"{mpath}: corrupted manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"{mpath}: not a {FORMAT} manifest")
    if m.get("format_version") != format_version:
        raise ArtifactError(f"{mpath}: format_version {m.get('format_version')!r} is not supported "
                            f"(this slmrank reads version {format_version}); rebuild the artifact")
    try:
        SCHEMA(m, "")
    except ArtifactError as e:
        raise ArtifactError(f"{mpath}: {e}") from None
    return m, digest

