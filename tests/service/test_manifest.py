"""The manifest is verified before it is used, on both loaders (issue 32, point 8): the Python one
(service/artifact/manifest.py, which every runtime's start-up goes through) and the C++ one
(cpp_dag/artifact_loader.cpp, which the C++ executor loads from).

- every random bit flip of every file of an artifact is refused in one line naming the file;
- a tampered manifest (one byte of a key, as in issue 32) is refused by its hash before it is
  decoded; edited with its digest rewritten, by the schema, naming the field;
- each field's type and range is checked, the error naming the field; random values put into random
  fields of the manifest (its digest rewritten) are refused in one line, never another exception;
- manifest.sha256 must be one sha256sum line for the manifest, and a regular file.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from cpp_dag import _core as core
from service.artifact.artifact import MANIFEST, WEIGHTS, ArtifactError, load_artifact
from service.artifact.manifest import MANIFEST_SHA256, MAX_COUNT, write_manifest

CPP_FILES = (MANIFEST, MANIFEST_SHA256, WEIGHTS)  # what the C++ loader reads (not the tokenizer)


@pytest.fixture(scope="module")
def source(qwen2_tiny) -> Path:
    return qwen2_tiny.artifact.path


@pytest.fixture
def art(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "art"))


def _refusals(art: Path, verify: bool = True) -> tuple[str | None, str | None]:
    """(the Python loader's ArtifactError, the C++ loader's ValueError), None where it loaded. Any
    other exception fails the test."""
    python = cpp = None
    try:
        load_artifact(art, verify=verify)
    except ArtifactError as e:
        python = str(e)
    try:
        core.load_artifact(str(art), "cpu", None, verify)
    except ValueError as e:
        cpp = str(e)
    for message in (python, cpp):
        assert message is None or "\n" not in message, message
    return python, cpp


def _edit(art: Path, field: str | tuple[str | int, ...], value: Any, *, rewrite_digest: bool = True) -> None:
    """Sets the field ("dags.beam.3.attrs.layer", or its keys) to value (DELETE: removes it)."""
    m = msgpack.unpackb((art / MANIFEST).read_bytes())
    keys = field if isinstance(field, tuple) else [int(k) if k.isdigit() else k for k in field.split(".")]
    *path, last = keys
    node = m
    for key in path:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    if rewrite_digest:
        write_manifest(art, m)
    else:
        (art / MANIFEST).write_bytes(msgpack.packb(m))


DELETE = object()


# ---- bit flips ------------------------------------------------------------------------------------

def test_every_bit_flip_of_every_file_is_refused_in_one_line(art: Path) -> None:
    """Issue 32: of 173 flipped artifacts, 23 gave a traceback on the Python runtime and 8 on the C++
    one; 16 of 120 flips of the manifest loaded. Here 16 flips of each file, seeded."""
    rng = random.Random(32)
    files = sorted(p for p in art.rglob("*") if p.is_file())
    assert {MANIFEST, MANIFEST_SHA256, WEIGHTS} <= {p.name for p in files} and len(files) >= 4
    for path in files:
        data = path.read_bytes()
        for _ in range(16):
            bit = rng.randrange(8 * len(data))
            flipped = bytearray(data)
            flipped[bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(flipped)
            python, cpp = _refusals(art)
            assert python is not None and str(art) in python, (path.name, bit, python)
            if path.name in CPP_FILES:
                assert cpp is not None and str(art) in cpp, (path.name, bit, cpp)
        path.write_bytes(data)
    assert _refusals(art) == (None, None)


# ---- a tampered manifest ----------------------------------------------------------------------------

def test_a_tampered_manifest_is_refused_by_its_hash_before_it_is_decoded(art: Path) -> None:
    """Issue 32: a manifest whose key `sha256` was renamed (one byte) ended in a 29-line KeyError."""
    raw = (art / MANIFEST).read_bytes()
    (art / MANIFEST).write_bytes(raw.replace(b"\xa6sha256", b"\xa6sha257", 1))
    python, cpp = _refusals(art)
    for message in (python, cpp):
        assert message is not None and message.startswith(f"{art / MANIFEST}: sha256 mismatch ({MANIFEST_SHA256} ")
        assert message.endswith("the manifest is corrupted or was modified"), message
    # edited by hand, its digest rewritten too: the schema names the field
    write_manifest(art, (art / MANIFEST).read_bytes())
    python, cpp = _refusals(art)
    assert python == f"{art / MANIFEST}: weights.sha257: unknown field", python
    assert cpp is not None and "no weights.sha256" in cpp, cpp


@pytest.mark.parametrize("sidecar, words", [
    (None, f"{MANIFEST_SHA256}: missing (artifacts of format_version 8 and later have it); rebuild the artifact"),
    ("", "not a sha256 line"),
    ("{upper}  manifest.msgpack\n", "not a sha256 line"),
    ("{digest} manifest.msgpack\n", "not a sha256 line"),  # one space
    ("{digest}  other.msgpack\n", "not a sha256 line"),
    ("{digest}  manifest.msgpack\n\n", "not a sha256 line"),
    ("/dev/zero", "regular file"),
], ids=["missing", "empty", "upper-case", "one-space", "other-name", "two-lines", "dev-zero"])
def test_the_digest_is_one_sha256sum_line_in_a_regular_file(art: Path, sidecar: str | None, words: str) -> None:
    digest = hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()
    (art / MANIFEST_SHA256).unlink()
    if sidecar == "/dev/zero":
        (art / MANIFEST_SHA256).symlink_to(sidecar)
    elif sidecar is not None:
        (art / MANIFEST_SHA256).write_text(sidecar.format(digest=digest, upper=digest.upper()))
    python, cpp = _refusals(art)
    for message in (python, cpp):
        assert message is not None and MANIFEST_SHA256 in message and words in message, message


def test_the_digest_is_what_sha256sum_checks(art: Path) -> None:
    import subprocess

    done = subprocess.run(["sha256sum", "-c", MANIFEST_SHA256], cwd=art, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"{MANIFEST}: OK", done.stdout + done.stderr


# ---- the schema ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("model.vocab_size", -1, "model.vocab_size: must be an integer in [1, 4194304], got -1"),
    ("model.vocab_size", 1 << 40, "model.vocab_size: must be an integer in [1, 4194304], got 1099511627776"),
    ("model.hidden_size", True, "model.hidden_size: must be an integer in [1, 1048576], got True"),
    ("model.num_layers", "two", "model.num_layers: must be an integer in [1, 1048576], got 'two'"),
    ("model.num_labels", -3, "model.num_labels: must be an integer in [0, 1048576], got -3"),
    ("model.rms_norm_eps", math.nan, "model.rms_norm_eps: must be a number in (0, 1], got nan"),
    ("model.rms_norm_eps", 0.0, "model.rms_norm_eps: must be a number in (0, 1], got 0"),
    ("model.rope_theta", "1e6", "model.rope_theta: must be a number in (0, 1000000000000], got '1e6'"),
    ("model.attention_bias", 1, "model.attention_bias: must be true or false, got 1"),
    ("limits.max_score_tokens", 1 << 30, "limits.max_score_tokens: must be an integer in [1, 1048576]"),
    ("limits.max_new_tokens", DELETE, "limits.max_new_tokens: missing"),
    ("weights.sha256", "ab", "weights.sha256: must be 64 lower-case hex digits, got 'ab'"),
    ("weights.dtype", "int4", "weights.dtype: must be one of float32, bfloat16, float16, got 'int4'"),
    ("weights.fp8", ["mlp", "bogus"], "weights.fp8[1]: must be one of mlp, attn, head, got 'bogus'"),
    ("weights.fp8", ["attn", "attn"], "weights.fp8: must be distinct parts of mlp, attn, head"),
    ("weights.fp8", "mlp", "weights.fp8: must be an array of 0 to 3 items"),
    ("weights.fp8", DELETE, "weights.fp8: missing"),
    ("dags.beam.3.attrs.layer", -5, "dags.beam[3].attrs.layer: must be an integer in [0, 1048576], got -5"),
], ids=lambda v: str(v)[:24])
def test_a_field_of_the_wrong_type_or_range_is_refused_naming_it(art: Path, field: str, value: Any,
                                                                 words: str) -> None:
    _edit(art, field, value)
    python, cpp = _refusals(art, verify=False)
    assert python is not None and python.startswith(f"{art / MANIFEST}: {words}"), python
    name = words.split(":")[0]
    assert cpp is not None and (f"{name}: must be" in cpp or f"no {name}" in cpp or f"{name}: '" in cpp), cpp


@pytest.mark.parametrize("field, value, words", [
    ("buckets.score.0.max_tokens", 0, "buckets.score[0].max_tokens: must be an integer in [1, 1048576], got 0"),
    ("buckets.beam", [], "buckets.beam: must be an array of 1 to 1048576 items"),
    ("tokenizer.files", {"../x": "0" * 64}, "tokenizer.files key: must be a path inside the artifact directory"),
    ("build_seconds", -1, "build_seconds: must be a number in [0, 10000000], got -1"),
    ("source", 7, "source: must be a string of 1 to 4096 characters, got 7"),
    ("extra", {"nested": [1, 2]}, "extra: unknown field"),
    ("bucket_origin.source", 7, "bucket_origin.source: must be a string of 1 to 4096 characters, got 7"),
    ("bucket_origin.kinds", {"score": {"requests": 3, "packed": {"batches": 1, "padding": "x"},
                                       "alone": {"padding": 0.1}, "default_packed": {"padding": None}}},
     "bucket_origin.kinds.score.packed.padding: must be a number in [0, 1000000], got 'x'"),
    ("bucket_origin.budget", {"max_graphs": b"\x00"}, "bucket_origin.budget.max_graphs: must be plain data"),
], ids=lambda v: str(v)[:24])
def test_fields_only_the_python_loader_reads_are_checked_there(art: Path, field: str, value: Any,
                                                               words: str) -> None:
    """The C++ loader reads the model, limits, DAGs and weights; the Python one, every runtime's
    start-up, the rest too."""
    _edit(art, field, value)
    python, cpp = _refusals(art, verify=False)
    assert python is not None and python.startswith(f"{art / MANIFEST}: {words}"), python
    assert cpp is None


def _fields(node: Any, keys: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """The keys of every field of a manifest, containers included."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [keys] + [field for k, v in items for field in _fields(v, (*keys, k))]


