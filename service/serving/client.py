"""A small synchronous client of the Ranker service; `slmrank client` runs it.

    with RankerClient("127.0.0.1:50051") as c:
        c.score(["a sample", [9707, 11]], label_texts=[" yes", " no"], prefix="Is it relevant? ")
        c.beam("The best running shoes are", beam_width=4, new_tokens=3, priority="online")
        c.tokenize(" yes")  # ids=[9834] text=" yes"; c.tokenize(ids=[9834]) the other way

A segment is text (tokenized by the server) or a list of token ids. With `tls_ca` the channel is
TLS (the server's certificate must chain to that CA); with `tls_cert` + `tls_key` as well, the
client presents its own certificate (mTLS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict

from ..model.fp8_policy import fp8_text
from .proto_gen import load as load_stubs

PRIORITIES = ("unspecified", "online", "normal", "background")  # the proto enum's order
SegmentValue = str | Sequence[int]


class RankerClient:
    def __init__(self, target: str, timeout_s: float | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None) -> None:
        stubs = load_stubs()
        self.pb2 = stubs.pb2
        self.timeout_s = timeout_s
        self.channel = channel(target, tls_ca, tls_cert, tls_key, tls_server_name)
        self.stub = stubs.pb2_grpc.RankerStub(self.channel)
        self.admin = stubs.pb2_grpc.AdminStub(self.channel)

    def score(self, samples: Sequence[SegmentValue], label_ids: Sequence[int] = (), prefix: SegmentValue | None = None,
              priority: str = "unspecified", timeout_s: float | None = None, label_texts: Sequence[str] = ()) -> Any:
        """label_texts: the labels as texts of one token each, instead of label_ids."""
        pb2 = self.pb2
        msg = pb2.ScoreRequest(samples=[segment(pb2, s) for s in samples], label_ids=label_ids,
                               label_texts=label_texts, priority=PRIORITIES.index(priority))
        if prefix is not None:
            msg.prefix.CopyFrom(segment(pb2, prefix))
        return self.stub.Score(msg, timeout=timeout_s or self.timeout_s)

    def beam(self, prompt: SegmentValue, beam_width: int, new_tokens: int, priority: str = "unspecified",
             timeout_s: float | None = None, catalog: str = "", normalization: str = "vocab") -> Any:
        """normalization (with a catalog): "vocab" or "codes" (BeamSearchRequest.normalization)."""
        msg = self.pb2.BeamSearchRequest(prompt=segment(self.pb2, prompt), beam_width=beam_width,
                                         new_tokens=new_tokens, priority=PRIORITIES.index(priority), catalog=catalog,
                                         normalization=("vocab", "codes").index(normalization))
        return self.stub.BeamSearch(msg, timeout=timeout_s or self.timeout_s)

    def replace_catalog(self, name: str, file: str, timeout_s: float | None = None) -> Any:
        """Admin.ReplaceCatalog: the server's catalog `name` becomes `file` (under its --catalog-dir)."""
        msg = self.pb2.ReplaceCatalogRequest(name=name, file=file)
        return self.admin.ReplaceCatalog(msg, timeout=timeout_s or self.timeout_s)

    def model_info(self, timeout_s: float | None = None) -> Any:
        return self.stub.ModelInfo(self.pb2.ModelInfoRequest(), timeout=timeout_s or self.timeout_s)

    def tokenize(self, text: str = "", ids: Sequence[int] = (), timeout_s: float | None = None) -> Any:
        """The server's tokenizer: text -> ids, or ids -> text (set one); the answer has both."""
        msg = self.pb2.TokenizeRequest(text=text, ids=list(ids))
        return self.stub.Tokenize(msg, timeout=timeout_s or self.timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RankerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def channel(target: str, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
            tls_server_name: str | None = None) -> grpc.Channel:
    """Plaintext without tls_ca; TLS with it; mTLS with tls_cert + tls_key too. tls_server_name:
    the name to check the server's certificate against, when the target's host is not in it."""
    if tls_ca is None:
        if tls_cert or tls_key:
            raise ValueError("--tls-cert / --tls-key (a client certificate) need --tls-ca (the server's CA)")
        return grpc.insecure_channel(target)
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None)
    options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def segment(pb2: Any, value: SegmentValue) -> Any:
    if isinstance(value, str):
        return pb2.Segment(text=value)
    return pb2.Segment(ids=list(value))


def parse_ids(text: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]."""
    return [int(t) for t in text.replace(",", " ").split()]


def _f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (proto floats are float32)."""
    return float(str(np.float32(x)))


