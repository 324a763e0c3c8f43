"""Front processes (`slmrank serve --fronts N`).

- The shared snapshot survives the trip through shared memory.
- The gate is sound: on random admission states (several clients, priorities, deadlines, measured
  bucket times) every refusal a front makes is one the engine's own admission makes too, and with
  the shape known and one client (the overload benchmark's case) the front makes nearly all of them.
- Over real gRPC (embedded:tiny, two fronts): answers equal those of a server without fronts; bad
  input gets the engine's INVALID_ARGUMENT naming the field; health and ModelInfo are relayed; the
  engine sees the real client (x-client-id, else the caller's host); under a burst with deadlines
  the fronts refuse work themselves, with bounded retry hints, and no admitted request ends late;
  a killed front is restarted; a draining server's fronts answer UNAVAILABLE "draining" with a hint;
  while the engine's loop is stalled, the fronts refuse new requests at once ("backlog").
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import time
from typing import Any

import grpc
import pytest

from service.runtime.requests import BeamRequest, ScoreRequest
from service.sched.admission import (AdmissionConfig, AdmissionController, DeadlineUnmeetable, Overloaded, Priority,
                                       Ticket)
from service.sched.cost import BucketInfo, RequestCost
from service.model.config import ServingLimits
from service.sched.shapes import message_dims, shape_key
from service.sched.verdict import decide
from service.serving.fronts.gate import FrontGate, refusal_reason, snapshot_outlook
from service.serving.fronts.state import NUM_CLIENTS, NUM_POINTS, STATE_DRAINING, STATE_SERVING, LaneView, SharedState, Snapshot
from service.serving.fronts.supervisor import FrontPublisher
from service.serving.proto_gen import load as load_stubs
from tests.service.fakes import FakeClock, FakeFuture

pb2, pb2_grpc = load_stubs().pb2, load_stubs().pb2_grpc
LIMITS = ServingLimits(max_samples=64, max_score_tokens=2048, max_beam_width=400, max_new_tokens=5,
                       max_prompt_tokens=1024)
LIMIT_FIELDS = dict(max_samples=64, max_score_tokens=2048, max_beam_width=400, max_new_tokens=5, max_prompt_tokens=1024)


@pytest.fixture
def shared(tmp_path):
    s = SharedState(str(tmp_path / "state"), create=True)
    yield s
    s.close()


def test_snapshot_round_trip(shared, tmp_path):
    snap = Snapshot(published_s=12.5, state=STATE_SERVING, measured=True, inflight_s=0.03, inflight_batches=2,
                    parallelism=1.7, calibration=1.2, safety_margin=0.1, response_margin_s=0.002, response_s=0.004,
                    min_retry_s=0.005, max_retry_s=2.0, unavailable_retry_s=0.5, max_lane_work_s=30.0,
                    **LIMIT_FIELDS, max_token_bytes=7,
                    lanes=(LaneView(0.5, 3, 128, 1.0, 0.0, 4.0, ((4.5, 0.1), (5.0, 0.5)), {7: 9.5, -3: 4.25}),
                           LaneView(), LaneView(work_s=1.5, length=9)),
                    shapes={hash((0, 3, (1, 2))): (0.01, 0.004, 0.008), -5: (0.2, 0.2, 0.0)})
    shared.write(snap)
    other = SharedState(shared.path)  # another process's view: the same file
    try:
        assert other.read() == snap
        other.slot_add(3, "refused_deadline", 2)
        other.slot_arrival(3, 55.5)
        assert shared.slot(3)["refused_deadline"] == 2 and shared.slot(3)["last_arrival_s"] == 55.5
    finally:
        other.close()
    with pytest.raises(ValueError, match="not an slmrank front state file"):
        (tmp_path / "bad").write_bytes(b"x" * 10)
        SharedState(str(tmp_path / "bad"))


def test_a_writer_descheduled_mid_write_never_fails_a_reader(shared):
    """The engine can be descheduled between marking its snapshot as being written and finishing
    it (seen on the H200 with 8 fronts: a front's handler failed, its caller got UNKNOWN). A reader
    then uses the last snapshot it read; with none, the gate forwards (the engine decides)."""
    import struct
    from service.serving.fronts.state import SnapshotBusy
    shared.write(Snapshot(state=STATE_SERVING, max_retry_s=1.5, **LIMIT_FIELDS))
    reader = SharedState(shared.path)
    fresh = SharedState(shared.path)  # has read nothing yet
    try:
        first = reader.read()
        shared.write(Snapshot(state=STATE_DRAINING, **LIMIT_FIELDS))
        seq = struct.unpack_from("<Q", shared.mm, 0)[0]
        struct.pack_into("<Q", shared.mm, 0, seq + 1)  # odd: a write begun, never finished
        t = time.monotonic()
        assert reader.read(patience_s=0.01) is first  # one publish old
        assert 0.01 <= time.monotonic() - t < 0.5
        with pytest.raises(SnapshotBusy):
            fresh.read(patience_s=0.002)
        gate = FrontGate(lambda: fresh.read(patience_s=0.002))
        assert gate.check("score", SCORE_MSG, None, "c") is None  # forwarded
        assert 0.005 <= gate.backlog_hint_s() <= 2.0
        struct.pack_into("<Q", shared.mm, 0, seq + 2)  # the write finished
        assert reader.read().state == STATE_DRAINING and fresh.read().state == STATE_DRAINING
    finally:
        reader.close()
        fresh.close()


# ---- the gate against the engine's admission --------------------------------------------------------

S = [BucketInfo(f"score.r{n}", "score", n * 1e9) for n in (1, 2, 4, 8)]
BEAM = BucketInfo("beam.n3.r1", "beam", 1e11)
SCORE_COST = RequestCost("score", S[0], tuple(zip((1, 2, 4, 8), S)))
BEAM_COST = RequestCost("beam.n3", BEAM, ((1, BEAM),))
SCORE_MSG = pb2.ScoreRequest(prefix=pb2.Segment(ids=[1] * 6), samples=[pb2.Segment(ids=[2] * 3)] * 2, label_ids=[0])
BEAM_MSG = pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[1] * 8), beam_width=4, new_tokens=3)


def _engine_request(kind: str) -> Any:
    """The placeholder request the engine's gate prices for the message (Codec.shape_of)."""
    msg = SCORE_MSG if kind == "score" else BEAM_MSG
    dims = message_dims(kind, msg, LIMITS, 4)
    if kind == "beam":
        return BeamRequest(prompt_ids=(0,) * dims[1], beam_width=dims[2], new_tokens=dims[3])
    return ScoreRequest(samples=tuple((0,) * n for n in dims[2]), prefix_ids=(0,) * dims[1])


def _world(seed: int, shared: SharedState, clients: list[str], margin: float = 0.0):
    rng = random.Random(seed)
    clock = FakeClock()
    cfg = AdmissionConfig(max_queue_online=rng.choice([4, 16, 128]), max_lane_work_s=rng.choice([0.5, 30.0]),
                          front_deadline_margin=margin)
    ctl = AdmissionController(cfg, cfg.service_model(num_lanes=rng.choice([1, 2])), clock=clock)
    model = ctl.model
    for i in range(rng.randrange(3, 12)):  # measured bucket times
        info = rng.choice(S + [BEAM])
        model.batch_started(i, info, clock.t)
        clock.t += (0.05 if info is BEAM else 0.004 * info.flops / 1e9) * rng.uniform(0.8, 1.2)
        model.batch_finished(i, info, (clock.t - 0.004, clock.t), {rng.choice([1, 2, 3]): 1})
    if rng.random() < 0.5:  # a batch in flight
        model.batch_started(99, S[2], clock.t)
        clock.t += rng.uniform(0, 0.01)
    publisher = FrontPublisher(shared, clock)
    publisher.attach(ctl, LIMITS, 4)
    publisher.set_state(STATE_SERVING)
    for _ in range(rng.randrange(0, 60)):  # queued work
        kind = rng.choice(["score", "score", "beam"])
        t = Ticket("q", kind, Priority(rng.choice([1, 2, 3])), clock.t + rng.uniform(0.01, 2.0),
                   future=FakeFuture(), client=rng.choice(clients), cost=SCORE_COST if kind == "score" else BEAM_COST)
        try:
            ctl.admit(t)
        except (Overloaded, DeadlineUnmeetable):
            pass
        if rng.random() < 0.1 and ctl.depth():
            ctl.take([ctl.head()])
    return rng, clock, ctl, publisher


def _engine_says(ctl, publisher, kind: str, priority: int, deadline: float | None, client: str):
    t = Ticket("p", "score" if kind == "score" else "beam.n3", Priority(priority), deadline, client=client,
               cost=SCORE_COST if kind == "score" else BEAM_COST)
    try:
        ctl.admit(t, dry_run=True)
        refusal = None
    except (Overloaded, DeadlineUnmeetable) as e:
        refusal = e
    publisher.note_shape(_engine_request(kind), t.own_s, t.work_s, t.idle_s)  # as Scheduler.precheck reports it
    publisher.publish()
    return refusal


@pytest.mark.parametrize("margin", [0.0, 0.03])
@pytest.mark.parametrize("seed", range(40))
def test_a_front_refuses_only_what_the_engine_refuses(seed, margin, shared):
    """... and with a deadline margin m, only what the engine refuses at a deadline m of the time
    left sooner (the snapshot is published before each check: nothing is in transit)."""
    clients = ["alice", "bob", "ipv4:10.0.0.7", "carol"]
    rng, clock, ctl, publisher = _world(seed, shared, clients, margin)
    gate = FrontGate(shared.read, num_fronts=2, clock=clock)
    checked = refused = by_margin = 0
    for _ in range(60):
        kind = rng.choice(["score", "beam"])
        priority = rng.choice([1, 2, 3])
        deadline = None if rng.random() < 0.2 else clock.t + rng.choice([-0.001, 0.002, 0.02, 0.1, 0.5, 2.0])
        client = rng.choice(clients + ["dave"])
        sooner = None if deadline is None else deadline - margin * max(deadline - clock.t, 0.0)
        engine_sooner = _engine_says(ctl, publisher, kind, priority, sooner, client) if margin else None
        engine = _engine_says(ctl, publisher, kind, priority, deadline, client)  # also teaches the shape
        msg = pb2.ScoreRequest() if kind == "score" else pb2.BeamSearchRequest()
        msg.CopyFrom(SCORE_MSG if kind == "score" else BEAM_MSG)
        msg.priority = priority
        front = gate.check(kind, msg, deadline, client)
        checked += 1
        if front is None:
            continue
        refused += 1
        if engine is None and refusal_reason(front) == "deadline" and engine_sooner is not None:
            by_margin += 1  # the margin's own: the engine refuses it at the sooner deadline
            assert "margin of 3%" in str(front), front
            clock.t += rng.uniform(0, 0.003)
            continue
        assert engine is not None, f"the front refused ({front}) what the engine admits"
        if refusal_reason(front) == "impossible":
            assert isinstance(engine, DeadlineUnmeetable), (front, engine)
        else:
            assert isinstance(engine, Overloaded) and not isinstance(engine, DeadlineUnmeetable), (front, engine)
            assert 0 < front.retry_after_s <= ctl.config.max_retry_after_s
            # the checks run in the engine's order; the engine's lane-work check counts the request's
            # own share, the front's only what is queued: a front's "deadline" may be the engine's
            # "queue_full" (or its per-client cap, which fronts do not check)
            if refusal_reason(front) == "queue_full":
                assert engine.reason == "queue_full", (front, engine)
        clock.t += rng.uniform(0, 0.003)
    assert checked == 60


def test_a_front_counts_its_own_forwards_the_snapshot_cannot_show(shared):
    """Requests a front let through after the snapshot it reads was published (less the engine's
    ingress delay) are not in that snapshot's lanes yet: the front counts their shares as work
    ahead (its lane) or above (a higher lane), as the engine will once it has them; once a
    snapshot shows them, they are not counted twice."""
    _, clock, ctl, publisher = _world(3, shared, ["bench"])
    gate = FrontGate(shared.read, clock=clock)
    _engine_says(ctl, publisher, "score", 2, None, "bench")  # the shape priced, the snapshot published
    clock.t += 0.001
    snap = shared.read()
    for priority in (2, 2, 1):  # let through after the snapshot was published
        assert gate.check("score", _with_priority(SCORE_MSG, priority), None, "bench") is None
        clock.t += 0.0005
    tickets = [Ticket("q", "score", Priority(p), None, future=FakeFuture(), client="bench", cost=SCORE_COST)
               for p in (2, 2, 1)]
    for t in tickets:
        ctl.admit(t)  # the engine has them now; `snap` does not show them
    dims = message_dims("score", SCORE_MSG, LIMITS, 4)
    share_s = snap.shapes[shape_key(dims)][1]  # the front's price of each: the shape's published share
    assert share_s > 0
    assert gate.in_transit_s(snap, Priority.NORMAL, clock.t) == pytest.approx((2 * share_s, share_s))
    assert gate.in_transit_s(snap, Priority.ONLINE, clock.t) == pytest.approx((share_s, 0.0))
    probe = Ticket("p", "score", Priority.NORMAL, None, client="bench", cost=SCORE_COST)
    _, _, engine = ctl.price(probe, clock.t)
    bare = snapshot_outlook(snap, Priority.NORMAL, dims, None, "bench", clock.t)
    front = snapshot_outlook(snap, Priority.NORMAL, dims, None, "bench", clock.t,
                             gate.in_transit_s(snap, Priority.NORMAL, clock.t))
    assert front.ahead_s == pytest.approx(bare.ahead_s + 2 * share_s)
    assert front.higher_work_s == pytest.approx(bare.higher_work_s + share_s)
    # the engine, which has them, sees that much more (each priced with the queue it joined)
    for name in ("ahead_s", "higher_work_s"):
        assert abs(getattr(front, name) - getattr(engine, name)) < abs(getattr(bare, name) - getattr(engine, name))
    clock.t += 0.001
    publisher.publish()  # a snapshot that holds them
    assert gate.in_transit_s(shared.read(), Priority.NORMAL, clock.t) == (0.0, 0.0)


def test_the_margin_leaves_the_engine_what_its_front_lets_through(shared):
    """A request predicted to finish just before its deadline (within the margin) is the one a
    late view gets wrong: the front refuses it, naming the margin, though the engine (no margin)
    would admit it; with no margin configured, the front lets it through."""
    for margin in (0.03, 0.0):
        _, clock, ctl, publisher = _world(5, shared, ["bench"], margin)
        gate = FrontGate(shared.read, clock=clock)
        _engine_says(ctl, publisher, "score", 2, None, "bench")
        probe = Ticket("p", "score", Priority.NORMAL, None, client="bench", cost=SCORE_COST)
        _, _, outlook = ctl.price(probe, clock.t)
        finish_in = decide(outlook).finish - clock.t
        deadline = clock.t + finish_in / (1 - 0.03 / 2)  # finishes within the 3% margin, before the deadline
        assert _engine_says(ctl, publisher, "score", 2, deadline, "bench") is None
        front = gate.check("score", SCORE_MSG, deadline, "bench")
        if margin:
            assert refusal_reason(front) == "deadline" and "margin of 3%" in str(front) and front.retry_after_s > 0
        else:
            assert front is None


def _with_priority(msg: Any, priority: int) -> Any:
    out = type(msg)()
    out.CopyFrom(msg)
    out.priority = priority
    return out


# what a front can know of a request's outlook, exactly, when the snapshot holds the whole state
KNOWN = ("now", "deadline", "priority", "own_s", "work_s", "is_measured", "lane_length", "lane_max_queue",
         "lane_work_s", "max_lane_work_s", "higher_work_s", "inflight_s", "parallelism", "stretch", "calibration",
         "safety_margin", "response_margin_s", "response_s", "ingress_s", "idle_s", "is_idle")


@pytest.mark.parametrize("seed", range(40))
def test_the_front_and_the_engine_reach_the_same_verdict_from_the_same_state(seed, shared):
    """Both call verdict.decide: the engine over its exact view (AdmissionController.price), a front
    over the snapshot it reads back from shared memory. Where the snapshot holds the state whole (a
    lane of at most NUM_POINTS tickets, at most NUM_CLIENTS clients, the request's shape just
    priced, no time passed since the publish) the two views are equal in every field a front can
    know, and then the verdicts are the same: reason, predicted completion and retry wait. The one
    view a front cannot see is the engine placing a request behind queued work whose slack it must
    not eat (more work ahead): there a front's refusal is still the engine's."""
    clients = ["alice", "bob", "carol"]
    rng, clock, ctl, publisher = _world(seed, shared, clients)
    same = 0
    for _ in range(40):
        kind = rng.choice(["score", "beam"])
        priority = rng.choice([1, 2, 3])
        deadline = None if rng.random() < 0.2 else clock.t + rng.choice([-0.001, 0.002, 0.02, 0.1, 0.5, 2.0])
        client = rng.choice(clients)
        t = Ticket("p", "score" if kind == "score" else "beam.n3", Priority(priority), deadline, client=client,
                   cost=SCORE_COST if kind == "score" else BEAM_COST)
        _, _, engine = ctl.price(t, clock.t)
        publisher.note_shape(_engine_request(kind), t.own_s, t.work_s, t.idle_s)
        publisher.publish()
        msg = SCORE_MSG if kind == "score" else BEAM_MSG
        front = snapshot_outlook(shared.read(), Priority(priority), message_dims(kind, msg, LIMITS, 4), deadline,
                                 client, clock.t)
        if engine.lane_length > NUM_POINTS or len(clients) > NUM_CLIENTS:
            continue
        for name in KNOWN:
            a, b = getattr(front, name), getattr(engine, name)
            assert a == b if b is None or isinstance(b, (bool, Priority)) else a == pytest.approx(b, rel=1e-9, abs=1e-12), name
        assert front.client_work_s is None and front.ahead_s <= engine.ahead_s + 1e-9
        v_engine, v_front = decide(engine), decide(front)
        if front.ahead_s == pytest.approx(engine.ahead_s, rel=1e-9, abs=1e-12):
            same += 1
            assert v_front.reason == v_engine.reason, (v_front, v_engine)
            assert v_front.finish == pytest.approx(v_engine.finish, rel=1e-9)
            assert v_front.wait_s == pytest.approx(v_engine.wait_s, rel=1e-9, abs=1e-12)
        elif v_front.reason is not None:
            assert v_engine.reason is not None, (v_front, v_engine)
        clock.t += rng.uniform(0, 0.003)
    assert same >= 20


def test_one_client_overloaded_the_front_refuses_as_the_engine(shared):
    """The overload benchmark's case: one client, one shape, a queue past the deadline."""
    agree = total = 0
    for seed in range(20):
        _, clock, ctl, publisher = _world(seed, shared, ["bench"])
        gate = FrontGate(shared.read, clock=clock)
        for deadline_s in (0.005, 0.02, 0.05, 0.08, 0.2, 1.0):
            engine = _engine_says(ctl, publisher, "score", 2, clock.t + deadline_s, "bench")
            front = gate.check("score", SCORE_MSG, clock.t + deadline_s, "bench")
            if engine is not None:
                total += 1
                agree += front is not None
    assert total >= 20 and agree >= 0.9 * total, f"the front refused {agree} of the engine's {total} refusals"


def test_draining_and_loading_are_refused_with_a_hint(shared):
    clock = FakeClock()
    publisher = FrontPublisher(shared, clock)  # no model yet: loading
    gate = FrontGate(shared.read, clock=clock)
    r = gate.check("score", SCORE_MSG, None, "c")
    assert refusal_reason(r) == "loading" and r.retry_after_s == 0.5
    ctl = AdmissionController(AdmissionConfig(unavailable_retry_s=0.25), clock=clock)
    publisher.attach(ctl, LIMITS, 4)
    publisher.set_state(STATE_SERVING)
    assert gate.check("score", SCORE_MSG, None, "c") is None
    publisher.set_state(STATE_DRAINING)
    r = gate.check("beam", BEAM_MSG, clock.t + 1, "c")
    assert refusal_reason(r) == "draining" and r.retry_after_s == 0.25 and "draining" in str(r)


def test_a_backlogged_engine_is_shed_at_the_fronts(shared):
    """Forwarded requests waiting in the engine's gRPC queue are invisible to its admission (its
    lanes look short while its loop drowns): past front_max_backlog_s of ingress delay the fronts
    refuse ("backlog"), and the delay counts in every deadline prediction; it fades as it ages."""
    clock = FakeClock()
    publisher = FrontPublisher(shared, clock)
    ctl = AdmissionController(AdmissionConfig(front_max_backlog_s=0.005), clock=clock)
    publisher.attach(ctl, LIMITS, 4)
    publisher.set_state(STATE_SERVING)
    gate = FrontGate(shared.read, clock=clock)
    publisher.note_ingress(clock.t - 0.004)  # 4 ms: under the bound
    publisher.publish()
    assert gate.check("score", SCORE_MSG, None, "c") is None
    # ... but a deadline 3 ms away cannot be met through it
    r = gate.check("score", SCORE_MSG, clock.t + 0.003, "c")
    assert r is not None and refusal_reason(r) == "deadline"
    publisher.note_ingress(clock.t - 0.030)  # 30 ms behind
    publisher.publish()
    r = gate.check("beam", BEAM_MSG, None, "c")
    assert refusal_reason(r) == "backlog" and 0.025 <= r.retry_after_s <= 2.0 and "30.0 ms behind" in str(r)
    assert publisher.ingress_delay_s() == pytest.approx(0.030)  # as the metrics show it
    clock.t += 0.028  # nothing measured since: the backlog is worked off as time passes
    assert gate.check("beam", BEAM_MSG, None, "c") is None
    assert publisher.ingress_delay_s() == pytest.approx(0.002)
    clock.t += 1.0
    assert publisher.ingress_delay_s() == 0.0


# ---- over gRPC --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(model):
    from service.sched.batcher import BatcherConfig
    from service.serving.server import RankerServer, ServerConfig
    from service.serving.server_thread import ServerThread

    def start(fronts: int) -> ServerThread:
        config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, fronts=fronts, metrics_port=0,
                              trace_sample_rate=0.0, admission=AdmissionConfig(max_retry_after_s=1.0),
                              batcher=BatcherConfig(max_batch_requests=4, validate_requests=False))
        srv = ServerThread(RankerServer(config, lambda: model))
        srv.wait_serving()
        return srv

    fronted, plain = start(2), start(0)
    yield fronted, plain
    plain.stop()
    if fronted.thread.is_alive():
        fronted.stop()