# values no field of the manifest may hold (DELETE: every field but a node's attrs is required)
INVALID = (None, -1, 1 << 63, -(1 << 63), math.inf, math.nan, "", "x" * 5000, b"\x00", [[[]]], {"k": None}, DELETE)


def test_an_invalid_value_in_any_field_is_refused_in_one_line(art: Path) -> None:
    """A manifest edited with its digest rewritten: 300 random fields, each given a value no field
    may hold, are each refused in one line by the Python loader (every field), and by the C++ one
    where the field is one it checks (model, limits, weights); no other exception."""
    rng = random.Random(8)
    original = (art / MANIFEST).read_bytes()
    fields = [f for f in _fields(msgpack.unpackb(original)) if f and f[0] not in ("format", "format_version")]
    for _ in range(300):
        field, value = rng.choice(fields), rng.choice(INVALID)
        if value is DELETE and ("attrs" in field[:-1] or isinstance(field[-1], int)):
            continue  # a node's attrs are optional; an array item less can be right
        write_manifest(art, original)
        _edit(art, field, value)
        python, cpp = _refusals(art, verify=False)
        assert python is not None and python.startswith(f"{art / MANIFEST}: "), (field, value, python)
        if field[0] in ("model", "limits", "weights"):
            assert cpp is not None and cpp.startswith(f"{art / MANIFEST}: "), (field, value, cpp)
    assert MAX_COUNT == 1 << 20  # cpp_dag/artifact_loader.cpp kMaxCount


