"""The deployment artifact: what the manifest holds, and refusing corrupted, mismatched or missing files."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import msgpack
import pytest
import torch

from service.artifact.artifact import (FORMAT, FORMAT_VERSION, MANIFEST, WEIGHTS, ArtifactError, build_artifact,
                              load_artifact, sha256_file)
from service.artifact.manifest import MANIFEST_SHA256, write_manifest
from service.model.checkpoint import EMBEDDED, expected_shapes
from service.cli import main as cli_main
from service.model.config import ServingLimits
from service.artifact.dag import NODE_TYPES


def _clone(src: Path, dst: Path, copy: tuple[str, ...] = ()) -> Path:
    """A copy of an artifact dir: files named in `copy` are real copies, the others symlinks."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if str(rel) in copy:
            shutil.copyfile(path, target)
        else:
            os.symlink(path, target)
    return dst


def _manifest(d: Path) -> dict:
    return msgpack.unpackb((d / MANIFEST).read_bytes())


def _write_manifest(d: Path, m: dict | bytes) -> None:
    (d / MANIFEST).unlink()  # a link into the original (_clone)
    (d / MANIFEST_SHA256).unlink()
    write_manifest(d, m)


# ---- a good artifact --------------------------------------------------------------------------

def test_load_ok_and_weights_match_the_config(embedded_tiny):
    path, art = embedded_tiny
    assert art.config == EMBEDDED["tiny"].config
    w = art.load_weights()
    assert set(w) == set(expected_shapes(art.config))
    assert all(tuple(w[k].shape) == s for k, s in expected_shapes(art.config).items())
    assert {t.dtype for t in w.values()} == {torch.float32}


def test_manifest_contents(embedded_tiny):
    path, art = embedded_tiny
    m = _manifest(path)
    assert m["format"] == FORMAT and m["format_version"] == FORMAT_VERSION
    assert m["model"] == EMBEDDED["tiny"].config.to_dict()
    assert m["limits"] == art.limits.to_dict()
    # both DAGs, as node lists of known types, and every layer appears in each
    for name in ("score", "beam"):
        nodes = m["dags"][name]
        assert nodes, f"empty {name} DAG"
        assert {n["type"] for n in nodes} <= set(NODE_TYPES)
        layers = {n["attrs"]["layer"] for n in nodes if n["type"] == "decoder_layer"}
        assert layers == set(range(art.config.num_layers))
    beam_steps = {n["attrs"].get("step", 0) for n in m["dags"]["beam"]}
    assert beam_steps == set(range(art.limits.max_new_tokens))
    # bucket table
    assert m["buckets"]["score"] and m["buckets"]["beam"]
    assert {b["new_tokens"] for b in m["buckets"]["beam"]} == set(range(1, art.limits.max_new_tokens + 1))
    # hashes of the weights and of every tokenizer file, equal to the files on disk
    assert m["weights"]["file"] == WEIGHTS
    assert m["weights"]["sha256"] == sha256_file(path / WEIGHTS)
    files = m["tokenizer"]["files"]
    assert files, "no tokenizer files in the manifest"
    for rel, digest in files.items():
        assert len(digest) == 64
        assert hashlib.sha256((path / "tokenizer" / rel).read_bytes()).hexdigest() == digest


def test_embedded_weights_are_deterministic(embedded_tiny, tmp_path):
    path, _ = embedded_tiny
    again = build_artifact("embedded:tiny", tmp_path / "again", quiet=True)
    assert sha256_file(again / WEIGHTS) == sha256_file(path / WEIGHTS)
    assert _manifest(again)["weights"]["sha256"] == _manifest(path)["weights"]["sha256"]


# ---- corrupted or mismatched artifacts --------------------------------------------------------

