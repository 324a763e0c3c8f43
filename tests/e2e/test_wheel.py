"""A wheel that serves: the README's `pip wheel` command, run as written, builds a wheel of this
checkout that ships the .proto and its stubs generated at build time (slmrank/service/_proto; never
committed, never the checkout's service/_gen) and claims one top-level name, slmrank (service/,
kernels/ and cpp_dag/ go under it). Installed into a fresh venv beside another distribution's
top-level `kernels` (Hugging Face has one, which transformers imports), it serves a request from
outside the checkout through a front process, with no protoc run, and leaves that `kernels` alone.

To stay quick on 2 cores the wheel is built without the C++ extension (the README's command plus
SLMRANK_EXTENSION=OFF and a build tree of its own: the same CMakeLists.txt, the same install rules
for the stubs; the extension's own build is what ops/setup and the image build run), and the fresh
venv takes the dependencies (torch, grpcio, ...) from this one through a .pth line instead of
installing them again. The server then runs the Python runtime, which `--runtime auto` picks when
the extension is missing.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
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


def readme_wheel_command() -> list[str]:
    """The one `pip wheel ...` command the README gives, as argv."""
    (command,) = re.findall(r"`(pip wheel [^`]*)`", (ROOT / "README.md").read_text())
    return shlex.split(command)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # as written, in the checkout, by this venv's pip; only where it builds and what lands where are added
    proc = subprocess.run([sys.executable, "-m", *readme_wheel_command(), "--quiet", "-w", str(out / "dist"),
                           "-Ccmake.define.SLMRANK_EXTENSION=OFF", f"-Cbuild-dir={out / 'build'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = (out / "dist").glob("slmrank-*.whl")
    return whl


def test_the_readme_builds_against_the_installed_torch() -> None:
    # torch is not in build-system.requires: an isolated build environment has none to compile against
    argv = readme_wheel_command()
    assert argv[:2] == ["pip", "wheel"] and "--no-build-isolation" in argv and argv[-1] == ".", argv


def test_the_wheel_claims_only_the_slmrank_name(wheel: Path) -> None:
    top = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert top == {"slmrank", "slmrank-0.1.0.dist-info"}, top


def test_the_wheel_ships_the_proto_and_its_stubs(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("ranker.proto", "ranker_pb2.py", "ranker_pb2_grpc.py"):
        assert f"slmrank/service/_proto/slmrank/v1/{f}" in names
    assert not any("/_gen/" in n or "__pycache__" in n for n in names), "a checkout's generated files leaked in"
    shipped = zipfile.ZipFile(wheel).read("slmrank/service/_proto/slmrank/v1/ranker.proto")
    assert shipped == (ROOT / "proto" / "slmrank" / "v1" / "ranker.proto").read_bytes()
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "slmrank = slmrank.service.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def other_kernels_wheel(out: Path) -> Path:
    """A distribution with a top-level `kernels` package, as Hugging Face's."""
    whl = out / "kernels-0.1-py3-none-any.whl"
    files = {"kernels/__init__.py": "WHO = 'another distribution'\n",
             "kernels-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: kernels\nVersion: 0.1\n",
             "kernels-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                            "Tag: py3-none-any\n"}
    files["kernels-0.1.dist-info/RECORD"] = "".join(f"{name},,\n" for name in [*files, "kernels-0.1.dist-info/RECORD"])
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


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
    # the other `kernels` first: an install of slmrank that wrote kernels/ would replace it unnoticed
    for whl in (other_kernels_wheel(env_dir), wheel):
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                               "--no-index", "--quiet", str(whl)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return env_dir


def test_the_installed_wheel_serves_a_request(venv: Path, tmp_path: Path) -> None:
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLMRANK_", "OTEL_", "PYTHON"))}
    env.update(SLMRANK_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    where = subprocess.run([str(bin_dir / "python"), "-c", "import slmrank.service.serving.proto_gen as g; print(g.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
    # what the installs put into the fresh venv's own site-packages (this venv's, on its path for the
    # dependencies, has the checkout's editable install)
    site = Path(where.stdout.strip()).parents[3]
    assert {p.name for p in site.iterdir()} == {"slmrank", "slmrank-0.1.0.dist-info", "kernels",
                                                 "kernels-0.1.dist-info", "_deps_from_test_venv.pth"}
    assert (site / "kernels" / "__init__.py").read_text() == "WHO = 'another distribution'\n"

    # one front process: the engine spawns it with `python -m` under the wheel's module name
    server = subprocess.Popen([str(bin_dir / "slmrank"), "serve", "--model", "embedded:tiny", "--host", "127.0.0.1",
                               "--port", "0", "--metrics-port", "0", "--grace-s", "5", "--fronts", "1"],
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
        info = subprocess.run([*client, "info", "--json", "--target", target, "--timeout", "30"], cwd=tmp_path, env=env,
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
    # the other distribution's kernels is intact and importable beside slmrank (in one process, too)
    both = subprocess.run([str(bin_dir / "python"), "-c", "import kernels, slmrank.service.model.layers as l; "
                           "print(kernels.WHO); print(l.masked_attention_ref.__module__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert both.returncode == 0, both.stderr
    assert both.stdout.split("\n")[:2] == ["another distribution", "slmrank.kernels.attention"], both.stdout
