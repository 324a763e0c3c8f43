"""The flags every client command shares (slmrank client, slmrank bench). Imports no grpc: the
commands' flags are defined when `slmrank` starts, and grpc loads only when one runs."""

from __future__ import annotations

import argparse


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """A client command's TLS flags (tls_ca, tls_cert, tls_key, tls_server_name: RankerClient's)."""
    parser.add_argument("--tls-ca", default=None, metavar="FILE", help="TLS: the CA of the server's certificate (PEM)")
    parser.add_argument("--tls-cert", default=None, metavar="FILE", help="mTLS: this client's certificate (PEM)")
    parser.add_argument("--tls-key", default=None, metavar="FILE", help="mTLS: its private key (PEM)")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="TLS: check the server's certificate for this name instead of the target's host")


__all__ = ["add_tls_arguments"]
