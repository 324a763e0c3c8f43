"""ops/deploy/Dockerfile and the Kubernetes manifests name only what exists: the entry point is the
`slmrank` console script's `serve`, every SLMRANK_* variable the image or the manifests set is a
setting of `slmrank serve` (or SLMRANK_CONFIG / SLMRANK_CACHE), every key of the config file is
one, the stages the README and docs name are there, and the build script the stages run exists.
Read statically: no Docker daemon is needed (the image itself is built on the GPU machine)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from service.serving.settings import ENV_PREFIX, SERVE_SETTINGS

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "ops" / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
OTHER_VARIABLES = {"SLMRANK_CONFIG", "SLMRANK_CACHE"}  # the config file; where embedded artifacts are built
SETTING_VARIABLES = {s.env for s in SERVE_SETTINGS}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def stages() -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for op, args in instructions(DOCKERFILE.read_text()):
        if op == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else args
            out[current] = []
        elif current is not None:
            out[current].append((op, args))
    return out


def test_runtime_stages_run_slmrank_serve_as_a_non_root_user() -> None:
    all_stages = stages()
    assert {"build-gpu", "build-cpu", "cpu", "gpu"} <= set(all_stages)
    assert list(all_stages)[-1] == "gpu", "the default target (the last stage) is the CUDA image"
    for name in ("cpu", "gpu"):
        ops = dict(all_stages[name])
        assert json.loads(ops["ENTRYPOINT"]) == ["slmrank", "serve"], name
        assert ops["USER"].split(":")[0] == "10001", name
        assert "CMD" not in ops, "arguments come from the environment (and the pod's args)"


def test_the_entry_point_is_the_console_script() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["slmrank"] == "service.cli:main"
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--model" in out.stdout, out.stderr


def _env_names(stage_ops: list[tuple[str, str]]) -> set[str]:
    names = set()
    for op, args in stage_ops:
        if op == "ENV":
            names |= set(re.findall(r"(\w+)=", args))
    return names


def test_every_variable_the_image_sets_is_a_setting() -> None:
    for name in ("cpu", "gpu"):
        variables = {v for v in _env_names(stages()[name]) if v.startswith(ENV_PREFIX)}
        assert variables, name
        unknown = variables - SETTING_VARIABLES - OTHER_VARIABLES
        assert not unknown, f"{name}: {unknown} are not settings of slmrank serve"
        assert "SLMRANK_MODEL" in variables, "the entry point needs a model"


def test_the_build_script_and_its_knobs_exist() -> None:
    build = DEPLOY / "image_build"
    assert build.stat().st_mode & 0o111, "ops/deploy/image_build is not executable"
    text = DOCKERFILE.read_text()
    assert text.count("ops/deploy/image_build /opt/slmrank") == 2
    assert 'SLMRANK_CUDA_ARCHITECTURES="80;90a"' in text  # Ampere and Hopper
    assert "SLMRANK_CUDA_ARCHITECTURES" in (ROOT / "CMakeLists.txt").read_text()
    assert (DEPLOY / "Dockerfile.dockerignore").read_text().count(".venv/") == 1


@pytest.mark.parametrize("manifest", sorted((DEPLOY / "k8s").rglob("*.yaml")), ids=lambda p: p.name)
def test_manifests_set_only_known_variables(manifest: Path) -> None:
    variables = set(re.findall(r"name: (SLMRANK_\w+)", manifest.read_text()))
    assert not variables - SETTING_VARIABLES - OTHER_VARIABLES, variables - SETTING_VARIABLES - OTHER_VARIABLES
    for doc in yaml.safe_load_all(manifest.read_text()):
        assert doc is None or isinstance(doc, dict)


def test_the_config_file_has_only_known_keys() -> None:
    config = tomllib.loads((DEPLOY / "k8s" / "base" / "slmrank.toml").read_text())
    assert set(config) <= {s.name for s in SERVE_SETTINGS}, set(config) - {s.name for s in SERVE_SETTINGS}


def test_the_sidecars_settings_resolve_to_a_valid_server_config() -> None:
    """The config file plus the sidecar's SLMRANK_* variables, as `slmrank serve` reads them."""
    import argparse

    from service.cli import _server_config
    from service.serving.settings import add_arguments, resolve

    deployment = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "base" / "ranker.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    (sidecar,) = [c for c in deployment["spec"]["template"]["spec"]["initContainers"] if c["name"] == "slmrank"]
    environ = {e["name"]: e["value"] for e in sidecar["env"] if e["name"].startswith(ENV_PREFIX)}
    environ["SLMRANK_CONFIG"] = str(DEPLOY / "k8s" / "base" / "slmrank.toml")
    parser = argparse.ArgumentParser()
    add_arguments(parser, SERVE_SETTINGS)
    values = resolve(SERVE_SETTINGS, parser.parse_args([]), environ)
    config = _server_config(values)
    assert (config.host, config.port, config.health_port, config.metrics_host) == ("127.0.0.1", 50051, 8081, "0.0.0.0")
    assert values["model"] == "/models/artifact" and values["log_format"] == "json"
