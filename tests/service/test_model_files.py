"""service/model/files.py: a checkpoint's small files are read only from regular files and never past
their size bound (issue 32, point 8). A config.json that is a link to /dev/zero or a FIFO is refused
unread (in a child process with a bounded address space and a timeout: the old read was endless); a
pickle named model.safetensors, a header larger than its file or than the format allows, and a
weight_map that leaves the checkpoint are each one ConfigError naming the file."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.model.checkpoint import iter_hf_weights, load_hf_config
from service.model.config import ConfigError
from service.model.files import MAX_JSON_BYTES, MAX_SAFETENSORS_HEADER_BYTES

ROOT = Path(__file__).resolve().parents[2]

# load_hf_config in a child whose address space may grow by 1 GiB at most once imported: an unbounded
# read of /dev/zero fails there (MemoryError) instead of taking the host's memory; a blocking one
# (a FIFO) ends at the parent's timeout
_LOAD_CONFIG = """
import resource, sys, time
from pathlib import Path
from service.model.checkpoint import load_hf_config
from service.model.config import ConfigError
vm_bytes = 1024 * int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmSize:")))
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (1 << 30), resource.RLIM_INFINITY))
t0 = time.monotonic()
try:
    load_hf_config(Path(sys.argv[1]))
except ConfigError as e:
    print(f"{time.monotonic() - t0:.3f} {e}")
"""


def _load_config_in_child(ckpt: Path) -> tuple[float, str]:
    """(seconds load_hf_config took, its ConfigError); the child must end within 60 s."""
    done = subprocess.run([sys.executable, "-c", _LOAD_CONFIG, str(ckpt)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout, done.stderr[-2000:]
    seconds, message = done.stdout.strip().split(" ", 1)
    return float(seconds), message


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, save_tiny_checkpoint) -> Path:
    _, path = save_tiny_checkpoint(tmp_path_factory.mktemp("files"), "ckpt", "qwen2", "Qwen2ForCausalLM", 5,
                                   vocab=512, max_pos=64)
    return path


def _copy(ckpt: Path, dst: Path) -> Path:
    shutil.copytree(ckpt, dst)
    return dst


@pytest.mark.parametrize("make, kind", [
    (lambda p: p.symlink_to("/dev/zero"), "a character device (a link to /dev/zero)"),
    (os.mkfifo, "a FIFO"),
], ids=["dev-zero", "fifo"])
def test_a_config_that_is_no_regular_file_is_refused_unread(tmp_path: Path, make, kind: str) -> None:
    (tmp_path / "ckpt").mkdir()
    make(tmp_path / "ckpt" / "config.json")
    seconds, message = _load_config_in_child(tmp_path / "ckpt")
    assert seconds < 1.0 and f"config.json: is {kind}; it must be a regular file" in message, message


def test_a_config_larger_than_a_config_is_refused_unread(ckpt: Path, tmp_path: Path) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    hf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf, "padding": "x" * MAX_JSON_BYTES}))  # valid, and too large
    with pytest.raises(ConfigError, match=r"config.json: \d+ bytes is more than such a file can be"):
        load_hf_config(d)


@pytest.mark.parametrize("config, words", [
    ("[1, 2]", "not a JSON object"),
    ('{"model_type": "qwen2"', "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ('{"model_type": "qwen2"}', "missing or malformed key (KeyError: 'num_attention_heads')"),
], ids=["array", "truncated", "not-utf8", "missing-key"])
def test_a_malformed_config_is_one_config_error(ckpt: Path, tmp_path: Path, config: str | bytes, words: str) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    (d / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(ConfigError) as e:
        load_hf_config(d)
    assert str(e.value).startswith(str(d / "config.json")) and words in str(e.value), e.value


def _weights(d: Path) -> Path:
    (path,) = d.glob("*.safetensors")
    return path


def _read_all(d: Path) -> None:
    for _ in iter_hf_weights(d, load_hf_config(d)):
        pass


def test_a_pickle_named_model_safetensors_is_one_clear_error(ckpt: Path, tmp_path: Path) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, _weights(d))  # a zip of pickles
    with pytest.raises(ConfigError, match="model.safetensors: not a safetensors file .*pickled weights are never"):
        _read_all(d)


@pytest.mark.parametrize("header_bytes, what", [
    (MAX_SAFETENSORS_HEADER_BYTES + 1, "a header of 100000001 bytes"),  # beyond the format's own limit
    (1 << 62, f"a header of {1 << 62} bytes"),
    (4096, "a header of 4096 bytes in a file of 24"),  # within the limit, longer than the file
], ids=["over-the-limit", "huge", "past-the-end"])
def test_a_safetensors_header_larger_than_it_can_be_is_refused_unread(ckpt: Path, tmp_path: Path,
                                                                      header_bytes: int, what: str) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    _weights(d).write_bytes(struct.pack("<Q", header_bytes) + b"{}" + b" " * 14)
    with pytest.raises(ConfigError, match=f"not a safetensors file \\({what}"):
        _read_all(d)


def test_a_safetensors_header_that_is_no_json_object_is_refused(ckpt: Path, tmp_path: Path) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    _weights(d).write_bytes(struct.pack("<Q", 4) + b"[1,]" + b"\0" * 16)
    with pytest.raises(ConfigError, match="its header is not a JSON object"):
        _read_all(d)


def test_a_corrupted_tensor_is_one_config_error_naming_it(ckpt: Path, tmp_path: Path) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    path = _weights(d)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 10 ** 9  # a tensor that ends past the file
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    with pytest.raises(ConfigError, match="not a readable safetensors file|cannot be read"):
        _read_all(d)


@pytest.mark.parametrize("weight_map", [
    {"model.embed_tokens.weight": "../outside.safetensors"},
    {"model.embed_tokens.weight": 7},
    ["model.safetensors"],
], ids=["leaves-the-checkpoint", "not-a-name", "not-a-map"])
def test_a_weight_map_must_name_files_of_the_checkpoint(ckpt: Path, tmp_path: Path, weight_map) -> None:
    d = _copy(ckpt, tmp_path / "ckpt")
    shutil.copy(_weights(d), tmp_path / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match="weight_map must map tensor names to file names"):
        _read_all(d)
