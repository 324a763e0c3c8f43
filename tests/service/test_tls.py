"""TLS and mTLS on the gRPC API, with certificates made here (a CA, a server certificate for
127.0.0.1, a client certificate): a TLS client gets answers, a plaintext client does not; with a
client CA, a client without a certificate is refused and one with a certificate signed by that
CA gets answers (also through front processes, --fronts); the plaintext health port keeps
answering probes."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.serving.client import RankerClient
from service.serving.server import RankerServer, ServerConfig
from service.serving.server_thread import ServerThread


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, issuer_key, issuer: str, key, *, is_ca: bool, usage=None, san=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key=None) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return str(path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("slmrank test CA", ca_key, "slmrank test CA", ca_key, is_ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _certificate("slmrank", ca_key, "slmrank test CA", server_key, is_ca=False,
                          usage=ExtendedKeyUsageOID.SERVER_AUTH,
                          san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = _certificate("ranker", ca_key, "slmrank test CA", client_key, is_ca=False,
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key = ec.generate_private_key(ec.SECP256R1())  # a CA the server does not trust
    other_ca = _certificate("other CA", other_key, "other CA", other_key, is_ca=True)
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = _certificate("stranger", other_key, "other CA", stranger_key, is_ca=False,
                            usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    return {"ca": _write(d / "ca.pem", ca), "server": _write(d / "server.pem", server, server_key),
            "server_key": str(d / "server.key"), "client": _write(d / "client.pem", client, client_key),
            "client_key": str(d / "client.key"), "other_ca": _write(d / "other-ca.pem", other_ca),
            "stranger": _write(d / "stranger.pem", stranger, stranger_key), "stranger_key": str(d / "stranger.key")}


def _serve(model, pki: dict[str, str], mtls: bool, fronts: int = 0) -> ServerThread:
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, health_host="127.0.0.1", health_port=0, fronts=fronts,
                          tls_cert=pki["server"], tls_key=pki["server_key"], tls_client_ca=pki["ca"] if mtls else None)
    return ServerThread(RankerServer(config, lambda: model), wait_ready=True)


def _score(target: str, **tls: str | None) -> list[float]:
    with RankerClient(target, timeout_s=30, **tls) as c:
        return list(c.score([[1, 2, 3]], [4, 5]).samples[0].logprobs)


def _plaintext_health(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def test_tls(model, pki: dict[str, str]) -> None:
    srv = _serve(model, pki, mtls=False)
    try:
        assert len(_score(srv.target, tls_ca=pki["ca"])) == 2
        with pytest.raises(grpc.RpcError) as err:  # plaintext to a TLS port: no answer
            _score(srv.target)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # a server certificate from a CA the client does not trust
            _score(srv.target, tls_ca=pki["other_ca"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _plaintext_health(srv.server.health_port) == "SERVING"  # kubelet's probe: plaintext
    finally:
        srv.stop()


@pytest.mark.parametrize("fronts", [0, 2])  # with fronts, they hold the certificate and check the client's
def test_mtls(model, pki: dict[str, str], fronts: int) -> None:
    srv = _serve(model, pki, mtls=True, fronts=fronts)
    try:
        assert len(_score(srv.target, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"])) == 2
        with pytest.raises(grpc.RpcError) as err:  # no client certificate
            _score(srv.target, tls_ca=pki["ca"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # a client certificate the server's CA did not sign
            _score(srv.target, tls_ca=pki["ca"], tls_cert=pki["stranger"], tls_key=pki["stranger_key"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            _score(srv.target)
    finally:
        srv.stop()


@pytest.mark.parametrize("kw, message", [
    ({"tls_cert": "a.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_key": "a.key"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "ca.pem"}, "--tls-client-ca (mTLS) needs --tls-cert and --tls-key"),
])
def test_incomplete_tls_settings_are_refused(kw: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        ServerConfig(**kw)
    assert message in str(err.value)


def test_unreadable_or_wrong_pem_files_are_one_line_errors(model, pki: dict[str, str], tmp_path: Path) -> None:
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello")
    for cert, key, message in ((str(tmp_path / "missing.pem"), pki["server_key"], "--tls-cert: cannot read"),
                               (str(not_pem), pki["server_key"], "is not a PEM file"),
                               (pki["server"], pki["ca"], "--tls-key: " + pki["ca"] + " holds no private key")):
        config = ServerConfig(host="127.0.0.1", port=0, tls_cert=cert, tls_key=key)
        with pytest.raises(RuntimeError) as err:  # ServerThread reports the start-up error
            ServerThread(RankerServer(config, lambda: model))
        assert message in str(err.value.__cause__) and "\n" not in str(err.value.__cause__)
