"""A wheel that serves: `pip wheel` of this checkout ships the .proto and its stubs generated at
build time (service/_proto; never committed, never the checkout's service/_gen), and the wheel
installed into a fresh venv serves a request from outside the checkout, with no protoc run.

To stay quick on 2 cores the wheel is built without the C++ extension (SLMRANK_EXTENSION=OFF:
the same CMakeLists.txt, the same install rules for the stubs; the extension's own build is what
ops/setup and the image build run), and the fresh venv takes the dependencies (torch, grpcio, ...)
from this one through a .pth line instead of installing them again. The server then runs the
Python runtime, which `--runtime auto` picks when the extension is missing.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet",
                           str(ROOT), "-w", str(out / "dist"), "-Ccmake.define.SLMRANK_EXTENSION=OFF",
                           f"-Cbuild-dir={out / 'build'}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = (out / "dist").glob("slmrank-*.whl")
    return whl


def test_the_wheel_ships_the_proto_and_its_stubs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("ranker.proto", "ranker_pb2.py", "ranker_pb2_grpc.py"):
        assert f"service/_proto/slmrank/v1/{f}" in names
    assert not any("/_gen/" in n or "__pycache__" in n for n in names), "a checkout's generated files leaked in"
    shipped = zipfile.ZipFile(wheel).read("service/_proto/slmrank/v1/ranker.proto")
    assert shipped == (ROOT / "proto" / "slmrank" / "v1" / "ranker.proto").read_bytes()
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "slmrank = service.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies of this venv, after the fresh venv's own packages (its .pth files are not run:
    # this checkout's editable install stays invisible there)
    (site / "_deps_from_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--quiet", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def test_the_installed_wheel_serves_a_request(venv: Path, tmp_path: Path) -> None:
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLMRANK_", "OTEL_", "PYTHON"))}
    env.update(SLMRANK_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    where = subprocess.run([str(bin_dir / "python"), "-c", "import service.serving.proto_gen as g; print(g.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr

    server = subprocess.Popen([str(bin_dir / "slmrank"), "serve", "--model", "embedded:tiny", "--host", "127.0.0.1",
                               "--port", "0", "--metrics-port", "0", "--grace-s", "5"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in server.stdout], daemon=True).start()  # type: ignore
    try:
        target, end = None, time.monotonic() + 120
        while target is None or "send a request" not in line:
            assert time.monotonic() < end and server.poll() is None, server.stderr.read()  # type: ignore
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                line = ""
            if m := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                target = m.group(1)
        client = [str(bin_dir / "slmrank"), "client"]
        score = subprocess.run([*client, "score", "--target", target, "--timeout", "60", "--sample-ids", "1,2,3",
                                "4,5", "--labels", "6", "7"], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=120)
        assert score.returncode == 0, score.stderr
        samples = json.loads(score.stdout)["samples"]
        assert len(samples) == 2 and all(len(s["logprobs"]) == 2 for s in samples)
        info = subprocess.run([*client, "info", "--target", target, "--timeout", "30"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert info.returncode == 0, info.stderr
        assert json.loads(info.stdout)["runtime"] == "python"  # auto: the wheel has no extension
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    packaged = Path(where.stdout.strip()).parents[1]
    assert not (packaged / "_gen").exists(), "the installed package generated stubs instead of using its own"
