"""TLS and mTLS for the gRPC API: server credentials from PEM files.

    tls_cert + tls_key                 TLS: clients verify the server
    tls_cert + tls_key + tls_client_ca mTLS: the server also requires a client certificate
                                       signed by that CA (the handshake fails without one)

Every mistake is a ValueError of one line naming the setting and the file (exit 2 in the CLI).
The health-only listener (health_port) stays plaintext: kubelet's gRPC probes speak no TLS.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def check_tls_settings(cert: str | None, key: str | None, client_ca: str | None) -> None:
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both, or neither (plaintext)")
    if client_ca and not cert:
        raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key too")


def _read_pem(setting: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{setting}: cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting}: {path} is not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    chain, private_key = _read_pem("--tls-cert", cert), _read_pem("--tls-key", key)
    if b"PRIVATE KEY-----" not in private_key:
        raise ValueError(f"--tls-key: {key} holds no private key")
    roots = _read_pem("--tls-client-ca", client_ca) if client_ca else None
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=roots,
                                       require_client_auth=roots is not None)
