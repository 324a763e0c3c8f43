"""Admission control over real gRPC on loopback: a RankerServer (embedded:tiny, Python runtime) on
its own uvloop thread, loaded well past its capacity for a few seconds by an asyncio client in a
process of its own.

- Overload: the excess is refused fast with UNAVAILABLE and a retry-after-ms trailer, ONLINE
  requests are still served within their deadline, and the server is healthy and right afterwards.
- A request whose deadline is shorter than the measured batch time is refused at once and never
  executed (slmrank_refused_total{reason="deadline"}); one with a 1 ms deadline is never executed.
- A request whose deadline passes while it waits behind a long batch is dropped from the queue and
  never executed (slmrank_dropped_total{reason="expired"}, or "cancelled" when grpc's deadline
  handling cancels the handler first).
- A request cancelled by its client while queued behind a long batch frees its place in the lane
  and is never executed (slmrank_dropped_total{reason="cancelled"}).

The long batch is made long on purpose: a runtime wrapper holds it at a gate the test opens. Under
overload every batch takes at least BATCH_S (the same wrapper), so the capacity the load is offered
against does not drift with this machine's CPU speed and load.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig
from service.serving.client import RankerClient
from service.runtime.engine import execute
from service.serving.proto_gen import load as load_stubs
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import ScoreRequest
from service.serving.server import Model, RankerServer, ServerConfig
from service.serving.server_thread import ServerThread as BaseServerThread

pb2 = load_stubs().pb2
pb2_grpc = load_stubs().pb2_grpc


class ServerThread(BaseServerThread):
    """The shared server thread, waiting for SERVING, plus the scheduler's stats and /metrics."""

    def __init__(self, server: RankerServer) -> None:
        super().__init__(server)
        self.wait_serving()

    def scheduler_stats(self) -> dict[str, Any]:
        return self.on_loop(lambda: self.server.stats()["scheduler"])

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while not predicate(stats := self.scheduler_stats()):
            assert time.monotonic() < end, stats
            time.sleep(0.005)
        return stats

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.server.metrics_server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

def metric_value(text: str, sample: str) -> float:
    """The value of the exposition line of `name{labels}` (labels in any order)."""
    def key(s: str) -> tuple[str, frozenset[str]]:
        name, _, labels = s.partition("{")
        return name, frozenset(labels.rstrip("}").split(",")) if labels else frozenset()

    (value,) = [ln.rsplit(" ", 1)[1] for ln in text.splitlines()
                if not ln.startswith("#") and key(ln.rsplit(" ", 1)[0]) == key(sample)]
    return float(value)


class GatedRuntime:
    """The Python runtime behind a gate: a batch waits at it until the test opens it (a batch as
    long as the test wants), and takes at least `min_batch_s` (a slower accelerator: the capacity
    the overload test works against is then its own, not this machine's CPU speed). Records every
    request it ran."""

    name = "gated"

    def __init__(self, inner: PythonRuntime, min_batch_s: float = 0.0) -> None:
        self.inner = inner
        self.min_batch_s = min_batch_s
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.ran: list[Any] = []

    def _run(self, run: Callable[..., Any], batch: Any, trace: Any) -> Any:
        t0 = time.monotonic()
        self.ran.extend(batch.requests)
        self.entered.set()
        assert self.gate.wait(30), "the gate was never opened"
        out = run(batch, trace=trace)
        time.sleep(max(0.0, self.min_batch_s - (time.monotonic() - t0)))
        return out

    def run_score(self, batch: Any, trace: Any = None) -> Any:
        return self._run(self.inner.run_score, batch, trace)

    def run_beam(self, batch: Any, trace: Any = None) -> Any:
        return self._run(self.inner.run_beam, batch, trace)


def _score_msg(seed: int, priority: int) -> Any:
    rng = random.Random(seed)
    return pb2.ScoreRequest(prefix=pb2.Segment(ids=[rng.randrange(1000) for _ in range(6)]),
                            samples=[pb2.Segment(ids=[rng.randrange(1000) for _ in range(3)]) for _ in range(2)],
                            label_ids=[11, 22], priority=priority)


