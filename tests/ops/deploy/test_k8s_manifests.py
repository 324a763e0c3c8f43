"""ops/deploy/k8s: every overlay renders with kustomize (kubectl's built-in one) and validates strictly
against the schemas of every Kubernetes version with native sidecars (1.29+); and what the
manifests promise holds: slmrank is a native sidecar probed over grpc.health.v1 on the health
port its config file opens, the pod's grace period outlasts the drain, the GPU overlays ask for
one GPU on a GPU node, the HPA scales on a metric slmrank exports and owns the replica count,
spans go to the collector's OTLP port. Where each listener of slmrank is, from the image's
environment, the container's and the rendered config file together, as `slmrank serve` resolves
them: the Ranker API on the pod's loopback, health on the pod IP, /metrics on the pod IP and
admitted from the monitoring namespace only, /trace off; no key of the config file is one a
variable overrides. No service account token; replicas spread over nodes and zones; every
image by digest."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.serving.settings import ENV_PREFIX, SERVE_SETTINGS
from tests.ops.deploy.dockerfile import image_env

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
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == config["health_port"], probe
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
    spec = pod_spec(docs)
    container = sidecar(spec)
    # an extended resource: a request must equal the limit (a limit alone implies it)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert ":gpu@sha256:" in container["image"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]} in term["matchExpressions"]


def test_replicas_overlay_scales_on_a_slmrank_metric() -> None:
    docs = render("overlays/replicas")
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    # the HPA owns the count: a replicas in the manifest would reset its scale on every apply
    assert "replicas" not in deployment["spec"]
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


# ---- where each listener is -------------------------------------------------------------------------

def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _listeners(docs: list[dict[str, Any]], tmp_path: Path) -> tuple[Any, dict[str, Any], set[str], set[str]]:
    """(ServerConfig, resolved values, the config file's keys, the settings a variable sets) of the
    sidecar, as `slmrank serve` resolves them in the pod: the image's ENV, the container's env over
    it (Kubernetes replaces an image variable of the same name), the rendered config file below both."""
    import argparse

    from service.cli import _server_config
    from service.serving.settings import add_arguments, resolve

    container = sidecar(pod_spec(docs))
    (stage,) = [s for s in ("cpu", "gpu") if f":{s}@" in container["image"]]
    environ = {k: v for k, v in image_env(stage).items() if k.startswith(ENV_PREFIX)}
    environ |= {e["name"]: e["value"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)}
    (config_map,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("slmrank-config")]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    (volume,) = [n for n, v in volumes.items() if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]]
    (file_name,) = config_map["data"]
    assert environ["SLMRANK_CONFIG"] == f"{mounts[volume]}/{file_name}", "SLMRANK_CONFIG is not the rendered file"
    text = config_map["data"][file_name]
    (tmp_path / file_name).write_text(text)
    environ["SLMRANK_CONFIG"] = str(tmp_path / file_name)
    parser = argparse.ArgumentParser()
    add_arguments(parser, SERVE_SETTINGS)
    values = resolve(SERVE_SETTINGS, parser.parse_args([]), environ)
    by_variable = {s.env: s.name for s in SERVE_SETTINGS}
    return _server_config(values), values, set(tomllib.loads(text)), {by_variable[v] for v in environ if v in by_variable}


def test_each_listener_is_where_the_manifests_say(rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    overlay, docs = rendered
    config, values, file_keys, from_variables = _listeners(docs, tmp_path)
    # the config file's keys all apply: a variable (the image's or the container's) beats the file
    assert not file_keys & from_variables, f"{overlay}: slmrank.toml keys a variable overrides: {file_keys & from_variables}"
    spec = pod_spec(docs)
    container = sidecar(spec)
    ports = _ports(container)
    # the plaintext Ranker API on the pod's loopback, no container port: the ranking container's alone
    assert config.host == "127.0.0.1" and config.tls_cert is None, overlay
    assert config.port not in ports.values(), overlay
    (ranker,) = spec["containers"]
    assert f"127.0.0.1:{config.port}" in " ".join(ranker["args"])
    # grpc.health.v1 on the pod IP, where kubelet's probes arrive
    assert config.health_host == "0.0.0.0" and config.health_port == ports["health"], overlay
    # /metrics on the pod IP, on the port Prometheus is told to scrape
    assert config.metrics_host == "0.0.0.0" and config.metrics_port == ports["metrics"], overlay
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(config.metrics_port)
    # /trace (request timings) is off: served only where trace_port opens it, on the loopback
    assert config.trace_port is None, overlay


def test_the_network_policy_admits_health_and_metrics_only(rendered: tuple[str, list[dict[str, Any]]],
                                                           tmp_path: Path) -> None:
    overlay, docs = rendered
    config, *_ = _listeners(docs, tmp_path)
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    (policy,) = by_kind(docs, "NetworkPolicy", "ranker")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ports = _ports(sidecar(pod_spec(docs)))
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports") and rule.get("from"), "a rule without ports or sources admits everything"
        for port in rule["ports"]:
            admitted[ports.get(port["port"], port["port"])] = rule["from"]
    assert set(admitted) == {config.health_port, config.metrics_port}, overlay
    assert admitted[config.health_port] == [{"podSelector": {}}]  # the namespace; kubelet is always admitted
    assert admitted[config.metrics_port] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_pods_carry_no_service_account_token(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    for deployment in by_kind(docs, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert spec.get("automountServiceAccountToken") is False, f"{overlay}: {deployment['metadata']['name']}"


def test_rankers_spread_over_nodes_and_zones(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    (deployment,) = by_kind(docs, "Deployment", "ranker")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]}
    assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, overlay
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1 and constraint["labelSelector"]["matchLabels"].items() <= labels.items()
    # a node lost takes one replica; a cluster without zone labels still schedules
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"


def test_every_image_is_pinned_by_digest(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """name:tag@sha256:...: the tag for the reader, the digest for the kubelet (the base's are
    placeholders that an operator sets, docs/operations.md)."""
    overlay, docs = rendered
    images = [c["image"] for d in by_kind(docs, "Deployment")
              for c in d["spec"]["template"]["spec"].get("initContainers", []) + d["spec"]["template"]["spec"]["containers"]]
    assert images
    for image in images:
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:\w+", image), f"{overlay}: {image}"