def _score(seed: int, **kw) -> Any:
    rng = random.Random(seed)
    return pb2.ScoreRequest(prefix=pb2.Segment(ids=[rng.randrange(1, 1000) for _ in range(6)]),
                            samples=[pb2.Segment(ids=[rng.randrange(1, 1000) for _ in range(3)]) for _ in range(2)],
                            label_ids=[11, 22], **kw)


def test_answers_through_fronts_equal_the_engine_alone(servers):
    fronted, plain = servers
    with grpc.insecure_channel(fronted.target) as a, grpc.insecure_channel(plain.target) as b:
        sa, sb = pb2_grpc.RankerStub(a), pb2_grpc.RankerStub(b)
        for seed in range(4):
            assert sa.Score(_score(seed), timeout=30).SerializeToString() == \
                sb.Score(_score(seed), timeout=30).SerializeToString()
        beam = pb2.BeamSearchRequest(prompt=pb2.Segment(text="The best running shoes"), beam_width=4, new_tokens=3)
        assert sa.BeamSearch(beam, timeout=30) == sb.BeamSearch(beam, timeout=30)
        assert sa.ModelInfo(pb2.ModelInfoRequest(), timeout=10) == sb.ModelInfo(pb2.ModelInfoRequest(), timeout=10)
        tokenize = pb2.TokenizeRequest(text=" yes")  # relayed as every RPC that is not Score or BeamSearch
        assert sa.Tokenize(tokenize, timeout=10) == sb.Tokenize(tokenize, timeout=10) and sa.Tokenize(tokenize).ids
        for channel in (a, b):  # the Admin service is relayed too (these servers have no --catalog-dir)
            with pytest.raises(grpc.RpcError) as e:
                pb2_grpc.AdminStub(channel).ReplaceCatalog(pb2.ReplaceCatalogRequest(name="x", file="y"), timeout=10)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--catalog-dir" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            sa.BeamSearch(pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[1]), beam_width=4000, new_tokens=3), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "beam_width" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # bytes that are no ScoreRequest: the engine's parse names it
            a.unary_unary("/slmrank.v1.Ranker/Score")(b"\xff\xff\xff", timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fronted.health() == "SERVING" and fronted.health("slmrank.v1.Ranker") == "SERVING"


def test_the_engine_sees_the_real_client(servers):
    fronted, _ = servers
    seen: list[str] = []
    scheduler = fronted.server.servicer.scheduler
    submit = scheduler.submit

    async def recording(request, priority, deadline, client):
        seen.append(client)
        return await submit(request, priority, deadline, client)

    fronted.on_loop(lambda: setattr(scheduler, "submit", recording))
    try:
        with grpc.insecure_channel(fronted.target) as ch:
            stub = pb2_grpc.RankerStub(ch)
            stub.Score(_score(1), timeout=30)
            stub.Score(_score(2), timeout=30, metadata=[("x-client-id", "alice")])
            # a caller's own stamp is not relayed: it would make the engine think it is 1,000 s behind
            stub.Score(_score(3), timeout=30, metadata=[("x-slmrank-front-sent", f"{time.monotonic() - 1000:.6f}")])
    finally:
        fronted.on_loop(lambda: setattr(scheduler, "submit", submit))
    assert seen == ["ipv4:127.0.0.1", "alice", "ipv4:127.0.0.1"]
    publisher = fronted.server.fronts.publisher  # and the engine measured how long they took to reach it
    ingress_s, ingress_at = fronted.on_loop(lambda: (publisher.ingress_s, publisher.ingress_at))
    assert 0 < ingress_s < 1.0 and 0 < time.monotonic() - ingress_at < 30


def test_the_engine_schedules_by_the_caller_s_own_deadline(servers, monkeypatch):
    """A front's forwarded call runs 50 ms past its caller's deadline (so that the caller's deadline
    ends the front's handler first); the engine must still schedule by the caller's deadline, or it
    admits and runs requests that its caller has given up on (issue 32's "admitted, then cancelled
    late" on the H200). A caller's own stamp is not relayed, and straight to the engine it can only
    shorten the caller's deadline."""
    import service.serving.server as server_mod

    fronted, plain = servers
    seen: list[tuple[float | None, float | None, float | None]] = []  # (the stamp, gRPC's deadline, the engine's)
    deadline_of = server_mod._deadline

    def recording(context):
        remaining = context.time_remaining()
        stamp = next((v for k, v in context.invocation_metadata() or () if k == "x-slmrank-front-deadline"), None)
        grpc_deadline = None if remaining is None else time.monotonic() + remaining
        seen.append((stamp, grpc_deadline, deadline_of(context)))
        return seen[-1][2]

    monkeypatch.setattr(server_mod, "_deadline", recording)
    for srv in (fronted, plain):
        sent: list[float] = []
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb2_grpc.RankerStub(ch)
            stub.Score(_score(7), timeout=30)  # warm: the channel is up before the timed calls
            seen.clear()
            for seed, ahead_s in ((7, None), (8, 1e6), (9, math.nan), (10, 2.0)):
                sent.append(time.monotonic())
                stamp = None if ahead_s is None else f"{sent[-1] + ahead_s:.6f}"
                stub.Score(_score(seed), timeout=5.0, metadata=[("x-slmrank-front-deadline", stamp)] if stamp else None)
            stub.Score(_score(11))  # no deadline at all
        assert len(seen) == 5 and seen[4] == (None, None, None)
        for i, (stamp, grpc_deadline, deadline) in enumerate(seen[:4]):
            assert sent[i] + (1.9 if srv is plain and i == 3 else 4) < deadline < sent[i] + 5.5, (srv is fronted, i)
            if srv is fronted:  # the front's stamp of the caller's deadline (a caller's own is dropped), not
                # the forwarded call's, which runs 50 ms past it
                assert deadline == float(stamp) and deadline < grpc_deadline - 0.04, (i, stamp, grpc_deadline)
            elif i == 3:  # straight to the engine: a caller's stamp sooner than gRPC's deadline is taken
                assert deadline == float(stamp) == pytest.approx(sent[i] + 2.0, abs=1e-5)
            else:  # ... one later, or no number, is not
                assert deadline == pytest.approx(grpc_deadline, abs=1e-3), (i, stamp)


async def _burst(target: str, n: int, deadline_s: float) -> list[tuple[grpc.StatusCode, int | None, float]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb2_grpc.RankerStub(channel)

        async def one(i: int):
            t0 = time.monotonic()
            msg = pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[1 + i % 50] * 24), beam_width=16, new_tokens=4)
            try:
                await stub.BeamSearch(msg, timeout=deadline_s)
                return grpc.StatusCode.OK, None, time.monotonic() - t0
            except grpc.aio.AioRpcError as e:
                retry = next((int(v) for k, v in (e.trailing_metadata() or ()) if k == "retry-after-ms"), None)
                return e.code(), retry, time.monotonic() - t0
        out = []
        for wave in range(4):
            out += await asyncio.gather(*(one(wave * n + i) for i in range(n)))
        return out


