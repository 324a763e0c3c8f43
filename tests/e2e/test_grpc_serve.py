"""`slmrank serve` as a subprocess on embedded:tiny, over real gRPC on loopback: its answers equal
`slmrank run` on the same requests, `slmrank client` prints them as JSON, and SIGTERM with
requests in flight finishes every one of them, refuses new ones, and exits 0 within the grace.

One server for the module; the SIGTERM test is the last one and stops it.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.cli import main as cli_main
from service.serving.client import RankerClient
from tests.e2e.served import start_serve, wait_port

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 151936  # embedded:tiny uses the Qwen vocabulary
GRACE_S = 25.0


class Served:
    def __init__(self, cache: Path, log: Path) -> None:
        self.log = log
        self.proc, self.lines = start_serve(cache, log, "--grace-s", str(GRACE_S))
        self.target = f"127.0.0.1:{wait_port(self.proc, self.lines, log)}"

    def health(self) -> str:
        with grpc.insecure_channel(self.target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self) -> None:
        end = time.monotonic() + 120
        while self.health() != "SERVING":
            assert self.proc.poll() is None and time.monotonic() < end, self.log.read_text()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slmrank_cache")


@pytest.fixture(scope="module")
def served(cache: Path, tmp_path_factory: pytest.TempPathFactory):
    s = Served(cache, tmp_path_factory.mktemp("serve") / "serve.log")
    s.wait_serving()
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def f32(x: float) -> float:
    return float(np.float32(x))


def test_serve_equals_slmrank_run(served: Served, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    rng = random.Random(7)
    score = {"id": "s", "kind": "score", "prefix_ids": _ids(rng, 10), "samples": [_ids(rng, 3), _ids(rng, 5)],
             "label_ids": _ids(rng, 3)}
    beam = {"id": "b", "kind": "beam", "prompt_ids": _ids(rng, 14), "beam_width": 4, "new_tokens": 3}
    requests, out = tmp_path / "requests.jsonl", tmp_path / "out.jsonl"
    requests.write_text(json.dumps(score) + "\n" + json.dumps(beam) + "\n")
    monkeypatch.setenv("SLMRANK_CACHE", str(cache))
    assert cli_main(["run", "--model", "embedded:tiny", "--requests", str(requests), "--out", str(out), "--quiet"]) == 0
    ref_score, ref_beam = [json.loads(x) for x in out.read_text().splitlines()]

    with RankerClient(served.target, timeout_s=60) as c:
        got = c.score(score["samples"], score["label_ids"], prefix=score["prefix_ids"], priority="online")
        assert [list(s.logprobs) for s in got.samples] == [[f32(x) for x in row] for row in ref_score["scores"]]
        got = c.beam(beam["prompt_ids"], 4, 3, priority="background")
        assert [list(b.ids) for b in got.beams] == [b["ids"] for b in ref_beam["beams"]]
        assert [b.logprob for b in got.beams] == [f32(b["logprob"]) for b in ref_beam["beams"]]


def test_client_cli_prints_json_and_errors(served: Served, capsys: pytest.CaptureFixture):
    args = ["client", "score", "--target", served.target, "--sample-ids", "1,2,3", "4 5", "--prefix", "Query:",
            "--labels", "9834", "902", "--priority", "online", "--timeout", "60"]
    assert cli_main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["samples"]) == 2 and all(len(s["logprobs"]) == 2 for s in printed["samples"])
    with RankerClient(served.target) as c:  # the printed floats read back as the same float32s
        direct = c.score([[1, 2, 3], [4, 5]], [9834, 902], prefix="Query:")
    assert [[f32(x) for x in s["logprobs"]] for s in printed["samples"]] == [list(s.logprobs) for s in direct.samples]

    assert cli_main(["client", "beam", "--target", served.target, "--prompt", "Running shoes are",
                     "--beam-width", "2", "--new-tokens", "2"]) == 0
    beams = json.loads(capsys.readouterr().out)["beams"]
    assert len(beams) == 2 and all(len(b["ids"]) == 2 and isinstance(b["text"], str) for b in beams)

    assert cli_main(["client", "beam", "--target", served.target, "--prompt-ids", "1,2", "--beam-width", "0",
                     "--new-tokens", "2"]) == 1
    assert "INVALID_ARGUMENT: beam_width: 0 is outside the allowed range [1, 400]" in capsys.readouterr().err


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(served: Served):
    """Runs last: it stops the module's server."""
    pb2 = RankerClient(served.target).pb2
    rng = random.Random(3)
    # different new_tokens never share a batch: several batches run one after the other
    msgs = [pb2.BeamSearchRequest(prompt=pb2.Segment(ids=_ids(rng, 16)), beam_width=4, new_tokens=1 + i % 4)
            for i in range(8)]
    with RankerClient(served.target) as c:
        futures = [c.stub.BeamSearch.future(m, timeout=60) for m in msgs]
        end = time.monotonic() + 60
        while not any(f.done() for f in futures):  # the server is working through them
            assert time.monotonic() < end
            time.sleep(0.01)
        served.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while served.health() != "NOT_SERVING":
            assert time.monotonic() - t0 < 5, "health never went NOT_SERVING"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            c.score([[1, 2]], [3], timeout_s=10)
        num_pending = sum(not f.done() for f in futures)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        results = [f.result() for f in futures]  # every in-flight request completes
    assert num_pending > 0, "the drain had finished before the new request: nothing was in flight"
    assert all(len(r.beams) == 4 for r in results)
    assert served.proc.wait(timeout=GRACE_S + 5) == 0
    assert time.monotonic() - t0 < GRACE_S, "exited after the grace"
    assert "SIGTERM: draining" in served.log.read_text()
