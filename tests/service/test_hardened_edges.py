"""The edges of issue 11, one test each, over real gRPC on loopback (the server in this process on its
own event loop): an artifact load that could never finish fails at once; invalid UTF-8 names its
field; text too long for the token limit is refused before it is tokenized; a bound on RPCs in flight
answers UNAVAILABLE with a hint; a burst past gRPC's own pending-call limit is never CANCELLED;
"loading" and "draining" carry retry hints; requests arriving while the server stops are never
CANCELLED; a request's client is its x-client-id, else its peer's host.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from service.artifact.artifact import ArtifactError, load_artifact
from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig
from service.serving.proto_gen import load as load_stubs
from service.serving.server import Model, RankerServer, ServerConfig, client_of
from service.serving.server_thread import ServerThread

pb2, pb2_grpc = load_stubs().pb2, load_stubs().pb2_grpc


def _score(seed: int, text: str | None = None) -> Any:
    rng = random.Random(seed)
    samples = [pb2.Segment(ids=[rng.randrange(500) for _ in range(3)]) for _ in range(2)]
    if text is not None:
        samples.append(pb2.Segment(text=text))
    return pb2.ScoreRequest(prefix=pb2.Segment(ids=[rng.randrange(500) for _ in range(5)]), samples=samples,
                            label_ids=[3, 4])


def _trailers(e: grpc.RpcError) -> dict[str, str]:
    return dict(e.trailing_metadata() or ())


class GatedRuntime:
    """The Python runtime behind a gate the test opens: a batch as long as the test wants."""

    name = "gated"

    def __init__(self, inner: Any) -> None:
        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()
        self.gate.set()

    def run_score(self, batch: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(30)
        return self.inner.run_score(batch)

    def run_beam(self, batch: Any) -> Any:
        self.entered.set()
        assert self.gate.wait(30)
        return self.inner.run_beam(batch)


def _serve(model: Model, **config: Any) -> ServerThread:
    config = {"grace_s": 5, "trace_sample_rate": 0.0, **config}
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, **config), lambda: model))
    srv.wait_serving()
    return srv


@pytest.fixture(scope="module")
def small_model(qwen2_tiny):
    """The tiny random Qwen2 (vocabulary 512): requests take milliseconds, so bursts are cheap."""
    from service.model.tokenizer import load_tokenizer

    art = qwen2_tiny.artifact
    return Model(art, qwen2_tiny.runtime, load_tokenizer(art.tokenizer_dir))


@pytest.fixture(scope="module")
def server(model):
    srv = _serve(model)
    yield srv
    srv.stop()


# ---- artifact loads that could never finish ------------------------------------------------------

@pytest.mark.parametrize("file, make", [
    ("weights.safetensors", lambda p: p.symlink_to("/dev/zero")),
    ("weights.safetensors", lambda p: os.mkfifo(p)),
    ("manifest.msgpack", lambda p: p.symlink_to("/dev/zero")),
    ("tokenizer", lambda p: p.symlink_to("/dev/null")),
], ids=["weights-dev-zero", "weights-fifo", "manifest-dev-zero", "tokenizer-file-dev-null"])
def test_an_artifact_load_that_could_never_finish_fails_at_once(qwen2_tiny, tmp_path, file, make):
    art = tmp_path / "art"
    shutil.copytree(qwen2_tiny.artifact.path, art)
    target = art / file
    if target.is_dir():
        first = next(p for p in sorted(target.iterdir()) if p.is_file())  # a tokenizer file
        target = first
    target.unlink()
    make(target)
    t0 = time.monotonic()
    with pytest.raises(ArtifactError) as e:
        load_artifact(art)
    assert time.monotonic() - t0 < 5
    assert str(target) in str(e.value) and "regular file" in str(e.value)


def test_a_server_whose_artifact_cannot_load_says_so_instead_of_loading_forever(qwen2_tiny, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(qwen2_tiny.artifact.path, art)
    (art / "weights.safetensors").unlink()
    (art / "weights.safetensors").symlink_to("/dev/zero")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="regular file"):
        ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=1), lambda: load_artifact(art)),
                     wait_ready=True)
    assert time.monotonic() - t0 < 30


# ---- bad text ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("method, message, field", [
    ("Score", pb2.ScoreRequest(samples=[pb2.Segment(ids=[1]), pb2.Segment(text="XX")], label_ids=[1]),
     "samples[1].text"),
    ("Score", pb2.ScoreRequest(prefix=pb2.Segment(text="XX"), samples=[pb2.Segment(ids=[1])], label_ids=[1]),
     "prefix.text"),
    ("BeamSearch", pb2.BeamSearchRequest(prompt=pb2.Segment(text="abcXX"), beam_width=2, new_tokens=1),
     "prompt.text"),
], ids=["sample", "prefix", "prompt"])
def test_invalid_utf8_names_its_field(server, method, message, field):
    raw = message.SerializeToString().replace(b"XX", b"\xc3\x28")  # a lead byte, then no continuation
    with grpc.insecure_channel(server.target) as ch:
        call = ch.unary_unary(f"/slmrank.v1.Ranker/{method}", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as err:
            call(raw, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}: is not valid UTF-8"), err.value.details()


def test_text_too_long_for_the_limit_is_refused_before_tokenizing(server, model):
    limits, per_token = model.artifact.limits, model.tokenizer.max_token_bytes
    codec = server.server.servicer.codec
    before = codec.tokenize_stats.num_segments
    cases = [
        ("Score", _score(1, "a" * (2 * limits.max_score_tokens * per_token + 1)), "samples[2].text"),
        ("BeamSearch", pb2.BeamSearchRequest(prompt=pb2.Segment(text="b" * (2 * limits.max_prompt_tokens * per_token
                                                                             + 1)), beam_width=2, new_tokens=1),
         "prompt.text"),
    ]
    with grpc.insecure_channel(server.target) as ch:
        stub = pb2_grpc.RankerStub(ch)
        for method, msg, field in cases:
            assert len(msg.SerializeToString()) < ServerConfig().max_receive_message_bytes
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, method)(msg, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}: ") and "before tokenizing" in err.value.details()
            assert time.monotonic() - t0 < 1.0
    assert codec.tokenize_stats.num_segments == before, "a segment was tokenized"


# ---- bounds and hints at the gRPC layer -------------------------------------------------------------

@pytest.mark.parametrize("fronts", [0, 1])  # with a front, the front holds the same bound
def test_rpcs_beyond_the_bound_are_refused_at_once_with_a_hint(small_model, fronts):
    runtime = GatedRuntime(small_model.runtime)
    srv = _serve(Model(small_model.artifact, runtime, small_model.tokenizer), metrics_port=0, fronts=fronts,
                 admission=AdmissionConfig(max_inflight_rpcs=4, max_retry_after_s=1.0),
                 batcher=BatcherConfig(max_inflight=1, validate_requests=False))
    try:
        runtime.gate.clear()
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb2_grpc.RankerStub(ch)
            held = [stub.Score.future(_score(i), timeout=30) for i in range(4)]
            assert runtime.entered.wait(10)
            end = time.monotonic() + 10
            while srv.on_loop(lambda: srv.server.interceptor.inflight) < 4:
                assert time.monotonic() < end
                time.sleep(0.01)
            refused = []
            for i in range(6):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as err:
                    stub.Score(_score(10 + i), timeout=30)
                refused.append((err.value, time.monotonic() - t0))
            runtime.gate.set()
            assert all(f.result(timeout=30).samples for f in held)
        for e, took in refused:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "rpc_limit" in e.details(), e.details()
            assert 0 < int(_trailers(e)["retry-after-ms"]) <= 1000 and took < 1.0
        stats = srv.on_loop(lambda: srv.server.stats())
        if fronts:
            assert stats["statuses"] == {"Score.OK": 4} and stats["fronts"]["refused_queue_full"] == 6, stats
        else:
            assert stats["statuses"] == {"Score.OK": 4, "Score.UNAVAILABLE": 6}
    finally:
        runtime.gate.set()
        srv.stop()


def test_a_burst_past_grpcs_pending_limit_is_answered_never_cancelled(small_model):
    """gRPC cancels, with no status a client could act on, the calls beyond 1,000 its event loop has
    not taken yet: 1,500 at once all get an answer, every refusal with a hint, all counted."""
    srv = _serve(small_model, admission=AdmissionConfig(max_queue_normal=64, max_retry_after_s=1.0))

    async def burst() -> list[grpc.aio.AioRpcError | None]:
        async with grpc.aio.insecure_channel(srv.target) as ch:
            stub = pb2_grpc.RankerStub(ch)

            async def one(i: int) -> grpc.aio.AioRpcError | None:
                try:
                    await stub.Score(_score(i), timeout=60)
                    return None
                except grpc.aio.AioRpcError as e:
                    return e

            return list(await asyncio.gather(*(one(i) for i in range(1500))))

    try:
        errors = asyncio.run(burst())
        codes = Counter("OK" if e is None else e.code().name for e in errors)
        assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
        assert all(0 < int(_trailers(e)["retry-after-ms"]) <= 1000 for e in errors if e is not None)
        statuses = srv.on_loop(lambda: srv.server.stats()["statuses"])
        assert statuses == {f"Score.{c}": n for c, n in codes.items()}, (statuses, codes)
    finally:
        srv.stop()


def test_loading_and_draining_carry_a_retry_hint(small_model):
    gate = threading.Event()
    runtime = GatedRuntime(small_model.runtime)

    def slow_loader() -> Model:
        assert gate.wait(30)
        return Model(small_model.artifact, runtime, small_model.tokenizer)

    config = ServerConfig(host="127.0.0.1", port=0, grace_s=10, trace_sample_rate=0.0,
                          admission=AdmissionConfig(unavailable_retry_s=0.25),
                          batcher=BatcherConfig(max_inflight=1, validate_requests=False))
    srv = ServerThread(RankerServer(config, slow_loader))
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb2_grpc.RankerStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(_score(1), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in err.value.details()
            assert _trailers(err.value)["retry-after-ms"] == "250"
            gate.set()
            srv.wait_serving()
            runtime.gate.clear()
            held = stub.Score.future(_score(2), timeout=30)
            assert runtime.entered.wait(10)
            stopping = threading.Thread(target=srv.stop)
            stopping.start()
            end = time.monotonic() + 10
            while not srv.server.servicer.is_draining:
                assert time.monotonic() < end
                time.sleep(0.005)
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(_score(3), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            assert _trailers(err.value)["retry-after-ms"] == "250"
            runtime.gate.set()
            assert held.result(timeout=30).samples  # in flight when the drain began: finished
            stopping.join(30)
    finally:
        gate.set()
        runtime.gate.set()


def test_requests_arriving_while_the_server_stops_are_never_cancelled(small_model):
    srv = _serve(small_model, grace_s=6)  # room for the 1 s lull after the last request, on a loaded box

    async def stream() -> list[grpc.aio.AioRpcError | None]:
        async with grpc.aio.insecure_channel(srv.target) as ch:
            stub = pb2_grpc.RankerStub(ch)

            async def one(i: int) -> grpc.aio.AioRpcError | None:
                try:
                    await stub.Score(_score(i), timeout=10)
                    return None
                except grpc.aio.AioRpcError as e:
                    return e

            tasks = []
            stopping = threading.Thread(target=srv.stop)
            for i in range(400):
                tasks.append(asyncio.ensure_future(one(i)))
                if i == 100:
                    stopping.start()
                await asyncio.sleep(0.003)
            out = list(await asyncio.gather(*tasks))
            stopping.join(30)
            return out

    errors = asyncio.run(stream())
    codes = Counter("OK" if e is None else e.code().name for e in errors)
    assert set(codes) <= {"OK", "UNAVAILABLE"} and codes["OK"] >= 50 and codes["UNAVAILABLE"] >= 50, codes
    # the listener stays open while requests keep arriving (within the grace): every one that came
    # after the stop began is answered "draining", with a hint, by the server itself
    for e in errors:
        if e is not None:
            assert "draining" in e.details(), e.details()
            assert int(_trailers(e)["retry-after-ms"]) > 0


# ---- the client of a request ---------------------------------------------------------------------

def test_a_requests_client_is_its_client_id_else_its_peers_host():
    def ctx(peer: str, metadata: tuple = ()) -> Any:
        return SimpleNamespace(peer=lambda: peer, invocation_metadata=lambda: metadata)

    assert client_of(ctx("ipv4:10.1.2.3:51234"), "x-client-id") == "ipv4:10.1.2.3"
    assert client_of(ctx("ipv6:[::1]:40000"), "x-client-id") == "ipv6:[::1]"
    assert client_of(ctx("unix:/run/slmrank.sock"), "x-client-id") == "unix:/run/slmrank.sock"
    assert client_of(ctx("ipv4:10.1.2.3:51234", (("x-client-id", "ranker-7"),)), "x-client-id") == "ranker-7"
    assert client_of(ctx("ipv4:10.1.2.3:1", (("x-client-id", "z" * 500),)), "x-client-id") == "z" * 128
    assert client_of(ctx("ipv4:10.1.2.3:1", (("other", "q"),)), "x-client-id") == "ipv4:10.1.2.3"
