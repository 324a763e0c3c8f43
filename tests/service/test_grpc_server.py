"""The gRPC server over real gRPC on loopback: the server runs in this process on its own uvloop
event loop (a background thread), the tests are a synchronous client. Model: embedded:tiny on the
Python runtime.

Results equal engine.execute (what `slmrank run` runs) after the float32 round trip of proto
floats; every invalid field is INVALID_ARGUMENT naming it; a fuzz of request messages yields only
OK or INVALID_ARGUMENT; health goes NOT_SERVING -> SERVING; reflection lists the service.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.sched.admission import AdmissionConfig, DeadlineUnmeetable, Overloaded
from service.sched.batcher import DeadlineExpired
from service.serving.client import RankerClient
from service.runtime.engine import execute
from service.serving.proto_gen import load as load_stubs
from service.runtime.requests import BeamRequest, ExecutionError, RequestError, ScoreRequest
from service.serving.server import Model, NotServing, RankerServer, ServerConfig, status_of
from service.serving.server_thread import ServerThread

pb2 = load_stubs().pb2
VOCAB = 151936  # embedded:tiny: the Qwen vocabulary


@pytest.fixture(scope="module")
def run_ref(embedded_tiny, embedded_tiny_runtime):
    """engine.execute on one request, as `slmrank run` does."""
    art = embedded_tiny[1]

    def run(req):
        (result,) = execute(art, embedded_tiny_runtime, [req])
        assert not isinstance(result, Exception), result
        return result
    return run


def f32(xs) -> list[float]:
    return [float(np.float32(x)) for x in xs]


def rng_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def assert_score_equal(resp, ref) -> None:
    assert [list(s.logprobs) for s in resp.samples] == [f32(row) for row in ref.scores]


def assert_beam_equal(resp, ref, tokenizer) -> None:
    assert [list(b.ids) for b in resp.beams] == [b.ids for b in ref.beams]
    assert [b.logprob for b in resp.beams] == f32(b.logprob for b in ref.beams)
    known = [b for b in resp.beams if max(b.ids) < tokenizer.vocab_size]
    assert all(b.text == tokenizer.decode(list(b.ids)) for b in known)


# ---- results equal the engine's ------------------------------------------------------------------

@pytest.mark.parametrize("priority", ["unspecified", "online", "normal", "background"])
def test_score_ids_equal_engine(client, run_ref, priority):
    prefix, samples, labels = rng_ids(1, 9), [rng_ids(2, 3), rng_ids(3, 6), rng_ids(4, 1)], rng_ids(5, 4)
    resp = client.score(samples, labels, prefix=prefix, priority=priority)
    assert_score_equal(resp, run_ref(ScoreRequest(tuple(map(tuple, samples)), tuple(labels), tuple(prefix))))
    no_prefix = client.score(samples[:2], labels[:1], priority=priority)
    assert_score_equal(no_prefix, run_ref(ScoreRequest(tuple(map(tuple, samples[:2])), tuple(labels[:1]))))


@pytest.mark.parametrize("priority", ["unspecified", "online", "normal", "background"])
@pytest.mark.parametrize("width,new_tokens", [(1, 2), (4, 3)])
def test_beam_ids_equal_engine(client, run_ref, model, priority, width, new_tokens):
    prompt = rng_ids(width + new_tokens, 12)
    resp = client.beam(prompt, width, new_tokens, priority=priority)
    assert len(resp.beams) == width and all(len(b.ids) == new_tokens for b in resp.beams)
    assert_beam_equal(resp, run_ref(BeamRequest(tuple(prompt), width, new_tokens)), model.tokenizer)


def test_text_inputs_are_tokenized_like_the_tokenizer(client, run_ref, model, server):
    tok = model.tokenizer
    prefix, samples = "Query: trail running shoes. Is this item relevant?", [" Trail runner 3", " Garden hose, 20 m"]
    labels = tok.encode(" yes") + tok.encode(" no")
    resp = client.score(samples, labels, prefix=prefix)
    ref_req = ScoreRequest(tuple(tuple(tok.encode(s)) for s in samples), tuple(labels), tuple(tok.encode(prefix)))
    assert_score_equal(resp, run_ref(ref_req))
    mixed = client.score([samples[0], tok.encode(samples[1])], labels, prefix=tok.encode(prefix))
    assert_score_equal(mixed, run_ref(ref_req))

    prompt = "The best running shoes for a marathon are"
    beam = client.beam(prompt, 3, 2, priority="online")
    assert_beam_equal(beam, run_ref(BeamRequest(tuple(tok.encode(prompt)), 3, 2)), tok)

    stats = server.on_loop(server.server.stats)["tokenize"]
    assert stats["num_segments"] >= 4 and stats["mean_us"] > 0


# ---- invalid requests ----------------------------------------------------------------------------

def _score(**kw) -> Any:
    base = dict(samples=[pb2.Segment(ids=[1, 2])], label_ids=[3])
    base.update(kw)
    return pb2.ScoreRequest(**base)


def _beam(**kw) -> Any:
    base = dict(prompt=pb2.Segment(ids=[1, 2, 3]), beam_width=2, new_tokens=1)
    base.update(kw)
    return pb2.BeamSearchRequest(**base)


S = pb2.Segment
INVALID = [
    # (name, message, the start of the error message: the field, then words or limits it must name)
    ("no_samples", _score(samples=[]), "samples:", []),
    ("empty_sample", _score(samples=[S(ids=[1]), S()]), "samples[1]:", ["exactly one of text or ids"]),
    ("sample_both", _score(samples=[S(text="a", ids=[1])]), "samples[0]:", ["exactly one of text or ids"]),
    ("empty_prefix", _score(prefix=S()), "prefix:", ["exactly one"]),
    ("prefix_both", _score(prefix=S(text="q", ids=[4])), "prefix:", ["exactly one"]),
    ("sample_id_over_vocab", _score(samples=[S(ids=[1]), S(ids=[1, 2, VOCAB])]), "samples[1].ids[2]:",
     [str(VOCAB), "vocabulary"]),
    ("negative_sample_id", _score(samples=[S(ids=[-1])]), "samples[0].ids[0]:", ["-1"]),
    ("prefix_id_over_vocab", _score(prefix=S(ids=[5, VOCAB + 9])), "prefix.ids[1]:", [str(VOCAB)]),
    ("too_many_samples", _score(samples=[S(ids=[1])] * 65), "samples:", ["65", "64"]),
    ("too_many_tokens", _score(prefix=S(ids=[1] * 2000), samples=[S(ids=[2] * 30)] * 2), "samples[1]:", ["2048"]),
    ("too_many_text_tokens", _score(samples=[S(text="word " * 2100)]), "samples[0]:", ["2048"]),
    ("no_labels", _score(label_ids=[]), "label_ids:", ["at least one"]),
    ("label_over_vocab", _score(label_ids=[1, VOCAB]), "label_ids[1]:", [str(VOCAB)]),
    ("negative_label", _score(label_ids=[-5]), "label_ids[0]:", ["-5"]),
    ("too_many_labels", _score(label_ids=list(range(17))), "label_ids:", ["17", "16"]),
    ("score_priority", _score(priority=7), "priority:", ["7", "ONLINE"]),
    ("beam_width_zero", _beam(beam_width=0), "beam_width:", ["[1, 400]"]),
    ("beam_width_over", _beam(beam_width=401), "beam_width:", ["401", "400"]),
    ("beam_width_negative", _beam(beam_width=-3), "beam_width:", ["-3"]),
    ("new_tokens_zero", _beam(new_tokens=0), "new_tokens:", ["[1, 5]"]),
    ("new_tokens_over", _beam(new_tokens=6), "new_tokens:", ["6", "5"]),
    ("no_prompt", pb2.BeamSearchRequest(beam_width=2, new_tokens=1), "prompt:", ["required"]),
    ("empty_prompt", _beam(prompt=S()), "prompt:", ["exactly one"]),
    ("prompt_both", _beam(prompt=S(text="hi", ids=[1])), "prompt:", ["exactly one"]),
    ("prompt_id_over_vocab", _beam(prompt=S(ids=[1, 2, 3, VOCAB])), "prompt.ids[3]:", [str(VOCAB), "vocabulary"]),
    ("prompt_too_long", _beam(prompt=S(ids=[7] * 1025)), "prompt:", ["1025", "1024"]),
    ("text_prompt_too_long", _beam(prompt=S(text="word " * 1200)), "prompt:", ["1024"]),
    ("beam_priority", _beam(priority=-1), "priority:", ["-1"]),
]


@pytest.mark.parametrize("name,msg,field,words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_request_names_the_field(client, name, msg, field, words):
    call = client.stub.Score if isinstance(msg, pb2.ScoreRequest) else client.stub.BeamSearch
    with pytest.raises(grpc.RpcError) as err:
        call(msg, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    details = err.value.details()
    assert details.startswith(field), details
    for w in words:
        assert w in details, details
    ok = call(_score() if isinstance(msg, pb2.ScoreRequest) else _beam(), timeout=30)  # still serving
    assert len(getattr(ok, "samples", None) or ok.beams) >= 1


def test_corrupt_message_is_invalid_argument(server):
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_unary("/slmrank.v1.Ranker/Score", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x12\x02\x0a\xff", timeout=10)  # samples[0].text: invalid UTF-8
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("request: not a valid Score request message")


def test_message_size_limit(client):
    with pytest.raises(grpc.RpcError) as err:
        client.score(["x" * (2 << 20)], [1])  # over the 1 MiB default: refused before it is parsed
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.score([[1]], [2]).samples


# ---- fuzz ----------------------------------------------------------------------------------------

# Valid pieces are drawn as often as anything-goes ones, so that about half the requests run.
_valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5)
_any_ids = st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.sampled_from([-2**31, VOCAB, 2**31 - 1])), max_size=5)
_valid_segments = st.one_of(st.builds(lambda t: pb2.Segment(text=t), st.text(min_size=1, max_size=12)),
                            st.builds(lambda ids: pb2.Segment(ids=ids), _valid_ids))
_any_segments = st.builds(lambda text, ids: pb2.Segment(text=text, ids=ids), st.text(max_size=12), _any_ids)
_segments = st.one_of(_valid_segments, _valid_segments, _any_segments)
_priorities = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(-2, 9))
_scores = st.builds(
    lambda prefix, samples, labels, priority: pb2.ScoreRequest(
        prefix=prefix, samples=samples, label_ids=labels, priority=priority),
    st.one_of(st.none(), _segments), st.lists(_segments, max_size=4), st.one_of(_valid_ids, _any_ids), _priorities)
_beams = st.builds(
    lambda prompt, width, new_tokens, priority: pb2.BeamSearchRequest(
        prompt=prompt, beam_width=width, new_tokens=new_tokens, priority=priority),
    st.one_of(st.none(), _valid_segments, _valid_segments, _segments),
    st.one_of(st.integers(1, 3), st.integers(1, 3), st.integers(-1, 3), st.sampled_from([401, -2**31, 2**31 - 1])),
    st.one_of(st.integers(1, 2), st.integers(1, 2), st.integers(-1, 2), st.sampled_from([6, 2**31 - 1])), _priorities)


def _ok_or_invalid_argument(call: Callable[..., Any], msg: Any) -> None:
    try:
        call(msg, timeout=60)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), msg)


_FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@_FUZZ
@given(msg=_scores)
def test_fuzz_score_is_ok_or_invalid_argument(client, msg):
    _ok_or_invalid_argument(client.stub.Score, msg)


@_FUZZ
@given(msg=_beams)
def test_fuzz_beam_search_is_ok_or_invalid_argument(client, msg):
    _ok_or_invalid_argument(client.stub.BeamSearch, msg)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.binary(max_size=48), st.just(b"\xff\xff\xff\x0f"), st.just(b"\x12\x02\x0a\xff")))
def test_fuzz_raw_bytes_are_ok_or_invalid_argument(server, raw):
    with grpc.insecure_channel(server.target) as ch:
        for method in ("Score", "BeamSearch"):
            call = ch.unary_unary(f"/slmrank.v1.Ranker/{method}", request_serializer=bytes,
                                  response_deserializer=bytes)
            try:
                call(raw, timeout=60)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), raw)


def test_server_healthy_after_fuzz_and_errors(client, server):
    assert server.health() == "SERVING"
    assert server.health("slmrank.v1.Ranker") == "SERVING"
    stats = server.on_loop(server.server.stats)
    assert not any(k.endswith("INTERNAL") for k in stats["statuses"]), stats["statuses"]
    assert client.score([[1, 2]], [3]).samples


# ---- health, reflection, admission refusals ------------------------------------------------------

def test_health_not_serving_until_loaded_then_serving(model):
    gate = threading.Event()

    def slow_loader() -> Model:
        assert gate.wait(30)
        return model

    # τ assumed 10 s before any measurement: a request with a 2 s deadline is refused at once
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, admission=AdmissionConfig(default_service_s=10.0))
    srv = ServerThread(RankerServer(config, slow_loader))
    try:
        assert srv.health() == "NOT_SERVING"
        assert srv.health("slmrank.v1.Ranker") == "NOT_SERVING"
        with RankerClient(srv.target) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.score([[1]], [2], timeout_s=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            gate.set()
            srv.wait_serving(30)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                c.score([[1]], [2], timeout_s=2.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert time.monotonic() - t0 < 1.0, "refused at once, not run late"
            trailers = dict(err.value.trailing_metadata())
            assert int(trailers["retry-after-ms"]) > 0 and "retry after" in err.value.details()
            assert c.score([[1]], [2], timeout_s=None).samples  # no deadline: admitted and served
    finally:
        gate.set()
        srv.stop()


def test_reflection_lists_and_describes_ranker(server):
    with grpc.insecure_channel(server.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="slmrank.v1.Ranker")]
        responses = list(stub.ServerReflectionInfo(iter(reqs), timeout=10))
    names = [s.name for s in responses[0].list_services_response.service]
    assert "slmrank.v1.Ranker" in names and "grpc.health.v1.Health" in names
    assert responses[1].file_descriptor_response.file_descriptor_proto  # what grpcurl needs


def test_status_of_maps_every_error():
    cases = [
        (RequestError("samples[2]", "empty"), grpc.StatusCode.INVALID_ARGUMENT, "samples[2]: empty"),
        (Overloaded("queue_full", 0.0123, "ONLINE lane holds 128"), grpc.StatusCode.UNAVAILABLE, "retry after 12 ms"),
        (NotServing("draining", 0.5), grpc.StatusCode.UNAVAILABLE, "retry after 500 ms"),
        (DeadlineExpired("deadline passed"), grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"),
        (DeadlineUnmeetable("shorter than"), grpc.StatusCode.DEADLINE_EXCEEDED, "shorter than"),
        (ExecutionError("batch of 2 failed"), grpc.StatusCode.INTERNAL, "batch of 2 failed"),
        (KeyError("secret internals"), grpc.StatusCode.INTERNAL, "internal error (KeyError)"),
    ]
    for exc, code, text in cases:
        got_code, message, trailers = status_of(exc)
        assert got_code == code and text in message, (exc, message)
        assert ("retry-after-ms" in dict(trailers)) == isinstance(exc, (Overloaded, NotServing))
    assert "secret" not in status_of(KeyError("secret internals"))[1]
    assert dict(status_of(Overloaded("draining", 0.0))[2])["retry-after-ms"] == "1"


def test_a_second_server_on_a_taken_port_fails_to_start_clearly(server, model):
    """ServerThread reports a server that cannot start (here: its port is taken) to its caller."""
    with pytest.raises(RuntimeError, match="the server failed to start"):
        ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=server.port, grace_s=1), lambda: model))
    assert server.health() == "SERVING"


def test_serve_on_a_taken_port_exits_with_a_clear_error(tmp_path) -> None:
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model", "embedded:tiny", "--host",
                               "127.0.0.1", "--port", str(port), "--quiet"],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SLMRANK_CACHE": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"slmrank serve: error: cannot listen on 127.0.0.1:{port}: the port is in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_beam_response_bytes_are_protobufs_own_and_texts_the_tokenizers(embedded_tiny):
    """The codec writes a BeamSearchResponse's wire bytes itself: byte for byte what protobuf
    serializes for the same message, with the tokenizer's texts, over random beams and the edges
    (ids needing 1, 2 and 3 varint bytes, logprob +0.0 / -0.0 / tiny / NaN, a character cut between
    tokens, an id the model has but the tokenizer does not: U+FFFD there only, no beams at all)."""
    import math

    from service.model.tokenizer import load_tokenizer
    from service.runtime.requests import Beam, BeamResult
    from service.serving.grpc_codec import Codec

    art = embedded_tiny[1]
    tok = load_tokenizer(art.tokenizer_dir)
    codec = Codec(art, tok)
    pb2 = codec.pb2
    assert art.config.vocab_size > tok.vocab_size, "the check needs ids the tokenizer does not know"

    def reference(beams: list[Beam]) -> Any:
        return pb2.BeamSearchResponse(beams=[pb2.Beam(ids=b.ids, logprob=b.logprob, text=codec.text(b.ids))
                                             for b in beams])

    rng = random.Random(5)
    cut = tok.encode("数据 🙂 é")
    cases = [[Beam([rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 6))], -rng.random() * 30)
              for _ in range(rng.randint(1, 60))] for _ in range(40)]
    cases += [[Beam([0, 127, 128, 16383, 16384, tok.vocab_size - 1], 0.0), Beam([5], -0.0), Beam([6], -1e-42),
               Beam(cut[:1], math.nan), Beam([cut[0], tok.vocab_size + 3, cut[1]], -1.0),
               Beam([art.config.vocab_size - 1], -2.5)], []]
    for beams in cases:
        want = reference(beams)
        got = codec.beam_response(BeamResult(beams))
        assert isinstance(got, bytes)
        parsed = pb2.BeamSearchResponse.FromString(got)
        assert [b.text for b in parsed.beams] == [b.text for b in want.beams]
        if not any(math.isnan(b.logprob) for b in beams):
            assert parsed == want
        assert got == want.SerializeToString(), beams
    odd = pb2.BeamSearchResponse.FromString(codec.beam_response(BeamResult(cases[-2]))).beams[4]
    assert odd.text == tok.decode(cut[:1]) + "\ufffd" + tok.decode(cut[1:2])
    with pytest.raises(ValueError, match="vocabulary"):
        codec.beam_response(BeamResult([Beam([art.config.vocab_size], -1.0)]))


def test_beam_response_from_output_rows_is_the_same_bytes(embedded_tiny):
    """A result that carries its output rows (as unpack_beam's do) is written by the C++ BeamWire:
    the same bytes as the Python path over random beams of every width and the edges (+0.0, -0.0,
    NaN, ids of 1-3 varint bytes, characters cut between tokens and invalid UTF-8 joins, made valid
    as Python's errors="replace"); an id the tokenizer lacks falls back to the Python path (its
    U+FFFD), one outside the model's vocabulary is still an error."""
    import math

    import torch

    from service.model.tokenizer import load_tokenizer
    from service.runtime.requests import Beam, BeamResult
    from service.serving.grpc_codec import Codec
    from cpp_dag._core import utf8_replace

    art = embedded_tiny[1]
    tok = load_tokenizer(art.tokenizer_dir)
    codec = Codec(art, tok)
    assert codec._wire is not None, "the tiktoken tokenizer's token bytes feed the C++ encoder"
    table = tok.token_bytes()
    high = [i for i, b in enumerate(table) if b is not None and any(c >= 0x80 for c in b)]  # bytes of cut characters

    def both(ids: list[list[int]], lps: list[float]) -> tuple[bytes, bytes]:
        seqs, scores = torch.tensor(ids, dtype=torch.int64).reshape(len(ids), -1), torch.tensor(lps, dtype=torch.float32)
        beams = [Beam(list(r), lp) for r, lp in zip(seqs.tolist(), scores.tolist())]
        return codec.beam_response(BeamResult(beams, (seqs, scores))), codec.beam_response(BeamResult(beams))

    rng = random.Random(11)
    for case in range(60):
        width, n = rng.randint(1, 400 if case % 10 == 0 else 40), rng.randint(1, 6)
        pool = high if case % 2 else range(tok.vocab_size)
        ids = [[rng.choice(pool) for _ in range(n)] for _ in range(width)]
        lps = [-rng.random() * 40 for _ in range(width)]
        fast, slow = both(ids, lps)
        assert fast == slow, case
    edges = [[0, 127, 128], [16383, 16384, tok.vocab_size - 1], [5, 6, 7], [high[0], high[1], high[2]]]
    for lps in ([0.0, -0.0, math.nan, -1e-42], [-1.5, -2.5, -3.5, -4.5]):
        fast, slow = both(edges, lps)
        assert fast == slow
    # the C++ replacement is CPython's, on the joins a response meets and on arbitrary bytes
    for _ in range(3000):
        raw = bytes(rng.choice([rng.randrange(256), rng.randrange(0x80, 0x100)]) for _ in range(rng.randint(0, 9)))
        assert utf8_replace(raw) == raw.decode("utf-8", errors="replace").encode(), raw
    # fallbacks: an id the model has but the tokenizer does not (U+FFFD, the Python path), and one
    # outside the model's vocabulary (an error, never a response)
    fast, slow = both([[5, tok.vocab_size + 3, 6]], [-1.0])
    assert fast == slow and "\ufffd" in codec.pb2.BeamSearchResponse.FromString(fast).beams[0].text
    with pytest.raises(ValueError, match="vocabulary"):
        both([[art.config.vocab_size]], [-1.0])
