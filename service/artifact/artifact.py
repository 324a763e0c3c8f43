"""The deployment artifact: a directory with a msgpack manifest, safetensors weights and tokenizer files.

  DIR/manifest.msgpack   format + version, model config, limits, bucket table, the Score and
                         BeamSearch DAGs (precision per node), sha256 of every file, tokenizer ref
  DIR/manifest.sha256    the manifest's own sha256 (manifest.py: verified before it is decoded)
  DIR/weights.safetensors  (with `--fp8`: the chosen linear weights float8_e4m3fn + NAME.scale float32 [rows])
  DIR/tokenizer/...      tokenizer files (and their license notice)
  DIR/catalogs/...       each catalog's trie and item ids (service/artifact/catalog.py), optional
  DIR/acceptance.json    what `slmrank evaluate` found beside a baseline (service/artifact/acceptance.py), optional

Loading checks the manifest's hash, its format version and schema, every file's hash, and refuses a
corrupted or mismatched artifact in one ArtifactError,
or one whose files are not regular files (a link to /dev/zero, a FIFO: a load that could not finish).
"""

from __future__ import annotations

import dataclasses

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from . import acceptance
from .buckets import BucketTable, default_bucket_table
from .catalog import Catalog, CatalogError, build_catalog, load_catalog
from ..model.checkpoint import (FP8_PARTS, FULL, MIN_ROWS, check_weights, expected_shapes, fp8_min_rows, fp8_weight_names,
                                weight_floors, weight_source)
from ..model.config import ModelConfig, ServingLimits
from ..model.files import regular_size
from .manifest import (ACCEPTANCE, FORMAT, MANIFEST, WEIGHT_DTYPES, WEIGHTS, ArtifactError, read_manifest,
                       write_manifest)
from .dag import (BEAM_INPUTS, BEAM_OUTPUTS, SCORE_INPUTS, Node, beam_dag, check_dataflow, dag_from_list, dag_to_list,
                  score_dag)
from ..model.progress import Progress
from ..siblings import sibling

# kernels/ under this install's name (service/siblings.py): checkout and wheel name it differently
quantize_rows = sibling("kernels.fp8_linear").quantize_rows

FORMAT_VERSION = 13  # 2: Score request blocks; 3: varlen segment bounds; 4: every buffer declared, beam_state node;
# 5: key_ranges (the masks nodes' output, the score/prefill layers' input: the fused segment attention);
# 6: Score requests packed back to back (buckets by total tokens; request_rows, prefix_rows);
# 7: beam rows packed by each request's width (BeamBucket.max_rows; beam_slot, beam_src);
# 8: manifest.sha256 beside the manifest, verified before it is decoded; its fields checked against a schema;
# 9: catalogs (tries), beam_catalog input, beam_allowed nodes; 10: weights.fp8 (e4m3 linear layers + NAME.scale);
# 11: beam_codes (batches normalised over a catalog's code tokens: the constrained beam nodes' input)
# 12: beam_steps input, beam_hold nodes, held_seqs / held_scores outputs (a batch's requests of different new_tokens)
# 13: suffix_rows (beam_state, beam_step, decode layers): the fused path's suffix K/V is never reordered
DTYPES = dict(zip(WEIGHT_DTYPES, (torch.float32, torch.bfloat16, torch.float16)))

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "WEIGHTS", "Artifact", "ArtifactError", "build_artifact",
           "load_artifact", "record_acceptance", "regular_file_size", "sha256_file"]


def regular_file_size(path: Path) -> int:
    """The size of path, which must be a regular file once links are followed: a device
    (/dev/zero), a FIFO or a socket would make loading read forever, or wait forever."""
    return regular_size(path, ArtifactError)


