"""gRPC's own retries honour the server's retry hint: every refusal with a hint carries it as
`grpc-retry-pushback-ms` (gRFC A6) beside `retry-after-ms`, and a stock grpcio channel with the
service config of docs/operations.md (read from the page itself) waits that long, then gets the
answer. The server is a real RankerServer (embedded:tiny, Python runtime) whose first Score is
refused by admission's exception, through the real StatusInterceptor."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import grpc
import pytest

from service.runtime.requests import RequestError
from service.sched.verdict import DeadlineExpired, Overloaded
from service.serving.proto_gen import load as load_stubs
from service.serving.server import RankerServer, RankerServicer, ServerConfig
from service.serving.server_thread import ServerThread
from service.serving.status import PUSHBACK_KEY, RETRY_KEY, NotServing, status_of

ROOT = Path(__file__).resolve().parents[2]
HINT_S = 0.3
stubs = load_stubs()


def test_every_refusal_with_a_hint_carries_the_pushback_too():
    for exc in (Overloaded("queue_full", 0.0123, "ONLINE lane holds 128"), NotServing("loading", 0.5),
                NotServing("draining", 0.25), Overloaded("rpc_limit", 0.0, "1024 at once")):
        code, _, trailers = status_of(exc)
        got = dict(trailers)
        assert code == grpc.StatusCode.UNAVAILABLE and got[PUSHBACK_KEY] == got[RETRY_KEY], exc
        assert int(got[PUSHBACK_KEY]) >= 1  # 0 or less would make gRPC's client give up, not retry
    for exc in (RequestError("samples", "empty"), DeadlineExpired("passed"), KeyError("x")):
        assert PUSHBACK_KEY not in dict(status_of(exc)[2]), "a status no retry helps has no pushback"


def documented_service_config() -> dict:
    """The retry service config docs/operations.md gives operators (its one JSON block with a retryPolicy)."""
    text = (ROOT / "docs/operations.md").read_text()
    blocks = [b for b in re.findall(r"```json\n(.*?)```", text, re.S) if "retryPolicy" in b]
    assert len(blocks) == 1, "docs/operations.md should show one retry service config"
    return json.loads(blocks[0])


class RefuseFirst(RankerServicer):
    """The real servicer, whose first Score is refused as admission refuses (UNAVAILABLE, a hint)."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[float] = []

    async def Score(self, request, context):
        self.attempts.append(time.monotonic())
        if len(self.attempts) == 1:
            raise Overloaded("queue_full", HINT_S, "the first attempt is refused")
        return await super().Score(request, context)


@pytest.fixture(scope="module")
def refusing_server(model):
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=5), lambda: model,
                                    servicer=RefuseFirst()))
    srv.wait_serving()
    yield srv
    srv.stop()


def test_a_stock_grpc_client_retries_after_the_pushback(refusing_server):
    config = documented_service_config()
    policy = config["methodConfig"][0]["retryPolicy"]
    assert "UNAVAILABLE" in policy["retryableStatusCodes"] and float(policy["initialBackoff"][:-1]) < HINT_S / 2
    servicer = refusing_server.server.servicer
    options = [("grpc.service_config", json.dumps(config)), ("grpc.enable_retries", 1)]
    with grpc.insecure_channel(refusing_server.target, options=options) as channel:
        stub = stubs.pb2_grpc.RankerStub(channel)
        request = stubs.pb2.ScoreRequest(samples=[stubs.pb2.Segment(ids=[1, 2, 3])], label_ids=[4, 5])
        t0 = time.monotonic()
        response = stub.Score(request, timeout=30)  # no exception: gRPC retried by itself
        took = time.monotonic() - t0
    assert len(response.samples) == 1 and len(response.samples[0].logprobs) == 2
    assert len(servicer.attempts) == 2
    # the policy's own backoff is at most 50 ms; only the server's pushback makes it wait this long
    gap = servicer.attempts[1] - servicer.attempts[0]
    assert gap >= HINT_S - 0.01 and took >= HINT_S - 0.01, (gap, took)