def test_the_fronts_refuse_the_excess_themselves(servers):
    fronted, _ = servers
    with grpc.insecure_channel(fronted.target) as ch:  # the bucket's time, measured (and known to admission)
        stub = pb2_grpc.RankerStub(ch)
        for i in range(3):
            t0 = time.monotonic()
            stub.BeamSearch(pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[1 + i] * 24), beam_width=16, new_tokens=4),
                            timeout=30)
            solo_s = time.monotonic() - t0
    before = fronted.on_loop(lambda: fronted.server.stats())
    # a deadline that a few batches fit in, 48 requests at once: most must be refused
    outcomes = asyncio.run(_burst(fronted.target, 48, 6 * solo_s + 0.05))
    after = fronted.on_loop(lambda: fronted.server.stats())
    codes = {c: sum(o[0] == c for o in outcomes) for c in {o[0] for o in outcomes}}
    refused_at_fronts = sum(after["fronts"][k] - before["fronts"][k] for k in after["fronts"] if k.startswith("refused"))
    summary = f"{codes}; fronts {after['fronts']}; engine {after['scheduler']['refused']}"
    assert codes.get(grpc.StatusCode.OK, 0) > 0, summary
    assert refused_at_fronts > 0, summary
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}, summary
    hints = [r for c, r, _ in outcomes if c == grpc.StatusCode.UNAVAILABLE]
    assert hints and all(r is not None and 1 <= r <= 1000 for r in hints), summary
    assert after["scheduler"]["answered_late"] == before["scheduler"]["answered_late"], summary