# ---- overload --------------------------------------------------------------------------------------

ONLINE, NORMAL, BACKGROUND = 1, 2, 3
LOAD_S = 4.0  # offered load for this long; every call has a deadline, so the test ends by itself
MAX_BATCH_REQUESTS, MAX_INFLIGHT = 4, 1  # one at a time, and never "heavy" (heavy_batch_s above BATCH_S): on
# a CPU a heavy batch runs at nice 19, and beside the client's load got 2% of a core, 2 s a batch
BATCH_S = 0.125  # every batch takes at least this long, whatever the CPU: embedded:tiny's largest Score
# bucket for these 12-token requests holds 2 of them, so the capacity is 2 / 0.125 = 16 requests/s
RATE_PER_S = 120.0  # NORMAL + BACKGROUND requests offered per second: 7.5x the capacity (with the CPU's
# own batch time, 8-300 ms by machine and load, the ratio drifted from 2.5x to 10x and the test with it)
ONLINE_EVERY_S = 0.2
DEADLINES_S = {ONLINE: 3.0, NORMAL: 1.0, BACKGROUND: 1.5}


@dataclass
class Outcome:
    priority: int
    code: grpc.StatusCode
    latency_s: float
    retry_after_ms: int | None
    deadline_s: float


async def _call(stub: Any, msg: Any, deadline_s: float) -> Outcome:
    t0 = time.monotonic()
    try:
        await stub.Score(msg, timeout=deadline_s)
        code, retry = grpc.StatusCode.OK, None
    except grpc.aio.AioRpcError as e:
        code = e.code()
        retry = next((int(v) for k, v in (e.trailing_metadata() or ()) if k == "retry-after-ms"), None)
    return Outcome(msg.priority, code, time.monotonic() - t0, retry, deadline_s)


async def _offer_load(target: str) -> tuple[list[Outcome], float]:
    """Open loop: NORMAL / BACKGROUND at RATE_PER_S (alternating), ONLINE every ONLINE_EVERY_S."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.RankerStub(channel)
        await channel.channel_ready()
        tasks: list[asyncio.Task] = []
        start = time.monotonic()
        n = next_online = 0
        while (now := time.monotonic() - start) < LOAD_S:
            if now >= next_online:
                tasks.append(asyncio.create_task(_call(stub, _score_msg(10_000 + n, ONLINE), DEADLINES_S[ONLINE])))
                next_online += ONLINE_EVERY_S
            while n < now * RATE_PER_S:
                priority = NORMAL if n % 2 else BACKGROUND
                tasks.append(asyncio.create_task(_call(stub, _score_msg(n, priority), DEADLINES_S[priority])))
                n += 1
            await asyncio.sleep(0.002)
        offered_s = time.monotonic() - start
        return list(await asyncio.gather(*tasks)), offered_s


def _offer_load_from_another_process(target: str) -> tuple[list[Outcome], float]:
    """_offer_load in a process of its own, as real clients are: in this one, its event loop would
    share the server's GIL and, on a 2-core machine, hold up every small step of the Python
    runtime's batch (batches of ~20 ms took 0.3-2 s so)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_offer_load, target).result(timeout=120)


def _run_offer_load(target: str) -> tuple[list[Outcome], float]:
    return asyncio.run(_offer_load(target))


@pytest.fixture(scope="module")
def loaded(model):
    admission = AdmissionConfig(max_queue_online=32, max_queue_normal=32, max_queue_background=32)
    batcher = BatcherConfig(max_batch_requests=MAX_BATCH_REQUESTS, max_inflight=MAX_INFLIGHT, heavy_batch_s=4 * BATCH_S,
                            validate_requests=False)
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=0, admission=admission,
                          batcher=batcher, trace_sample_rate=0.0)
    runtime = GatedRuntime(model.runtime, min_batch_s=BATCH_S)
    srv = ServerThread(RankerServer(config, lambda: Model(model.artifact, runtime, model.tokenizer)))
    with RankerClient(srv.target, timeout_s=30) as c:  # warm up: the batch time is measured
        for i in range(3):
            c.stub.Score(_score_msg(-1 - i, NORMAL), timeout=30)
    yield srv
    srv.stop()


