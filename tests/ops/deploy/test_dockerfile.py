"""ops/deploy/Dockerfile and the Kubernetes manifests name only what exists: the entry point is the
`slmrank` console script's `serve`, every SLMRANK_* variable the image or the manifests set is a
setting of `slmrank serve` (or SLMRANK_CONFIG / SLMRANK_CACHE), every key of the config file is
one, the stages the README and docs name are there, and the build script the stages run exists.
The image serves the Ranker API on its loopback unless opened; a build stage installs torch and
the dependencies before it copies the checkout (a source edit does not reinstall torch); the CPU
image's torch is the one ops/setup installs for CI.
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
from tests.ops.deploy.dockerfile import DOCKERFILE, ROOT, global_args, image_env, stages

DEPLOY = ROOT / "ops" / "deploy"
OTHER_VARIABLES = {"SLMRANK_CONFIG", "SLMRANK_CACHE"}  # the config file; where embedded artifacts are built
SETTING_VARIABLES = {s.env for s in SERVE_SETTINGS}


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
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # the image installs the wheel, whose console script is service/cli.py under the wheel's name
    # (the editable install's, service.cli:main, is an override for the checkout)
    assert "scripts" in pyproject["project"]["dynamic"]
    scripts = pyproject["tool"]["scikit-build"]["metadata"]["scripts"]
    assert scripts["result"]["slmrank"] == "slmrank.service.cli:main"
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
    assert text.count("ops/deploy/image_build deps /opt/slmrank") == 2
    assert text.count("ops/deploy/image_build app /opt/slmrank") == 2
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


def _serve_config(environ: dict[str, str]):  # -> (ServerConfig, the resolved values)
    """What `slmrank serve` with no flag makes of this environment."""
    import argparse

    from service.cli import _server_config
    from service.serving.settings import add_arguments, resolve

    parser = argparse.ArgumentParser()
    add_arguments(parser, SERVE_SETTINGS)
    values = resolve(SERVE_SETTINGS, parser.parse_args([]), environ)
    return _server_config(values), values


# ids other than "gpu": tests/conftest.py skips an item with a "gpu" keyword where there is no GPU
@pytest.mark.parametrize("stage", ["cpu", "gpu"], ids=["cpu-image", "cuda-image"])
def test_the_image_alone_keeps_the_api_on_its_loopback(stage: str) -> None:
    """`docker run` with no variable and no config file: the plaintext Ranker API is reachable from
    the container only; /metrics is on every address for a scraper."""
    config, values = _serve_config({k: v for k, v in image_env(stage).items() if k.startswith(ENV_PREFIX)})
    assert config.host == "127.0.0.1", "the image opens the Ranker API beyond its loopback"
    assert (config.port, config.metrics_host, config.metrics_port) == (50051, "0.0.0.0", 9464)
    assert config.tls_cert is None and values["model"] == "/models/artifact"
    ops = dict(stages()[stage])
    assert "50051" not in ops["EXPOSE"].split(), "EXPOSE names a port that listens on the loopback only"


@pytest.mark.parametrize("stage", ["build-cpu", "build-gpu"])
def test_torch_is_installed_before_the_checkout_is_copied(stage: str) -> None:
    """A source edit invalidates `COPY . /src` and what follows, nothing before it: the layer
    that installs torch and the dependencies must come first and see only the files it reads."""
    ops = stages()[stage]
    (deps,) = [i for i, (op, args) in enumerate(ops) if op == "RUN" and "image_build deps" in args]
    (checkout,) = [i for i, (op, args) in enumerate(ops) if op == "COPY" and args.split()[0] == "."]
    (app,) = [i for i, (op, args) in enumerate(ops) if op == "RUN" and "image_build app" in args]
    assert deps < checkout < app
    copied = [word for op, args in ops[:deps] if op == "COPY" for word in args.split()[:-1]]
    assert copied == ["pyproject.toml", "ops/deploy/image_build"], copied
    # a RUN after an ARG misses the cache when the ARG changes: the model baked in must not rebuild torch
    (bake,) = [i for i, (op, args) in enumerate(ops) if op == "ARG" and args.startswith("BAKE_MODEL")]
    assert deps < bake


def test_the_cpu_image_runs_the_torch_ci_tests() -> None:
    (ci_torch,) = set(re.findall(r"install --quiet torch==([\d.]+)", (ROOT / "ops" / "setup").read_text()))
    assert global_args()["TORCH_VERSION_CPU"] == ci_torch, "the CPU image's torch is not the one CI tests"
    ops = stages()["build-cpu"]
    assert ("ARG", "TORCH_VERSION_CPU") in ops
    assert all("TORCH_VERSION_CPU" in a for op, a in ops if op == "RUN" and "image_build" in a)


def test_the_sidecars_settings_resolve_to_a_valid_server_config() -> None:
    """The image's variables, the sidecar's over them and the config file below both, as
    `slmrank serve` reads them (tests/ops/deploy/test_k8s_manifests.py does it for every overlay)."""
    deployment = next(d for d in yaml.safe_load_all((DEPLOY / "k8s" / "base" / "ranker.yaml").read_text())
                      if d and d["kind"] == "Deployment")
    (sidecar,) = [c for c in deployment["spec"]["template"]["spec"]["initContainers"] if c["name"] == "slmrank"]
    environ = {k: v for k, v in image_env("cpu").items() if k.startswith(ENV_PREFIX)}
    environ |= {e["name"]: e["value"] for e in sidecar["env"] if e["name"].startswith(ENV_PREFIX)}
    environ["SLMRANK_CONFIG"] = str(DEPLOY / "k8s" / "base" / "slmrank.toml")
    config, values = _serve_config(environ)
    assert (config.host, config.port, config.health_port, config.metrics_host) == ("127.0.0.1", 50051, 8081, "0.0.0.0")
    assert values["model"] == "/models/artifact" and values["log_format"] == "json"