def test_a_stalled_engine_loop_is_shed_at_the_fronts_at_once(servers):
    """The engine's loop stalls (here: blocked on purpose) while requests keep coming: those
    forwarded meanwhile wait in its gRPC queue, and once it runs again it measures their ingress
    delay; while that delay lasts, the fronts refuse new requests themselves ("backlog", with a
    hint), in milliseconds, without waiting on the engine."""
    fronted, _ = servers
    stall_s = 0.4

    async def scenario() -> list[tuple[str, float]]:
        async with grpc.aio.insecure_channel(fronted.target) as ch:
            stub = pb2_grpc.RankerStub(ch)
            await stub.Score(_score(0), timeout=30)
            fronted.loop.call_soon_threadsafe(time.sleep, stall_s)  # the engine's loop blocked
            await asyncio.sleep(0.05)
            queued = [asyncio.ensure_future(stub.Score(_score(i), timeout=30)) for i in range(1, 4)]
            await asyncio.gather(*queued)  # answered once the loop runs again: ~0.35 s of ingress delay
            fronted.loop.call_soon_threadsafe(time.sleep, stall_s)  # and blocked again at once
            out = []
            for i in range(4):
                t0 = time.monotonic()
                try:
                    await stub.Score(_score(10 + i), timeout=30)
                    out.append(("OK", time.monotonic() - t0))
                except grpc.aio.AioRpcError as e:
                    out.append((e.details(), time.monotonic() - t0))
            return out

    before = fronted.on_loop(lambda: fronted.server.fronts.counts())["refused_backlog"]
    out = asyncio.run(scenario())
    refused = [(d, took) for d, took in out if "behind with the requests forwarded" in d]
    assert refused, out
    assert all(took < 0.1 for _, took in refused), out
    assert fronted.on_loop(lambda: fronted.server.fronts.counts())["refused_backlog"] >= before + len(refused)