def test_overload_refuses_the_excess_fast_and_serves_online(loaded, model, embedded_tiny):
    before = loaded.scheduler_stats()
    outcomes, offered_s = _offer_load_from_another_process(loaded.target)
    after = loaded.wait_for(lambda s: s["inflight"] == 0 and not any(s["queue_depth"].values()))

    online = [o for o in outcomes if o.priority == ONLINE]
    rest = [o for o in outcomes if o.priority != ONLINE]
    codes = {c: sum(o.code == c for o in rest) for c in {o.code for o in rest}}
    ok = codes.get(grpc.StatusCode.OK, 0)
    refused = [o for o in rest if o.code == grpc.StatusCode.UNAVAILABLE]
    executed = after["requests_executed"] - before["requests_executed"]
    summary = (f"{len(rest)} NORMAL/BACKGROUND offered in {offered_s:.1f} s: {codes}; {len(online)} ONLINE; "
               f"executed {executed}")

    # well past capacity: most of the offered load could not be run
    assert len(rest) >= 0.9 * RATE_PER_S * LOAD_S, summary
    assert executed < 0.3 * len(outcomes), summary
    # the excess is refused, fast, with a retry hint; nothing else goes wrong
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}, summary
    assert len(refused) >= 0.5 * len(rest), summary
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) <= 0.1 * len(rest), summary
    latencies = sorted(o.latency_s for o in refused)
    p50, p90 = latencies[len(latencies) // 2], latencies[int(0.9 * len(latencies))]
    assert p50 < 0.05 and p90 < 0.2, f"refusal latency p50 {p50 * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms; {summary}"
    assert all(o.retry_after_ms is not None and o.retry_after_ms > 0 for o in refused), summary
    # some NORMAL / BACKGROUND work still gets through (OK: within its deadline, which gRPC enforces)
    assert ok > 0, summary
    # every ONLINE request served, within its deadline
    assert len(online) >= LOAD_S / ONLINE_EVERY_S - 1
    assert [o.code for o in online] == [grpc.StatusCode.OK] * len(online), [(o.code, o.latency_s) for o in online]
    assert max(o.latency_s for o in online) < DEADLINES_S[ONLINE]
    online_p50 = statistics.median(o.latency_s for o in online)

    # the server's counts agree with what the clients saw
    refused_by_server = sum(after["refused"].values()) - sum(before["refused"].values())
    assert refused_by_server == len(refused), (after["refused"], summary)
    end = time.monotonic() + 5  # grpc.aio's abort sends the status before the tracing interceptor counts it
    while metric_value(text := loaded.metrics(), 'slmrank_requests_total{kind="Score",code="UNAVAILABLE"}') < len(
            refused) and time.monotonic() < end:
        time.sleep(0.01)
    assert metric_value(text, 'slmrank_requests_total{kind="Score",code="UNAVAILABLE"}') == len(refused)
    assert metric_value(text, 'slmrank_refused_total{reason="queue_full"}') + metric_value(
        text, 'slmrank_refused_total{reason="deadline"}') == refused_by_server

    # healthy afterwards, and right
    assert loaded.health() == "SERVING"
    with RankerClient(loaded.target, timeout_s=30) as c:
        resp = c.score([[1, 2, 3], [4, 5]], [7, 8], prefix=[9, 10, 11])
    (ref,) = execute(embedded_tiny[1], model.runtime, [ScoreRequest(((1, 2, 3), (4, 5)), (7, 8), (9, 10, 11))])
    assert [list(s.logprobs) for s in resp.samples] == [[float(np.float32(x)) for x in row] for row in ref.scores]
    print(f"\n{summary}; refusal p50 {p50 * 1e3:.1f} ms p90 {p90 * 1e3:.1f} ms; ONLINE p50 {online_p50 * 1e3:.0f} ms "
          f"max {max(o.latency_s for o in online) * 1e3:.0f} ms")


# ---- deadlines -------------------------------------------------------------------------------------

def test_deadline_shorter_than_the_batch_is_refused_and_never_executed(loaded):
    """A deadline shorter than the request's own measured batch time can never be met:
    DEADLINE_EXCEEDED at once (not UNAVAILABLE: retrying does not help), never executed."""
    before = loaded.scheduler_stats()
    run_s = min(v for k, v in before["model"]["bucket_s"].items() if k.startswith("score."))
    deadline_s = max(run_s / 2, 0.02)
    assert deadline_s < run_s, f"batches are too fast here ({run_s * 1e3:.1f} ms) to show this"
    refused_before = metric_value(loaded.metrics(), 'slmrank_refused_total{reason="impossible"}')
    with RankerClient(loaded.target) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.stub.Score(_score_msg(1, NORMAL), timeout=deadline_s)
        took = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
        assert "own service time" in err.value.details() and took < deadline_s
        assert "retry-after-ms" not in dict(err.value.trailing_metadata() or ())

        with pytest.raises(grpc.RpcError) as err:  # 1 ms: refused if it gets there in time, else over on the way
            c.stub.Score(_score_msg(2, ONLINE), timeout=0.001)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.2)  # anything the server had taken would have reached the executor by now
    after = loaded.scheduler_stats()
    assert after["requests_executed"] == before["requests_executed"] and after["batches"] == before["batches"]
    assert after["refused"]["impossible"] >= before["refused"]["impossible"] + 1
    assert metric_value(loaded.metrics(), 'slmrank_refused_total{reason="impossible"}') >= refused_before + 1


