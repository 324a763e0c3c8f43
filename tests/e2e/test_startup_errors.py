"""Every start-up mistake of `slmrank serve` is one line on stderr and exit status 2, never a
traceback: settings (missing, malformed, unknown config key, out of range), placement (CUDA
without a GPU), TLS files, a taken port, a model that does not load. Mistakes seen before the
server starts run in this process; those seen while it starts or loads run as a subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def _one_error_line(stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and expected in errors[0], stderr


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, "--model is required"),
    (["--model", "embedded:tiny"], {"SLMRANK_PORT": "abc"}, "SLMRANK_PORT: 'abc' is not a valid integer"),
    (["--model", "embedded:tiny", "--config", "/nonexistent/slmrank.toml"], {}, "not found"),
    (["--model", "embedded:tiny", "--trace-sample-rate", "2"], {}, "sample_rate: must be in [0, 1]"),
    (["--model", "embedded:tiny", "--trace-file", "/nonexistent/dir/t.json"], {}, "does not exist"),
    (["--model", "embedded:tiny", "--tls-cert", "server.pem"], {}, "--tls-cert and --tls-key go together"),
    (["--model", "embedded:tiny", "--port", "70000"], {}, "port: 70000 is outside [0, 65535]"),
    (["--model", "embedded:tiny", "--batcher-max-inflight", "0"], {}, "batcher.max_inflight: must be an integer >= 1"),
    (["--model", "embedded:tiny", "--runtime", "java"], {}, "--runtime: 'java' is not one of auto, cpp, python"),
])
def test_mistakes_before_start(argv, environ, expected, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("SLMRANK_")]:
        monkeypatch.delenv(key)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    try:
        code = cli_main(["serve", *argv])
    except SystemExit as e:  # argparse exits 2 by itself
        code = e.code
    assert code == 2
    _one_error_line(capsys.readouterr().err, expected)


def test_unknown_config_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "slmrank.toml"
    config.write_text('model = "embedded:tiny"\nmetrics_prot = 1\n')
    assert cli_main(["serve", "--config", str(config)]) == 2
    _one_error_line(capsys.readouterr().err, "unknown key 'metrics_prot'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--model", "embedded:tiny", "--device", "cuda"]) == 2
    _one_error_line(capsys.readouterr().err, "--device cuda: no CUDA GPU is visible here")


# `python -m service.cli` with its address space bounded to what its imports took plus N bytes (argv[1])
_BOUNDED = """
import resource, sys
import grpc, torch
from service.cli import main
vm_bytes = 1024 * int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmSize:")))
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def _serve(tmp_path: Path, *args: str, extra_address_space: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLMRANK_", "OTEL_"))}
    env.update(SLMRANK_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    start = ["-m", "service.cli"] if extra_address_space is None else ["-c", _BOUNDED, str(extra_address_space)]
    return subprocess.run([sys.executable, *start, "serve", "--host", "127.0.0.1", "--port", "0",
                           "--metrics-port", "0", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("model, expected", [
    ("embedded:nope", "unknown embedded spec 'embedded:nope'"),
    ("/nonexistent/checkpoint", "--model /nonexistent/checkpoint: no such directory"),
    (".", "no config.json"),
])
def test_a_bad_model_fails_before_the_port_is_bound(tmp_path: Path, model: str, expected: str) -> None:
    """Seen before binding: on a port another socket holds, the error is the model's, not the port's,
    and the server never said it was listening."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _serve(tmp_path, "--model", model, "--port", str(taken.getsockname()[1]))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, expected)
    assert "listening" not in proc.stdout + proc.stderr and "cannot listen" not in proc.stderr


def test_a_model_that_does_not_load(tmp_path: Path, save_tiny_checkpoint) -> None:
    """A checkpoint that looks right (its config.json) but has no weights fails as it loads."""
    _, ckpt = save_tiny_checkpoint(tmp_path, "ckpt", "qwen2", "Qwen2ForCausalLM", 3, vocab=512, max_pos=64)
    for weights in ckpt.glob("*.safetensors"):
        weights.unlink()
    proc = _serve(tmp_path, "--model", str(ckpt))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "cannot load the model: ")
    assert "listening" in proc.stdout


def test_a_config_that_links_to_dev_zero_is_refused_unread(tmp_path: Path) -> None:
    """Issue 32: such a config.json was read until the host's OOM killer stopped the server (23.8 GB).
    The child may grow by 1 GiB past what its imports take, so an unbounded read fails there."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").symlink_to("/dev/zero")
    proc = _serve(tmp_path, "--model", str(tmp_path / "ckpt"), extra_address_space=1 << 30)
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "config.json: is a character device (a link to /dev/zero); it must be a regular file")


def test_a_pickle_named_model_safetensors_is_one_line(tmp_path: Path, save_tiny_checkpoint) -> None:
    """Issue 32: a SafetensorError traceback and exit 1."""
    _, ckpt = save_tiny_checkpoint(tmp_path, "ckpt", "qwen2", "Qwen2ForCausalLM", 3, vocab=512, max_pos=64)
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, ckpt / "model.safetensors")
    proc = _serve(tmp_path, "--model", str(ckpt))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "model.safetensors: not a safetensors file")


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory, save_tiny_checkpoint) -> Path:
    from service.artifact.artifact import build_artifact

    root = tmp_path_factory.mktemp("startup")
    _, ckpt = save_tiny_checkpoint(root, "ckpt", "qwen2", "Qwen2ForCausalLM", 3, vocab=512, max_pos=64)
    return build_artifact(str(ckpt), root / "art", quiet=True)


@pytest.mark.parametrize("runtime", ["python", "cpp"])
def test_a_tampered_manifest_is_one_line(tiny_artifact: Path, tmp_path: Path, runtime: str) -> None:
    """Issue 32: a manifest whose key `sha256` was renamed (one byte) ended in exit 1 and a 29-line
    KeyError traceback."""
    art = Path(shutil.copytree(tiny_artifact, tmp_path / "art"))
    raw = (art / "manifest.msgpack").read_bytes()
    (art / "manifest.msgpack").write_bytes(raw.replace(b"\xa6sha256", b"\xa6sha257", 1))
    proc = _serve(tmp_path, "--model", str(art), "--runtime", runtime)
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, "manifest.msgpack: sha256 mismatch (manifest.sha256 ")


def test_a_taken_metrics_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(tmp_path, "--model", "embedded:tiny", "--metrics-port", str(port))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, f"cannot listen on 127.0.0.1:{port} (metrics)")


def test_a_missing_tls_file(tmp_path: Path) -> None:
    key = tmp_path / "server.key"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    proc = _serve(tmp_path, "--model", "embedded:tiny", "--tls-cert", str(tmp_path / "missing.pem"),
                  "--tls-key", str(key))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, f"--tls-cert: cannot read {tmp_path / 'missing.pem'}")