def test_flipped_weight_byte_is_refused(embedded_tiny, tmp_path):
    path, _ = embedded_tiny
    d = _clone(path, tmp_path / "a", copy=(WEIGHTS,))
    size = (d / WEIGHTS).stat().st_size
    with open(d / WEIGHTS, "r+b") as fh:
        fh.seek(size // 2)
        b = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ArtifactError) as ei:
        load_artifact(d)
    assert WEIGHTS in str(ei.value) and "sha256" in str(ei.value)


def test_modified_tokenizer_file_is_refused(embedded_tiny, tmp_path):
    path, _ = embedded_tiny
    rel = sorted(_manifest(path)["tokenizer"]["files"])[0]
    d = _clone(path, tmp_path / "a", copy=(f"tokenizer/{rel}",))
    with open(d / "tokenizer" / rel, "ab") as fh:
        fh.write(b" ")
    with pytest.raises(ArtifactError) as ei:
        load_artifact(d)
    assert Path(rel).name in str(ei.value) and "sha256" in str(ei.value)


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "not_a_map", "other_format", "missing_keys"])
def test_bad_manifest_is_refused(embedded_tiny, tmp_path, how):
    path, _ = embedded_tiny
    d = _clone(path, tmp_path / "a")
    raw = (d / MANIFEST).read_bytes()
    if how == "truncated":
        data = raw[: len(raw) // 2]
    elif how == "garbage":
        data = bytes(range(256)) * 4
    elif how == "empty":
        data = b""
    elif how == "not_a_map":
        data = msgpack.packb([1, 2, 3])
    elif how == "other_format":
        m = msgpack.unpackb(raw)
        m["format"] = "something-else"
        data = msgpack.packb(m)
    else:
        m = msgpack.unpackb(raw)
        del m["dags"]
        data = msgpack.packb(m)
    _write_manifest(d, data)  # with its digest: the decoder and the schema see it
    with pytest.raises(ArtifactError) as ei:
        load_artifact(d)
    assert MANIFEST in str(ei.value) and "sha256" not in str(ei.value)


def test_wrong_format_version_is_refused(embedded_tiny, tmp_path):
    path, _ = embedded_tiny
    d = _clone(path, tmp_path / "a")
    m = _manifest(path)
    m["format_version"] = FORMAT_VERSION + 41
    _write_manifest(d, m)
    with pytest.raises(ArtifactError) as ei:
        load_artifact(d)
    msg = str(ei.value)
    assert "format_version" in msg and str(FORMAT_VERSION + 41) in msg and str(FORMAT_VERSION) in msg


def test_missing_files_are_refused(embedded_tiny, tmp_path):
    path, _ = embedded_tiny
    d = _clone(path, tmp_path / "noweights")
    (d / WEIGHTS).unlink()
    with pytest.raises(ArtifactError) as ei:
        load_artifact(d)
    assert WEIGHTS in str(ei.value) and "missing" in str(ei.value)

    d = _clone(path, tmp_path / "nomanifest")
    (d / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=MANIFEST):
        load_artifact(d)

    rel = sorted(_manifest(path)["tokenizer"]["files"])[0]
    d = _clone(path, tmp_path / "notok")
    (d / "tokenizer" / rel).unlink()
    with pytest.raises(ArtifactError, match="missing"):
        load_artifact(d)


# ---- bad sources --------------------------------------------------------------------------------

def test_checkpoint_without_config_json(qwen2_tiny, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(qwen2_tiny.ckpt, d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_artifact(str(d), tmp_path / "out", quiet=True)
    assert cli_main(["build", "--model", str(d), "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_checkpoint_without_safetensors(qwen2_tiny, tmp_path, capsys):
    d = tmp_path / "ckpt"
    shutil.copytree(qwen2_tiny.ckpt, d)
    for p in d.glob("*.safetensors"):
        p.unlink()
    (d / "pytorch_model.bin").write_bytes(b"not loaded: pickles are never read")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        build_artifact(str(d), tmp_path / "out", quiet=True)
    assert cli_main(["build", "--model", str(d), "--out", str(tmp_path / "out2"), "--quiet"]) == 2
    assert "safetensors" in capsys.readouterr().err


def test_not_a_directory_nor_spec(tmp_path):
    with pytest.raises(FileNotFoundError, match="embedded:"):
        build_artifact(str(tmp_path / "does-not-exist"), tmp_path / "out", quiet=True)


def test_unknown_embedded_spec_lists_known_ones(tmp_path, capsys):
    with pytest.raises(ValueError) as ei:
        build_artifact("embedded:qwen9-huge", tmp_path / "out", quiet=True)
    msg = str(ei.value)
    assert "embedded:qwen9-huge" in msg
    for name in EMBEDDED:
        assert f"embedded:{name}" in msg
    assert cli_main(["build", "--model", "embedded:nope", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "embedded:tiny" in capsys.readouterr().err


def test_manifest_config_not_matching_the_weights_is_refused(embedded_tiny, tmp_path):
    """A manifest whose model config does not describe its weights never reaches a runtime."""
    from service.model.config import ConfigError
    from service.runtime.python_runtime import PythonRuntime

    path, _ = embedded_tiny
    d = _clone(path, tmp_path / "a")
    m = _manifest(path)
    m["model"]["intermediate_size"] = m["model"]["intermediate_size"] * 2
    _write_manifest(d, m)
    with pytest.raises((ArtifactError, ConfigError), match="wgu|wdown|shape"):
        PythonRuntime(load_artifact(d))


def test_build_flags_set_the_serving_limits(tmp_path, capsys):
    out = tmp_path / "limited"
    assert cli_main(["build", "--model", "embedded:tiny", "--out", str(out), "--max-prompt-tokens", "200",
                     "--max-beam-width", "16", "--max-new-tokens", "3", "--quiet"]) == 0
    art = load_artifact(out)
    assert (art.limits.max_prompt_tokens, art.limits.max_beam_width, art.limits.max_new_tokens) == (200, 16, 3)
    assert art.limits.max_samples == ServingLimits().max_samples  # the others keep their defaults
    assert max(b.beam_width for b in art.buckets.beam) == 16 and max(b.new_tokens for b in art.buckets.beam) == 3
    # prompt tiers of the 200-token limit (none of the default 1,024): one request of it fits alone
    assert 200 in {b.max_prompt_tokens for b in art.buckets.beam}
    assert all(128 <= b.max_prompt_tokens <= 200 * b.max_requests for b in art.buckets.beam)
    assert "max_prompt_tokens': 200" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value, words", [("--max-beam-width", "0", ["max_beam_width", "> 0"]),
                                                ("--max-prompt-tokens", "99999", ["max_prompt_tokens", "max_positions"])])
def test_a_bad_build_limit_is_one_line_and_exit_2(tmp_path, capsys, flag, value, words):
    assert cli_main(["build", "--model", "embedded:tiny", "--out", str(tmp_path / "x"), flag, value, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("slmrank build: error:") and all(w in err for w in words), err


def test_a_rebuild_into_the_directory_drops_its_acceptance_record(qwen2_tiny, tmp_path):
    """An acceptance record (`slmrank evaluate`) is of the artifact it measured: a build into the
    same directory leaves none behind."""
    from service.artifact.artifact import record_acceptance

    out = build_artifact(str(qwen2_tiny.ckpt), tmp_path / "art", quiet=True)
    record_acceptance(out, {"format": "slmrank-acceptance", "version": 1, "passed": True, "date": "2025-01-01T00:00:00Z",
                            "baseline": {"sha256": "a" * 64}, "candidate": {"sha256": "b" * 64},
                            "requests": {"sha256": "c" * 64}, "tolerances": {},
                            "checks": [{"name": "answers", "bound": "max", "limit": 0, "value": 0, "passed": True}]})
    assert load_artifact(out).acceptance is not None and (out / "acceptance.json").exists()
    build_artifact(str(qwen2_tiny.ckpt), out, quiet=True)
    assert load_artifact(out).acceptance is None and not (out / "acceptance.json").exists()
    assert "acceptance" not in _manifest(out)