# ---- the acceptance record (`slmrank evaluate`) -----------------------------------------------------

def _record(**changes: Any) -> dict[str, Any]:
    rec = {"format": "slmrank-acceptance", "version": 1, "passed": False, "date": "2025-01-02T03:04:05Z",
           "baseline": {"sha256": "a" * 64, "path": "/x"}, "candidate": {"sha256": "b" * 64},
           "requests": {"sha256": "c" * 64, "score": 3, "beam": 1}, "tolerances": {"max_abs_logprob": 0.5},
           "checks": [{"name": "answers", "bound": "max", "limit": 0, "value": 0, "passed": True},
                      {"name": "max_abs_logprob", "bound": "max", "limit": 0.5, "value": math.inf, "passed": False},
                      {"name": "min_beam_overlap", "bound": "min", "limit": 0.8, "value": None, "passed": True}]}
    rec.update(changes)
    return rec


def test_an_acceptance_record_is_covered_by_the_manifest_on_both_loaders(art: Path) -> None:
    """record_acceptance writes acceptance.json and its sha256 into the manifest (the digest
    rewritten): both loaders load it, the Python one reads it back (inf as "inf"); every bit flip
    of the record is refused by both, naming the file."""
    from service.artifact.artifact import record_acceptance

    digest = record_acceptance(art, _record())
    assert digest == hashlib.sha256((art / MANIFEST).read_bytes()).hexdigest()
    assert _refusals(art) == (None, None)
    loaded = load_artifact(art)
    entry = loaded.manifest["acceptance"]
    record_sha256 = hashlib.sha256((art / "acceptance.json").read_bytes()).hexdigest()
    assert entry == {"file": "acceptance.json", "sha256": record_sha256, "passed": False, "baseline_sha256": "a" * 64,
                     "requests_sha256": "c" * 64, "date": "2025-01-02T03:04:05Z"}
    assert loaded.acceptance is not None and loaded.acceptance["checks"][1]["value"] == "inf"
    data = (art / "acceptance.json").read_bytes()
    rng = random.Random(29)
    for _ in range(16):
        bit = rng.randrange(8 * len(data))
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        (art / "acceptance.json").write_bytes(flipped)
        python, cpp = _refusals(art)
        for message in (python, cpp):
            assert message is not None and f"{art / 'acceptance.json'}: sha256 mismatch" in message, (bit, message)
    (art / "acceptance.json").unlink()
    python, cpp = _refusals(art)
    assert python is not None and "acceptance.json" in python and cpp is not None and "acceptance.json" in cpp


