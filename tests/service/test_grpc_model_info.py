"""What a server says about itself: the ModelInfo RPC (the artifact's identity, placement, limits
and buckets, equal to the artifact's own), server reflection under grpc.reflection.v1 and
v1alpha (what grpcurl uses), the health-only listener, and `slmrank client info`."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from service.cli import main as cli_main
from service.serving.client import RankerClient
from service.serving.server import RankerServer, ServerConfig
from service.serving.server_thread import ServerThread


@pytest.fixture(scope="module")
def server(model):
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, health_host="127.0.0.1", health_port=0)
    srv = ServerThread(RankerServer(config, lambda: model))
    srv.wait_serving()
    yield srv
    srv.stop()


def test_model_info_describes_the_artifact(server: ServerThread, model) -> None:
    art = model.artifact
    with RankerClient(server.target, timeout_s=30) as c:
        info = c.model_info()
    assert info.artifact_sha256 == hashlib.sha256((art.path / "manifest.msgpack").read_bytes()).hexdigest()
    assert (info.arch, info.num_layers, info.hidden_size, info.vocab_size) == (
        art.config.arch, art.config.num_layers, art.config.hidden_size, art.config.vocab_size)
    assert info.runtime == "python" and info.device == "cpu" and info.kernels == "aten" and info.beam_graphs == ""
    assert info.weights_dtype == art.manifest["weights"]["dtype"] == info.compute_dtype
    limits = {f.name: getattr(info.limits, f.name) for f in dataclasses.fields(art.limits)}
    assert limits == dataclasses.asdict(art.limits)
    assert [(b.max_requests, b.max_tokens, b.max_samples) for b in info.score_buckets] == [
        (b.max_requests, b.max_tokens, b.max_samples) for b in art.buckets.score]
    assert [(b.new_tokens, b.max_requests, b.max_prompt_tokens, b.beam_width) for b in info.beam_buckets] == [
        (b.new_tokens, b.max_requests, b.max_prompt_tokens, b.beam_width) for b in art.buckets.beam]
    assert info.server_version


def test_model_info_while_loading_is_unavailable(model) -> None:
    import threading

    release = threading.Event()
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=2),
                                    lambda: release.wait(30) and model))
    try:
        with RankerClient(srv.target, timeout_s=10) as c, pytest.raises(grpc.RpcError) as err:
            c.model_info()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
    finally:
        release.set()
        srv.stop()


def _reflect(target: str, package: str, request: reflection_pb2.ServerReflectionRequest):
    """One reflection call under grpc.reflection.<package> (v1 and v1alpha share their messages)."""
    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(f"/grpc.reflection.{package}.ServerReflection/ServerReflectionInfo",
                                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        (response,) = list(call(iter([request]), timeout=10))
    return response


@pytest.mark.parametrize("package", ["v1", "v1alpha"])
def test_reflection(server: ServerThread, package: str) -> None:
    listed = _reflect(server.target, package, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {"slmrank.v1.Ranker", "slmrank.v1.Admin", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    described = _reflect(server.target, package,
                         reflection_pb2.ServerReflectionRequest(file_containing_symbol="slmrank.v1.Ranker"))
    (raw,) = described.file_descriptor_response.file_descriptor_proto
    proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
    methods = {service.name: [m.name for m in service.method] for service in proto.service}
    assert methods == {"Ranker": ["Score", "BeamSearch", "ModelInfo", "Tokenize"], "Admin": ["ReplaceCatalog"]}
    assert proto.options.go_package and proto.options.java_package


def test_health_listener_serves_health_only(server: ServerThread) -> None:
    target = f"127.0.0.1:{server.server.health_port}"
    with grpc.insecure_channel(target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    with RankerClient(target, timeout_s=10) as c, pytest.raises(grpc.RpcError) as err:
        c.score([[1, 2]], [3])
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_client_info_prints_a_summary(server: ServerThread, model, capsys: pytest.CaptureFixture[str]) -> None:
    art = model.artifact
    assert cli_main(["client", "info", "--target", server.target, "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert 5 < len(lines) <= 12 and max(map(len, lines)) < 120, out  # for people: a screen, not 34 KB on a line
    rows = {ln.split()[0]: ln for ln in lines if not ln.startswith(" ")}
    assert "embedded:tiny" in rows["model"]  # what the artifact was built from (the test's Model has no --model)
    assert hashlib.sha256((art.path / "manifest.msgpack").read_bytes()).hexdigest() in rows["artifact_sha256"]
    assert "python on cpu" in rows["runtime"] and art.manifest["weights"]["dtype"] in rows["dtype"]
    assert "num_labels 0" in rows["limits"] and f"max_labels {art.limits.max_labels}" in rows["limits"]
    assert f"max_beam_width {art.limits.max_beam_width}" in out and f"max_score_tokens {art.limits.max_score_tokens}" in out
    assert rows["buckets"].split(None, 1)[1] == f"{len(art.buckets.score)} score, {len(art.buckets.beam)} beam"
    assert rows["bucket_table"].split(None, 1)[1] == "default tiers"


def test_client_info_json_has_every_field(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["client", "info", "--json", "--target", server.target, "--timeout", "30"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["runtime"] == "python" and len(printed["artifact_sha256"]) == 64
    assert printed["limits"]["max_beam_width"] > 0 and printed["beam_buckets"]
    assert printed["num_labels"] == 0  # a zero is an answer too (label log-probabilities, no head)
