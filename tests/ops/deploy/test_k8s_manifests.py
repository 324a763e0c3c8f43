"""ops/deploy/k8s: every overlay renders with kustomize (kubectl's built-in one) and validates strictly
against the schemas of every Kubernetes version with native sidecars (1.29+); and what the
manifests promise holds: slmrank is a native sidecar probed over grpc.health.v1 on the health
port its config file opens, the pod's grace period outlasts the drain, the GPU overlays ask for
one GPU, the HPA scales on a metric slmrank exports, spans go to the collector's OTLP port."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "ops" / "deploy" / "k8s"
OVERLAYS = ("base", "overlays/gpu", "overlays/replicas")
# restartPolicy on an init container: alpha in 1.28 (feature gate), on by default from 1.29.
SIDECAR_VERSIONS = [v for v in kubernetes_validate.utils.all_versions()
                    if tuple(map(int, v.split(".")[:2])) >= (1, 29)]


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl (its built-in kustomize renders ops/deploy/k8s) is not installed on the CI machine")
        pytest.skip("kubectl is not installed")
    return kubectl


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([_kubectl(), "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    return deployment["spec"]["template"]["spec"]


def sidecar(spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in spec.get("initContainers", []) if c["name"] == "slmrank"]
    return container


def slmrank_config() -> dict[str, Any]:
    return tomllib.loads((K8S / "base" / "slmrank.toml").read_text())


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_sidecar_versions_are_known() -> None:
    assert SIDECAR_VERSIONS and SIDECAR_VERSIONS[0].startswith("1.29"), SIDECAR_VERSIONS


def test_every_resource_validates_strictly(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    failures = []
    for version in SIDECAR_VERSIONS:
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                failures.append(f"{overlay} {doc['kind']}/{doc['metadata']['name']} on {version}: {e.message}")
    assert not failures, "\n".join(failures)


def test_validation_sees_the_sidecar_field() -> None:
    """Kubernetes 1.27 has no native sidecars: its strict schema must refuse the manifest, or the
    validation above proves nothing about restartPolicy."""
    (deployment,) = by_kind(render("base"), "Deployment", "ranker")
    with pytest.raises(kubernetes_validate.ValidationError, match="restartPolicy"):
        kubernetes_validate.validate(deployment, "1.27", strict=True)


def test_slmrank_is_a_native_sidecar_probed_over_grpc_health(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    spec = pod_spec(docs)
    container = sidecar(spec)
    assert container["restartPolicy"] == "Always"
    config = slmrank_config()
    assert config["host"] == "127.0.0.1", "the Ranker API stays on the pod's loopback"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config["health_port"], probe
    assert config["health_host"] == "0.0.0.0", "kubelet probes the pod IP"
    # the startup probe waits long enough for a load plus graph capture (67 s measured on the H200)
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SLMRANK_CONFIG"].endswith("slmrank.toml")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["SLMRANK_CONFIG"] == f"{mounts['slmrank-config']}/slmrank.toml"
    # the example ranker calls slmrank on the loopback
    (ranker,) = spec["containers"]
    assert f"127.0.0.1:{config['port']}" in " ".join(ranker["args"])


def test_grace_period_outlasts_prestop_and_drain(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    spec = pod_spec(docs)

    def pre_stop_s(container: dict[str, Any]) -> float:
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        return float(command[1])

    # Native sidecars stop after the main containers, within the same grace period.
    needed = sum(pre_stop_s(c) for c in spec["containers"]) + pre_stop_s(sidecar(spec)) + slmrank_config()["grace_s"]
    assert spec["terminationGracePeriodSeconds"] > needed


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/replicas"])
def test_gpu_overlays_give_the_sidecar_one_gpu(overlay: str) -> None:
    docs = render(overlay)
    container = sidecar(pod_spec(docs))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":gpu")
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_replicas_overlay_scales_on_a_slmrank_metric() -> None:
    docs = render("overlays/replicas")
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    assert deployment["spec"]["replicas"] > 1
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ranker"}
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    metrics_source = (ROOT / "service" / "observe" / "metrics.py").read_text()
    assert f'"{name}"' in metrics_source, f"{name} is not a metric that service/observe/metrics.py exports"
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_spans_go_to_the_collectors_otlp_receiver() -> None:
    docs = render("base")
    env = {e["name"]: e.get("value") for e in sidecar(pod_spec(docs))["env"]}
    endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]  # http://otel-collector:4317 (gRPC)
    host, port = endpoint.removeprefix("http://").split(":")
    (service,) = by_kind(docs, "Service", host)
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("otel-collector-config")]
    collector = yaml.safe_load(config_map["data"]["config.yaml"])
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(f":{port}")
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]
    (collector_deployment,) = by_kind(docs, "Deployment", "otel-collector")
    (container,) = collector_deployment["spec"]["template"]["spec"]["containers"]
    assert service_port["targetPort"] in {p["name"] for p in container["ports"]}
    assert env["OTEL_SERVICE_NAME"] == "slmrank"