@pytest.mark.parametrize("field, value, words", [
    ("acceptance.passed", 1, "acceptance.passed: must be true or false, got 1"),
    ("acceptance.sha256", "ab", "acceptance.sha256: must be 64 lower-case hex digits, got 'ab'"),
    ("acceptance.baseline_sha256", DELETE, "acceptance.baseline_sha256: missing"),
    ("acceptance.requests_sha256", 7, "acceptance.requests_sha256: must be 64 lower-case hex digits, got 7"),
    ("acceptance.file", "../a.json", "acceptance.file: must be one of acceptance.json, got '../a.json'"),
    ("acceptance", 7, "acceptance: must be a map, got 7"),
], ids=lambda v: str(v)[:24])
def test_an_acceptance_entry_of_the_wrong_type_is_refused_by_both_naming_it(art: Path, field: str, value: Any,
                                                                            words: str) -> None:
    from service.artifact.artifact import record_acceptance

    record_acceptance(art, _record())
    _edit(art, field, value)
    python, cpp = _refusals(art, verify=False)
    assert python is not None and python.startswith(f"{art / MANIFEST}: {words}"), python
    name = words.split(":")[0]
    assert cpp is not None and (f"{name}: must be" in cpp or f"no {name}" in cpp), cpp


def test_the_record_itself_is_checked_by_the_python_loader(art: Path) -> None:
    """A record whose hash is right but whose content is not one (edited, its sha256 rewritten
    into the manifest): the Python loader, which reads it, refuses it naming file and field; the
    C++ one reads only the manifest's entry. An unknown entry field: the Python schema's refusal."""
    from service.artifact.acceptance import ArtifactError as AcceptanceError, record_bytes
    from service.artifact.artifact import record_acceptance

    record_acceptance(art, _record())
    bad = _record(checks=[{"name": "answers", "bound": "between", "limit": 0, "value": 0, "passed": True}])
    raw = json.dumps(bad).encode()
    (art / "acceptance.json").write_bytes(raw)
    _edit(art, "acceptance.sha256", hashlib.sha256(raw).hexdigest())
    python, cpp = _refusals(art)
    assert python == f"{art / 'acceptance.json'}: checks[0].bound: must be one of max, min, got 'between'", python
    assert cpp is None
    record_acceptance(art, _record())
    # nothing is written that the loader would refuse
    before = (art / MANIFEST).read_bytes(), (art / "acceptance.json").read_bytes()
    with pytest.raises(AcceptanceError, match=r"acceptance.json: checks: must be an array of 1 to"):
        record_bytes(_record(checks=[]))
    with pytest.raises(AcceptanceError, match=r"acceptance.json: checks\[0\].value: must be a finite number"):
        record_acceptance(art, _record(checks=[{"name": "a", "bound": "max", "limit": 0, "value": "x",
                                                "passed": True}]))
    assert ((art / MANIFEST).read_bytes(), (art / "acceptance.json").read_bytes()) == before
    _edit(art, "acceptance.extra", 1)
    assert _refusals(art) == (f"{art / MANIFEST}: acceptance.extra: unknown field", None)