def to_json(response: Any) -> dict[str, Any]:
    if hasattr(response, "artifact_sha256"):  # ModelInfoResponse, every field (0 and "" too: num_labels 0 says something)
        return MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if response.DESCRIPTOR.name == "TokenizeResponse":
        return {"ids": list(response.ids), "text": response.text}
    if response.DESCRIPTOR.name == "ReplaceCatalogResponse":
        return MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    if hasattr(response, "beams"):
        beams = [{"ids": list(b.ids), "logprob": _f32(b.logprob), "text": b.text, **({"item_id": b.item_id}
                                                                                     if b.item_id else {})}
                 for b in response.beams]
        return {"beams": beams, **({"catalog_version": response.catalog_version} if response.catalog_version else {})}
    return {"samples": [{"logprobs": [_f32(x) for x in s.logprobs]} for s in response.samples]}


def info_summary(info: Any) -> str:
    """A ModelInfoResponse for people: what is served, where, and the request limits; the buckets
    only counted (all of them: `slmrank client info --json`)."""
    lim = info.limits
    head = (f"{info.num_labels} labels (a classification head: no label ids)" if info.num_labels
            else "num_labels 0 (label log-probabilities: Score needs label_ids or label_texts)")
    rows = [
        ("model", f"{info.model or '(not named)'} (built from {info.source})" if info.source and info.source != info.model
         else info.model),
        ("artifact_sha256", info.artifact_sha256),
        ("architecture", f"{info.arch}, {info.num_layers} layers, hidden {info.hidden_size}, vocab {info.vocab_size}"),
        ("runtime", f"{info.runtime} on {info.device}, kernels {info.kernels}"
                    + (f", beam graphs {info.beam_graphs}" if info.beam_graphs else "")),
        ("dtype", f"compute {info.compute_dtype}, weights {info.weights_dtype}"
                  + (f" (fp8 e4m3 {fp8_text(info.weights_fp8, dict(info.weights_fp8_min_rows))})" if info.weights_fp8 else "")),
        ("limits", f"{head}; max_labels {lim.max_labels}"),
        ("", f"Score: max_samples {lim.max_samples}, max_score_tokens {lim.max_score_tokens}"),
        ("", f"BeamSearch: max_prompt_tokens {lim.max_prompt_tokens}, max_beam_width {lim.max_beam_width}, "
             f"max_new_tokens {lim.max_new_tokens}"),
        ("buckets", f"{len(info.score_buckets)} score, {len(info.beam_buckets)} beam"),
        *bucket_origin_rows(info.bucket_origin),
        *[("catalogs" if i == 0 else "", f"{c.name}: {c.num_items:,} items of {c.code_length} tokens over {c.num_codes:,} "
           f"code tokens, version {c.version}") for i, c in enumerate(info.catalogs)],
        *acceptance_rows(info),
        ("server_version", info.server_version),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}".rstrip() for k, v in rows)


def bucket_origin_rows(origin: Any) -> list[tuple[str, str]]:
    """Where the bucket table came from: the default tiers, or a traffic log and each kind's
    expected padding on it (the default table's in brackets)."""
    if origin.source != "traffic log":
        return [("bucket_table", f"{origin.source or 'default'} tiers")]
    pads = ", ".join(f"{p.kind} {100 * p.packed:.1f}% ({100 * p.default_packed:.1f}%)" for p in origin.padding)
    return [("bucket_table", f"chosen for a traffic log: sha256 {origin.log_sha256[:16]}…, {origin.log_requests} "
                             "requests"),
            ("", f"expected padding (default table's): {pads}")]


def acceptance_rows(info: Any) -> list[tuple[str, str]]:
    """The acceptance recorded in the artifact (`slmrank evaluate`): passed or not, against which
    baseline and request set, when; the checks that did not hold."""
    if not info.HasField("acceptance"):
        return [("acceptance", "none recorded")]
    a = info.acceptance
    verdict = "passed" if a.passed else "FAILED"
    rows = [("acceptance", f"{verdict} {a.date}: against baseline {a.baseline_sha256[:16]}…, {a.requests} requests "
                           f"(sha256 {a.requests_sha256[:16]}…), {sum(c.measured for c in a.checks)} checks")]
    for c in a.checks:
        if not c.passed:
            sign = "≤" if c.bound == "max" else "≥"
            rows.append(("", f"exceeded: {c.name} {c.value:.4g} (limit {sign} {c.limit:g})"))
    return rows


def describe_error(e: grpc.RpcError) -> str:
    """'UNAVAILABLE: overloaded (...); retry after 12 ms' and the retry-after-ms trailer when sent."""
    text = f"{e.code().name}: {e.details()}"
    retry = [v for k, v in (e.trailing_metadata() or ()) if k == "retry-after-ms"]
    return f"{text} [retry-after-ms: {retry[0]}]" if retry else text