@pytest.fixture
def gated(model):
    """One batch at a time behind a gate; NORMAL lane of one request."""
    runtime = GatedRuntime(model.runtime)
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=0,
                          admission=AdmissionConfig(max_queue_normal=1),
                          batcher=BatcherConfig(max_inflight=1, validate_requests=False))
    srv = ServerThread(RankerServer(config, lambda: Model(model.artifact, runtime, model.tokenizer)))
    srv.runtime = runtime
    yield srv
    runtime.gate.set()
    srv.stop()


def _hold_the_executor(srv: ServerThread, client: RankerClient) -> Any:
    """A batch that runs until the gate opens: what the next requests queue behind."""
    srv.runtime.gate.clear()
    srv.runtime.entered.clear()
    blocker = client.stub.Score.future(_score_msg(100, ONLINE), timeout=30)
    assert srv.runtime.entered.wait(10)
    return blocker


def test_request_expiring_in_the_queue_is_never_executed(gated):
    with RankerClient(gated.target) as c:
        blocker = _hold_the_executor(gated, c)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:  # admitted (τ unmeasured yet), then waits past its deadline
            c.stub.Score(_score_msg(101, NORMAL), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 2
        # the scheduler's deadline timer drops it ("expired"); should grpc's own deadline handling
        # cancel the handler a moment sooner, it is dropped as "cancelled": never executed either way
        stats = gated.wait_for(lambda s: s["expired"] + s["cancelled"] == 1)
        gated.runtime.gate.set()
        assert blocker.result(timeout=30).samples
    stats = gated.wait_for(lambda s: s["inflight"] == 0)
    assert stats["admitted"] == 2 and stats["requests_executed"] == 1 and stats["queue_depth"]["NORMAL"] == 0
    assert len(gated.runtime.ran) == 1
    text = gated.metrics()
    assert sum(metric_value(text, f'slmrank_dropped_total{{reason="{r}"}}') for r in ("expired", "cancelled")) == 1


def test_cancelled_request_frees_its_slot_and_is_never_executed(gated):
    with RankerClient(gated.target) as c:
        blocker = _hold_the_executor(gated, c)
        cancelled = c.stub.Score.future(_score_msg(200, NORMAL), timeout=30)
        gated.wait_for(lambda s: s["queue_depth"]["NORMAL"] == 1)
        with pytest.raises(grpc.RpcError) as err:  # the lane (one request) is full
            c.stub.Score(_score_msg(201, NORMAL), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "queue_full" in err.value.details()

        assert cancelled.cancel()
        stats = gated.wait_for(lambda s: s["cancelled"] == 1)
        assert stats["queue_depth"]["NORMAL"] == 0  # its place is free...
        admitted = c.stub.Score.future(_score_msg(202, NORMAL), timeout=30)  # ...and taken by the next request
        gated.wait_for(lambda s: s["queue_depth"]["NORMAL"] == 1)
        gated.runtime.gate.set()
        assert blocker.result(timeout=30).samples and admitted.result(timeout=30).samples
    with pytest.raises(grpc.FutureCancelledError):
        cancelled.result()
    stats = gated.wait_for(lambda s: s["inflight"] == 0)
    assert stats["admitted"] == 3 and stats["cancelled"] == 1 and stats["refused"]["queue_full"] == 1
    assert stats["requests_executed"] == 2 and stats["batches"] == 2
    ran_ids = {tuple(r.prefix_ids) for r in gated.runtime.ran}
    assert tuple(_score_msg(200, NORMAL).prefix.ids) not in ran_ids and len(gated.runtime.ran) == 2
    text = gated.metrics()
    assert metric_value(text, 'slmrank_dropped_total{reason="cancelled"}') == 1
    assert metric_value(text, 'slmrank_requests_total{kind="Score",code="OK"}') == 2


def _stage_count(text: str, stage: str) -> float:
    """Finished Score requests that went through `stage` (0 before the first one)."""
    try:
        return metric_value(text, f'slmrank_request_stage_seconds_count{{kind="Score",stage="{stage}"}}')
    except ValueError:  # no such series yet
        return 0.0


def test_a_refusal_is_decided_before_decoding(gated):
    """Under overload most requests are refused; the refusal comes from admission's gate on the
    message's shape, before validation and tokenization (the costly part of a request on the event
    loop): a text request refused for a full lane is never tokenized, a request with an invalid id
    refused the same way never reaches the check that would name it."""
    codec_stats = lambda: gated.on_loop(lambda: gated.server.servicer.codec.tokenize_stats.num_segments)  # noqa: E731
    with RankerClient(gated.target) as c:
        blocker = _hold_the_executor(gated, c)
        queued = c.stub.Score.future(_score_msg(300, NORMAL), timeout=30)
        gated.wait_for(lambda s: s["queue_depth"]["NORMAL"] == 1)
        decoded, tokenized = _stage_count(gated.metrics(), "decode"), codec_stats()
        text_msg = pb2.ScoreRequest(samples=[pb2.Segment(text="a sample of text " * 20)] * 3, label_ids=[11],
                                    priority=NORMAL)
        bad_msg = pb2.ScoreRequest(samples=[pb2.Segment(ids=[10**6, 5])], label_ids=[11], priority=NORMAL)
        for msg in (text_msg, bad_msg):
            with pytest.raises(grpc.RpcError) as err:
                c.stub.Score(msg, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "queue_full" in err.value.details()
        assert codec_stats() == tokenized, "a refused request was tokenized"
        assert _stage_count(gated.metrics(), "decode") == decoded, "a refused request was decoded"
        gated.runtime.gate.set()
        assert blocker.result(timeout=30).samples and queued.result(timeout=30).samples
        # with room again, the same text request is decoded, tokenized and served
        assert c.stub.Score(text_msg, timeout=30).samples
        assert codec_stats() > tokenized
        with pytest.raises(grpc.RpcError) as err:  # and the invalid one named
            c.stub.Score(bad_msg, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "samples[0].ids[0]" in err.value.details()