def test_a_killed_front_is_restarted(servers):
    fronted, _ = servers
    sup = fronted.server.fronts
    victim = sup.pids()[0]
    os.kill(victim, signal.SIGKILL)
    end = time.monotonic() + 20
    while not (sup.restarts >= 1 and len(sup.pids()) == 2 and victim not in sup.pids()
               and all(sup.shared.slot(i)["ready"] for i in range(2))):
        assert time.monotonic() < end, f"not restarted: pids {sup.pids()}, restarts {sup.restarts}"
        time.sleep(0.05)
    with grpc.insecure_channel(fronted.target) as ch:  # every connection lands on a live front
        for seed in range(6):
            pb2_grpc.RankerStub(ch).Score(_score(seed), timeout=30)


def test_a_draining_server_s_fronts_say_so(servers):
    fronted, _ = servers  # last: it stops the server
    shutdown = asyncio.run_coroutine_threadsafe(fronted.server.shutdown(grace_s=3), fronted.loop)
    time.sleep(0.2)
    with grpc.insecure_channel(fronted.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb2_grpc.RankerStub(ch).Score(_score(9), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    hint = dict(e.value.trailing_metadata() or ())["retry-after-ms"]
    assert 1 <= int(hint) <= 1000
    shutdown.result(15)
    pids = fronted.server.fronts.pids()
    assert pids == [], f"fronts still running after the stop: {pids}"


def test_a_taken_port_is_an_error_with_fronts_too(servers):
    """SO_REUSEPORT must not let a second server join the listeners of a port already served."""
    from service.runtime.requests import BindError
    from service.serving.fronts.supervisor import reserve_port

    _, plain = servers
    with pytest.raises(BindError, match="in use"):
        reserve_port("127.0.0.1", plain.port)
    sock, port = reserve_port("127.0.0.1", 0)  # port 0: a free one
    sock.close()
    assert port > 0


def test_a_forwarded_request_s_span_carries_its_hop_from_the_front(model):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.serving.server import RankerServer, ServerConfig
    from service.serving.server_thread import ServerThread

    exporter = InMemorySpanExporter()
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, fronts=1, trace_sample_rate=1.0, otlp_endpoint="")
    srv = ServerThread(RankerServer(config, lambda: model, span_exporter=exporter), wait_ready=True)
    try:
        with grpc.insecure_channel(srv.target) as ch:
            pb2_grpc.RankerStub(ch).Score(_score(5), timeout=30)
        end = time.monotonic() + 10
        while not (roots := [s for s in exporter.get_finished_spans() if s.name == "Score"]):
            assert time.monotonic() < end, "no Score span exported"
            time.sleep(0.01)
        hop_ms = roots[0].attributes["slmrank.front_ingress_ms"]
        assert 0 < hop_ms < 1000
    finally:
        srv.stop()


def test_an_answer_after_the_caller_s_deadline_ends_the_front_s_handler_quietly(shared):
    """The engine's answer reaching a front as its caller's deadline passes is not sent into the
    ended RPC (gRPC's core would log an ExecuteBatchError traceback): the handler ends as
    cancelled. An answer in time is returned as it is."""
    import argparse
    from service.serving.fronts.front import Front

    shared.write(Snapshot(state=STATE_SERVING, **LIMIT_FIELDS))
    args = argparse.Namespace(state=shared.path, slot=0, fronts=1, client_id_metadata="x-client-id",
                              max_inflight=8)
    front = Front(args)

    class Context:
        def __init__(self, remaining_s):
            self.remaining_s = remaining_s

        def time_remaining(self):
            return self.remaining_s

        def invocation_metadata(self):
            return ()

        def peer(self):
            return "ipv4:127.0.0.1:5000"

    def engine(delay_s):
        async def call(raw, timeout, metadata):
            await asyncio.sleep(delay_s)
            return b"answer:" + raw
        return call

    raw = SCORE_MSG.SerializeToString()

    async def go(delay_s, remaining_s):
        front._unary = {"Score": engine(delay_s)}
        return await front._ranker(raw, Context(remaining_s), "Score", "score")

    try:
        assert asyncio.run(go(0.0, 1.0)) == b"answer:" + raw
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(go(0.05, 0.02))
        assert front.inflight == 0
    finally:
        front.shared.close()