def sha256_file(path: Path, chunk: int = 1 << 22, max_bytes: int | None = None) -> str:
    """Of at most max_bytes bytes (default: the size the file has now), so a file that keeps
    growing, or claims to be empty and is not (/proc), cannot make the read endless."""
    left = regular_file_size(path) if max_bytes is None else max_bytes
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while left > 0 and (block := fh.read(min(chunk, left))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ArtifactError(f"weights: unsupported dtype {dtype}")


@dataclass(frozen=True)
class Artifact:
    path: Path
    config: ModelConfig
    limits: ServingLimits
    buckets: BucketTable
    score_dag: list[Node]
    beam_dag: list[Node]
    weight_dtype: torch.dtype
    tokenizer: dict[str, Any]  # {"kind": ..., "files": {relpath: sha256}}
    manifest: dict[str, Any]
    catalogs: tuple[Catalog, ...] = ()  # a request's catalog index is its place here (the manifest's order)
    acceptance: dict[str, Any] | None = None  # the acceptance record (acceptance.py), None: none recorded

    @property
    def catalog_lengths(self) -> dict[str, int]:
        """Each catalog's name -> its code length (the new_tokens of a request that names it)."""
        return {cat.name: cat.code_length for cat in self.catalogs}

    @property
    def fp8(self) -> tuple[str, ...]:
        """The linear layers stored as float8_e4m3fn (parts of FP8_PARTS; `slmrank build --fp8`), () for none."""
        return tuple(self.manifest["weights"]["fp8"])

    @property
    def fp8_min_rows(self) -> dict[str, int]:
        """Each fp8 part's row floor (`slmrank build --fp8 PART:ROWS`): a GEMM of fewer activation rows
        runs on the weights' model-dtype copies. {} where every e4m3 GEMM always runs in FP8."""
        return dict(self.manifest["weights"].get("fp8_min_rows", {}))

    def load_weights(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """dtype: the other weights cast to it; the fp8 weights, their float32 scales and row floors
        stay as stored."""
        regular_file_size(self.path / WEIGHTS)  # a device or FIFO here would never finish loading
        weights = load_file(str(self.path / WEIGHTS), device=str(device))
        check_weights(self.config, weights, self.fp8)
        floors = self.fp8_min_rows
        if fp8_min_rows(weights) != weight_floors(self.config, floors):
            raise ArtifactError(f"{self.path / WEIGHTS}: the weights' fp8 row floors do not match the manifest's "
                                f"weights.fp8_min_rows {floors}")
        if dtype is not None:
            weights = {k: v.to(dtype) if v.is_floating_point() and v.dtype != torch.float8_e4m3fn
                       and not k.endswith(".scale") else v for k, v in weights.items()}
        return weights

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def label_columns(self) -> int:
        """Columns of a Score batch's labels and results: a classification head returns its one
        output row per sample; a causal LM up to max_labels label log-probs."""
        return 1 if self.config.has_cls_head else self.limits.max_labels


def build_artifact(model: str, out: str | Path, *, dtype: str = "auto", limits: ServingLimits | None = None,
                   buckets: BucketTable | None = None, quiet: bool = False,
                   limit_overrides: dict[str, int] | None = None, bucket_origin: dict[str, Any] | None = None,
                   catalogs: dict[str, str | Path] | None = None, fp8: tuple[str, ...] | list[str] = (),
                   fp8_min_rows: dict[str, int] | None = None, fp8_auto: bool = False) -> Path:
    """Builds DIR from an embedded spec or a local HF checkpoint. Returns the directory.
    limit_overrides: ServingLimits fields over the model's defaults (when `limits` is not given).
    bucket_origin: where `buckets` came from, recorded in the manifest (`slmrank build --traffic`:
    the log and the table's expected padding on it); default {"source": "default"}, or "given".
    catalogs: name -> catalog file (service/artifact/catalog.py), for constrained beam search.
    fp8: the linear layers to store as float8_e4m3fn (parts of FP8_PARTS: mlp, attn, head), each weight
    with its per-output-channel float32 scale (kernels/fp8_linear.py quantize_rows, from the source's values).
    fp8_min_rows: part -> row floor: that part's weights are kept in the model dtype too (NAME.full,
    NAME.min_rows), and a GEMM of fewer activation rows runs on them (`--fp8 mlp:2048`: FP8 where
    the GEMM is large enough to gain, docs/operations.md).
    fp8_auto: fp8 and fp8_min_rows chosen by timing the GEMMs at the buckets' rows on this machine's
    GPU (service/artifact/fp8_measure.py; `--fp8 auto`), the timings recorded in weights.fp8_measured."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, src_dtype, weights_iter = weight_source(model)
    limits = limits or ServingLimits.for_model(cfg, **(limit_overrides or {}))
    limits.check_positions(cfg)
    given_buckets = buckets is not None
    buckets = buckets or default_bucket_table(limits)
    buckets.fits_one(limits)
    measured = None
    if fp8_auto:
        if fp8 or fp8_min_rows:
            raise ArtifactError("fp8_auto chooses the parts and floors itself: give it no fp8 / fp8_min_rows")
        from .fp8_measure import choose_floors, measure, row_tiers

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with Progress("fp8 auto: time the GEMMs", sum(map(len, row_tiers(buckets).values())), quiet=quiet) as bar:
            measured = measure(cfg, buckets, device, lambda what: bar.advance(1, what))
        fp8, fp8_min_rows = choose_floors(measured["parts"])
    for part in fp8:
        if part not in FP8_PARTS:
            raise ArtifactError(f"fp8: {part!r} is not one of {', '.join(FP8_PARTS)}")
        if list(fp8).count(part) > 1:
            raise ArtifactError(f"fp8: {part!r} given twice")
    fp8 = tuple(part for part in FP8_PARTS if part in fp8)  # in one order
    floors = dict(fp8_min_rows or {})
    for part, rows in floors.items():
        if part not in fp8:
            raise ArtifactError(f"fp8_min_rows: {part!r} is not one of the fp8 parts {list(fp8) or 'none'}")
        if type(rows) is not int or rows < 1:
            raise ArtifactError(f"fp8_min_rows: {part}: a row floor must be an integer >= 1, got {rows!r}")
    floors = {part: floors[part] for part in fp8 if part in floors}  # in one order
    quantized = set(fp8_weight_names(cfg, fp8))
    floor_of = weight_floors(cfg, floors)
    target = None if dtype == "auto" else DTYPES.get(dtype)
    if dtype != "auto" and target is None:
        raise ArtifactError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")

    t0 = time.monotonic()
    weights: dict[str, torch.Tensor] = {}
    embed_src = None
    with Progress("build weights", len(expected_shapes(cfg)), quiet=quiet) as bar:
        for name, tensor in weights_iter():
            want = target or src_dtype or tensor.dtype
            if name in quantized:  # from the source's values, not the target dtype's
                weights[name], weights[name + ".scale"] = quantize_rows(tensor)
                if name in floor_of:  # below the floor the GEMM runs on the model-dtype copy
                    weights[name + FULL] = tensor.to(want).contiguous()
                    weights[name + MIN_ROWS] = _floor(floor_of[name])
            else:
                weights[name] = tensor.to(want).contiguous()
            if name == "embed":
                embed_src = tensor
            bar.advance(1, name)
    if "lm_head" in quantized and "lm_head" not in weights and embed_src is not None:
        # an fp8 head of tied embeddings: its own e4m3 table; the lookup keeps embed in the model dtype
        weights["lm_head"], weights["lm_head.scale"] = quantize_rows(embed_src)
        if "lm_head" in floor_of:
            weights["lm_head" + FULL] = weights["embed"].clone()
            weights["lm_head" + MIN_ROWS] = _floor(floor_of["lm_head"])
    del embed_src
    check_weights(cfg, weights, fp8)
    dtypes = {t.dtype for name, t in weights.items()
              if name not in quantized and not name.endswith((".scale", MIN_ROWS))}
    if len(dtypes) != 1:
        raise ArtifactError(f"weights: mixed dtypes {dtypes}; pass dtype=float32 or bfloat16")
    weight_dtype = dtypes.pop()
    save_file(weights, str(out / WEIGHTS), metadata={"format": FORMAT})
    (out / ACCEPTANCE).unlink(missing_ok=True)  # a record of an artifact built here before is not this one's
    del weights

    tok_dir = out / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok_kind, tok_files = _tokenizer_files(model)
    for rel, data in tok_files.items():
        (tok_dir / rel).write_bytes(data)

    catalog_entries = [build_catalog(name, file, cfg.vocab_size, out, quiet) for name, file in (catalogs or {}).items()]
    for entry in catalog_entries:
        if entry["code_length"] > limits.max_new_tokens:
            raise CatalogError(f"catalog {entry['name']}: codes of {entry['code_length']} tokens exceed "
                               f"max_new_tokens {limits.max_new_tokens}")
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "source": model,
        "model": cfg.to_dict(),
        "limits": limits.to_dict(),
        "buckets": buckets.to_dict(),
        "bucket_origin": bucket_origin or {"source": "given" if given_buckets else "default"},
        "dags": {"score": dag_to_list(score_dag(cfg, limits.max_score_tokens, fp8)),
                 "beam": dag_to_list(beam_dag(cfg, limits.max_new_tokens, bool(catalog_entries), fp8))},
        "catalogs": catalog_entries,
        "weights": {"file": WEIGHTS, "dtype": _dtype_name(weight_dtype), "sha256": sha256_file(out / WEIGHTS),
                    "fp8": list(fp8), **({"fp8_min_rows": floors} if floors else {}),
                    **({"fp8_measured": measured} if measured is not None else {})},
        "tokenizer": {"kind": tok_kind,
                      "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in tok_files.items()}},
        "build_seconds": round(time.monotonic() - t0, 3),
    }
    write_manifest(out, manifest)
    return out


def _floor(rows: int) -> torch.Tensor:
    return torch.tensor([rows], dtype=torch.int64)


def _tokenizer_files(model: str) -> tuple[str, dict[str, bytes]]:
    """The checkpoint's tokenizer.json when it has one, else the embedded Qwen vocabulary."""
    from ..model.tokenizer import load_tokenizer

    ckpt = Path(model)
    if not model.startswith("embedded:") and (ckpt / "tokenizer.json").exists():
        return "tokenizer.json", load_tokenizer(ckpt).files()
    return "qwen", load_tokenizer("qwen").files()


def load_artifact(path: str | Path, *, verify: bool = True) -> Artifact:
    """verify: also check the weights' and tokenizer files' hashes (the manifest's own always is)."""
    path = Path(path)
    m, _ = read_manifest(path, FORMAT_VERSION)  # its hash, format, version and schema: every field typed
    try:
        cfg = ModelConfig.from_dict(m["model"])
        limits = ServingLimits.from_dict(m["limits"])
        limits.check_positions(cfg)
        buckets = BucketTable.from_dict(m["buckets"])
        score, beam = dag_from_list(m["dags"]["score"]), dag_from_list(m["dags"]["beam"])
        check_dataflow(score, SCORE_INPUTS, ("scores",))
        check_dataflow(beam, BEAM_INPUTS, BEAM_OUTPUTS)
    except ValueError as e:  # what no single field shows: a config, bucket or DAG that does not hold together
        raise ArtifactError(f"{path / MANIFEST}: malformed manifest ({e})") from None
    if verify:
        _verify_file(path / m["weights"]["file"], m["weights"]["sha256"])
        for rel, digest in m["tokenizer"]["files"].items():
            _verify_file(path / "tokenizer" / rel, digest)
        for entry in m["catalogs"]:
            _verify_file(path / entry["file"], entry["sha256"])
            _verify_file(path / entry["items_file"], entry["items_sha256"])
    catalogs = tuple(load_catalog(path, entry) for entry in m["catalogs"])
    if catalogs:  # each catalog's requests normalised over its codes run in buckets of their own kind
        buckets = dataclasses.replace(buckets, codes=tuple((c.name, c.code_length) for c in catalogs))
    record = None
    if (entry := m.get("acceptance")) is not None:
        if verify:
            _verify_file(path / entry["file"], entry["sha256"])
        record = acceptance.read_record(path / entry["file"])
    return Artifact(path, cfg, limits, buckets, score, beam, DTYPES[m["weights"]["dtype"]], m["tokenizer"], m,
                    catalogs, record)


def record_acceptance(path: str | Path, record: dict[str, Any]) -> str:
    """Writes an acceptance record into the artifact directory (acceptance.json, replacing one
    there) and references it from the manifest, whose digest is rewritten with it (write_manifest);
    returns the manifest's new sha256. The manifest is read and verified first: a record is never
    added to an artifact that does not load."""
    path = Path(path)
    data = acceptance.record_bytes(record)  # ArtifactError for a record the loader would refuse: nothing written
    m, _ = read_manifest(path, FORMAT_VERSION)
    tmp = path / (ACCEPTANCE + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path / ACCEPTANCE)
    m["acceptance"] = acceptance.manifest_entry(record, hashlib.sha256(data).hexdigest())
    return write_manifest(path, m)


def _verify_file(path: Path, digest: str) -> None:
    actual = sha256_file(path)  # ArtifactError for a missing file or one that is not a regular file
    if actual != digest:
        raise ArtifactError(f"{path}: sha256 mismatch (manifest {digest[:12]}…, file {actual[:12]}…): "
                            "the artifact is corrupted or was modified")
