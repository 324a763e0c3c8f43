"""Admission policy on a fake clock: lane order and the lower lanes' share, fair shares between
clients, bounded lanes and clients, refusal of work that would finish late (from the work queued
ahead and the measured bucket times), bounded retry hints, unmeetable deadlines, draining, and
dropped tickets never taken. The issue-11 defects each have a test here: a kind never seen, one
outlier batch, a clamped utilisation, estimates that stop learning while requests are refused."""

from __future__ import annotations

import pytest

from service.sched.admission import (AdmissionConfig, AdmissionController, DeadlineUnmeetable, Overloaded, Priority,
                                       Ticket)
from service.sched.cost import BucketInfo, RequestCost
from service.sched.service_time import ServiceTimeModel
from tests.service.fakes import FakeClock, FakeFuture

O, N, B = Priority.ONLINE, Priority.NORMAL, Priority.BACKGROUND

# Two families of buckets, by logical FLOPs: small Score buckets, one large BeamSearch bucket.
S1 = BucketInfo("score.r1", "score", 1e9)
S2 = BucketInfo("score.r2", "score", 2e9)
S4 = BucketInfo("score.r4", "score", 4e9)
S8 = BucketInfo("score.r8", "score", 8e9)
BEAM = BucketInfo("beam.n5.r1", "beam", 1e12)
SCORE_COST = RequestCost("score", S1, ((1, S1), (2, S2), (4, S4), (8, S8)))
BEAM_COST = RequestCost("beam.n5", BEAM, ((1, BEAM),))


def make(clock: FakeClock | None = None, **cfg) -> tuple[AdmissionController, FakeClock, list]:
    clock = clock or FakeClock()
    dropped: list = []
    ctl = AdmissionController(AdmissionConfig(**cfg), clock=clock, on_drop=lambda t, why: dropped.append((t.payload, why)))
    return ctl, clock, dropped


def admit(ctl: AdmissionController, name: str, priority: Priority = N, deadline: float | None = None,
          cost: RequestCost | None = SCORE_COST, client: str = "") -> Ticket:
    t = Ticket(name, cost.kind if cost else "score", priority, deadline, future=FakeFuture(), client=client, cost=cost)
    ctl.admit(t)
    return t


def drain_order(ctl: AdmissionController) -> list[str]:
    out = []
    while (t := ctl.take_next()) is not None:
        out.append(t.payload)
        ctl.finished([t])
    return out


def measure(model: ServiceTimeModel, clock: FakeClock, info: BucketInfo, run_s: float, n: int, gap_s: float = 0.0,
            levels: dict | None = None) -> None:
    """n batches of `info`, run_s each, back to back with gap_s idle between them, on the fake clock."""
    for _ in range(n):
        start = clock.t
        model.batch_started(id(clock) + model.num_batches, info, start)
        clock.t += run_s
        model.batch_finished(id(clock) + model.num_batches, info, (start, clock.t), levels or {2: 1})
        clock.t += gap_s


# ---- order ------------------------------------------------------------------------------------------

def test_strict_priority_then_fifo_within_a_lane():
    ctl, _, _ = make()
    for name, p in [("b1", B), ("n1", N), ("o1", O), ("b2", B), ("n2", N), ("o2", O)]:
        admit(ctl, name, p)
    assert drain_order(ctl) == ["o1", "o2", "n1", "n2", "b1", "b2"]
    assert ctl.stats()["taken"] == 6 and ctl.depth() == 0


def test_lower_lanes_keep_a_share_under_a_flood_of_online():
    ctl, _, _ = make(online_burst=2, normal_burst=2)
    for i in range(12):
        admit(ctl, f"o{i}", O)
    for i in range(3):
        admit(ctl, f"n{i}", N)
    admit(ctl, "b0", B)
    order = drain_order(ctl)
    # two ONLINE picks, then NORMAL gets one; after two NORMAL turns, BACKGROUND gets the next
    assert order[:9] == ["o0", "o1", "n0", "o2", "o3", "n1", "o4", "o5", "b0"]
    assert order[9:] == ["o6", "o7", "n2", "o8", "o9", "o10", "o11"]


def test_no_share_is_spent_while_the_lower_lanes_are_empty():
    ctl, _, _ = make(online_burst=2)
    for i in range(8):
        admit(ctl, f"o{i}", O)
    assert [ctl.take_next().payload for _ in range(4)] == ["o0", "o1", "o2", "o3"]
    admit(ctl, "n0", N)  # the burst counts only picks made while a lower lane waited
    assert [ctl.take_next().payload for _ in range(3)] == ["o4", "o5", "n0"]


def test_head_does_not_take_and_waiting_lists_in_priority_order():
    ctl, _, _ = make()
    admit(ctl, "n1", N)
    admit(ctl, "o1", O)
    admit(ctl, "b1", B)
    assert ctl.head().payload == "o1" and ctl.head().payload == "o1"
    assert [t.payload for t in ctl.waiting()] == ["o1", "n1", "b1"]
    batch = [ctl.head(), next(t for t in ctl.waiting() if t.payload == "b1")]
    ctl.take(batch)
    assert [t.state for t in batch] == ["taken", "taken"]
    assert [t.payload for t in ctl.waiting()] == ["n1"]


# ---- fair shares between clients --------------------------------------------------------------------

def test_a_light_client_goes_ahead_of_a_heavy_clients_backlog():
    ctl, clock, _ = make()
    measure(ctl.model, clock, BEAM, 2.0, 3)
    measure(ctl.model, clock, S1, 0.01, 3)
    for i in range(4):
        admit(ctl, f"heavy{i}", cost=BEAM_COST, client="h")
    admit(ctl, "light0", client="l")
    admit(ctl, "light1", client="l")
    # virtual start times: heavy 0, 2, 4, 6; light 0, 0.01: the light ones go after heavy0 only
    assert [t.payload for t in ctl.waiting()] == ["heavy0", "light0", "light1", "heavy1", "heavy2", "heavy3"]
    assert drain_order(ctl)[:3] == ["heavy0", "light0", "light1"]
    # a client alone in its lane is served in its own order
    for i in range(3):
        admit(ctl, f"solo{i}", client="s")
    assert drain_order(ctl)[-3:] == ["solo0", "solo1", "solo2"]


def test_a_light_request_does_not_pass_queued_work_it_would_make_late():
    ctl, clock, _ = make(safety_margin=0.0, response_margin_s=0.0)
    measure(ctl.model, clock, BEAM, 1.0, 3)
    measure(ctl.model, clock, S1, 0.5, 3)
    # heavy0 has plenty of slack, heavy1 has 0.2 s (predicted finish 2 s, deadline 2.2 s)
    admit(ctl, "heavy0", cost=BEAM_COST, client="h", deadline=clock.t + 10)
    admit(ctl, "heavy1", cost=BEAM_COST, client="h", deadline=clock.t + 2.2)
    admit(ctl, "light", client="l")  # its 0.5 s share would make heavy1 late: it queues behind heavy1
    assert [t.payload for t in ctl.waiting()] == ["heavy0", "heavy1", "light"]
    admit(ctl, "heavy2", cost=BEAM_COST, client="h2", deadline=clock.t + 30)  # a new client: as far as heavy1
    assert [t.payload for t in ctl.waiting()] == ["heavy0", "heavy1", "heavy2", "light"]
    admit(ctl, "light2", client="l2")  # heavy2 and light have the slack: it may pass them, not heavy1
    assert [t.payload for t in ctl.waiting()] == ["heavy0", "heavy1", "light2", "heavy2", "light"]
    assert [t.slack_s for t in ctl.waiting()][:2] == pytest.approx([9.0, 0.2])


def test_a_client_over_its_cap_is_refused_and_others_are_not():
    ctl, clock, _ = make(max_client_work_s=3.0, max_retry_after_s=5.0)
    measure(ctl.model, clock, BEAM, 1.0, 3)
    first = [admit(ctl, f"h{i}", cost=BEAM_COST, client="h") for i in range(3)]
    with pytest.raises(Overloaded) as e:
        admit(ctl, "h3", cost=BEAM_COST, client="h")
    assert e.value.reason == "client_limit" and "'h'" in str(e.value)
    assert e.value.retry_after_s == pytest.approx(1.0)  # 4 s wanted, 3 s allowed: 1 s to work off
    admit(ctl, "other", cost=BEAM_COST, client="x")
    taken = ctl.take_next()
    assert taken is first[0] and ctl.client_work_s("h") == pytest.approx(3.0)  # in flight still counts
    with pytest.raises(Overloaded):
        admit(ctl, "h3", cost=BEAM_COST, client="h")
    ctl.finished([taken])
    admit(ctl, "h3", cost=BEAM_COST, client="h")
    assert ctl.stats()["refused"]["client_limit"] == 2


def test_one_request_larger_than_a_cap_is_still_admitted_alone():
    ctl, clock, _ = make(max_client_work_s=0.5, max_lane_work_s=0.5)
    measure(ctl.model, clock, BEAM, 1.0, 3)
    admit(ctl, "big", cost=BEAM_COST, client="c")
    with pytest.raises(Overloaded) as e:
        admit(ctl, "big2", cost=BEAM_COST, client="d")
    assert e.value.reason == "queue_full" and "of work" in str(e.value)


# ---- refusal ----------------------------------------------------------------------------------------

def test_a_full_lane_refuses_with_a_retry_hint_and_other_lanes_still_admit():
    ctl, _, _ = make(max_queue_online=2, default_service_s=0.02)
    admit(ctl, "o1", O)
    admit(ctl, "o2", O)
    with pytest.raises(Overloaded) as e:
        admit(ctl, "o3", O)
    assert e.value.reason == "queue_full"
    assert 0 < e.value.retry_after_s <= ctl.config.max_retry_after_s
    admit(ctl, "n1", N)
    ctl.take_next()
    admit(ctl, "o3", O)  # a slot freed by taking
    s = ctl.stats()
    assert s["refused"]["queue_full"] == 1 and s["admitted"] == 4
    assert s["queue_depth"] == {"ONLINE": 2, "NORMAL": 1, "BACKGROUND": 0}


def test_deadline_refusal_counts_the_work_queued_ahead():
    ctl, clock, _ = make(safety_margin=0.0, response_margin_s=0.0)
    for info, run_s in ((S1, 0.050), (S2, 0.060), (S4, 0.080), (S8, 0.120)):  # per request: 50, 30, 20, 15 ms
        measure(ctl.model, clock, info, run_s, 4, gap_s=1.0)
    admit(ctl, "fits", deadline=clock.t + 0.06)
    ctl.finished([ctl.take_next()])
    # ten queued requests count their shares of the batches they would make with the ones before
    # them: 50 + 30 + 30 + 4 x 20 + 3 x 15 ms, not 10 x 50 ms
    for i in range(10):
        admit(ctl, f"q{i}")
    ahead_s = ctl.stats()["queue_work_s"]["NORMAL"]
    assert ahead_s == pytest.approx(0.235)
    with pytest.raises(Overloaded) as e:
        admit(ctl, "behind", deadline=clock.t + ahead_s)  # its own 50 ms does not fit after them
    assert e.value.reason == "deadline"
    assert e.value.retry_after_s == pytest.approx(0.05)  # when it would fit: 50 ms later
    with pytest.raises(Overloaded) as e:
        admit(ctl, "behind2", deadline=clock.t + ahead_s)
    assert e.value.retry_after_s == pytest.approx(0.065)  # the next appointment: one share (15 ms) later
    admit(ctl, "behind", deadline=clock.t + ahead_s + 0.06)
    admit(ctl, "online", O, deadline=clock.t + 0.06)  # ONLINE does not queue behind NORMAL work
    assert ctl.stats()["refused"]["deadline"] == 2


def test_inflight_batches_count_what_they_still_owe():
    ctl, clock, _ = make(safety_margin=0.0, response_margin_s=0.0)
    measure(ctl.model, clock, BEAM, 1.0, 3)
    measure(ctl.model, clock, S1, 0.01, 3)
    ctl.model.batch_started(1, BEAM, clock.t)
    clock.t += 0.25
    assert ctl.model.inflight_remaining_s(clock.t) == pytest.approx(0.75)
    with pytest.raises(Overloaded):
        admit(ctl, "x", deadline=clock.t + 0.7)
    admit(ctl, "x", deadline=clock.t + 0.8)
    ctl.model.batch_finished(1, BEAM, (clock.t - 0.25, clock.t), {2: 1})
    assert ctl.model.inflight_remaining_s(clock.t) == 0


def test_unmeetable_deadlines_are_not_retried():
    ctl, clock, _ = make(safety_margin=0.0, response_margin_s=0.0)
    with pytest.raises(DeadlineUnmeetable, match="passed"):
        admit(ctl, "gone", deadline=clock.t - 0.001)
    with pytest.raises(Overloaded):  # only the assumed 10 ms: not known to be impossible
        admit(ctl, "unmeasured", deadline=clock.t + 0.001)
    measure(ctl.model, clock, S1, 0.05, 3)
    with pytest.raises(DeadlineUnmeetable, match="own service time"):
        admit(ctl, "short", deadline=clock.t + 0.04)
    ctl.model.batch_started(9, S1, clock.t)  # busy, but a 60 ms deadline is possible: UNAVAILABLE, not this
    with pytest.raises(Overloaded):
        admit(ctl, "busy", deadline=clock.t + 0.06)
    assert ctl.stats()["refused"]["impossible"] == 2 and ctl.depth() == 0


def test_every_retry_hint_is_capped():
    ctl, clock, _ = make(max_retry_after_s=1.5, max_queue_normal=2000, max_lane_work_s=1e6)
    measure(ctl.model, clock, BEAM, 30.0, 3)  # 30 s batches: an hour of work queued
    for i in range(120):
        admit(ctl, f"q{i}", cost=BEAM_COST)
    hints = []
    for deadline_s in (60.0, 600.0, 3000.0):
        with pytest.raises(Overloaded) as e:
            admit(ctl, "late", cost=BEAM_COST, deadline=clock.t + deadline_s)
        hints.append(e.value.retry_after_s)
    ctl.start_draining()
    with pytest.raises(Overloaded) as e:
        admit(ctl, "drain")
    hints.append(e.value.retry_after_s)
    assert max(hints) <= 1.5 and min(hints) > 0, hints
    assert ctl.backlog_hint_s() <= 1.5 and ctl.unavailable_hint_s() <= 1.5


def test_draining_refuses_new_work_but_queued_work_is_still_taken():
    ctl, _, _ = make(unavailable_retry_s=0.25)
    admit(ctl, "n1")
    ctl.start_draining()
    with pytest.raises(Overloaded) as e:
        admit(ctl, "o1", O)
    assert e.value.reason == "draining" and e.value.retry_after_s == pytest.approx(0.25)
    assert drain_order(ctl) == ["n1"]
    assert ctl.stats()["refused"]["draining"] == 1


# ---- the defects of issue 11 -------------------------------------------------------------------------

def test_after_a_burst_of_maximal_requests_an_idle_server_admits_a_small_one():
    """Old model: a kind never seen took the slowest kind's time, and Kingman's term with ρ clamped
    at 0.95 multiplied it: "predicted completion in 226.8 s" for a small Score with a 10 s deadline."""
    ctl, clock, _ = make()
    measure(ctl.model, clock, BEAM, 5.0, 4)  # 20 s of maximal BeamSearch, back to back: ρ = 1
    assert ctl.model.utilisation(None, clock.t) == pytest.approx(1.0)
    t = admit(ctl, "small", deadline=clock.t + 10.0)  # Score never measured: scaled from the beams' FLOPs
    assert ctl.predict_latency_s(t) < 0.1


def test_a_bucket_is_measured_once_it_or_a_neighbour_by_flops_has_run():
    ctl, clock, _ = make()
    cold = admit(ctl, "cold")
    assert not cold.measured and not ctl.model.is_measured(S1, clock.t)  # the assumed default
    measure(ctl.model, clock, S2, 0.02, 1)
    assert admit(ctl, "warm").measured  # S1 from S2, by FLOPs
    assert ctl.model.is_measured(S8, clock.t) and ctl.model.is_measured(BEAM, clock.t)  # and the other family
    assert not admit(ctl, "unpriced", cost=None).measured  # priced by the default alone


def test_one_outlier_batch_does_not_move_the_estimate():
    model, clock = ServiceTimeModel(), FakeClock(0.0)
    measure(model, clock, S1, 0.010, 20)
    measure(model, clock, S1, 5.0, 1)  # a stall: recorded capped at outlier_factor x the estimate
    assert model.bucket_s(S1, clock.t) == pytest.approx(0.010)
    measure(model, clock, S1, 0.010, 5)
    assert model.bucket_s(S1, clock.t) == pytest.approx(0.010)
    measure(model, clock, S1, 0.020, 32)  # a real slow-down is followed
    assert model.bucket_s(S1, clock.t) == pytest.approx(0.020)


def test_estimates_keep_learning_while_a_bucket_is_refused():
    """A bucket measured slow once (and since refused every time) gives way, after service_ttl_s, to
    what the buckets that did run say."""
    ctl, clock, _ = make(service_ttl_s=10.0, safety_margin=0.0, response_margin_s=0.0)
    measure(ctl.model, clock, S2, 2.0, 1)  # a one-off: the executor was busy elsewhere
    with pytest.raises(DeadlineUnmeetable):
        admit(ctl, "pair", cost=RequestCost("score", S2, ((1, S2),)), deadline=clock.t + 0.5)
    for _ in range(12):  # other buckets keep running, fast
        measure(ctl.model, clock, S1, 0.01, 1)
        measure(ctl.model, clock, S4, 0.03, 1, gap_s=1.0)
    assert ctl.model.bucket_s(S2, clock.t) == pytest.approx(0.0167, abs=1e-3)  # between S1 and S4 by FLOPs
    admit(ctl, "pair", cost=RequestCost("score", S2, ((1, S2),)), deadline=clock.t + 0.5)


def test_a_busy_window_does_not_refuse_what_the_queue_can_do():
    """ρ near 1 over the last seconds but nothing queued now: the wait is the work ahead, not Kingman's."""
    ctl, clock, _ = make(utilisation_window_s=10.0)
    measure(ctl.model, clock, S1, 0.1, 100)
    admit(ctl, "x", deadline=clock.t + 0.3)


# ---- dropped tickets ---------------------------------------------------------------------------------

def test_expired_and_cancelled_tickets_are_never_taken():
    ctl, clock, dropped = make(default_service_s=0.001)
    admit(ctl, "expires", O, deadline=clock.t + 0.5)
    cancelled_lazily = admit(ctl, "cancelled-lazily", O)
    removed = admit(ctl, "removed", N)
    admit(ctl, "stays", N, deadline=clock.t + 10)
    admit(ctl, "b", B)
    cancelled_lazily.future.cancelled = True  # its caller went away; nobody told the controller
    assert ctl.remove(removed, "cancelled") is True
    assert ctl.remove(removed, "cancelled") is False  # not queued any more
    clock.t += 1.0
    assert drain_order(ctl) == ["stays", "b"]
    s = ctl.stats()
    assert s["expired"] == 1 and s["cancelled"] == 2 and s["taken"] == 2 and s["clients"] == 0
    assert sorted(dropped) == [("cancelled-lazily", "cancelled"), ("expires", "expired"), ("removed", "cancelled")]
    assert s["queue_work_s"] == {"ONLINE": 0.0, "NORMAL": 0.0, "BACKGROUND": 0.0}


def test_a_taken_ticket_cannot_be_removed():
    ctl, _, dropped = make()
    t = admit(ctl, "x")
    ctl.take_next()
    assert ctl.remove(t, "cancelled") is False and dropped == []
    assert ctl.stats()["cancelled"] == 0


# ---- the service-time model ----------------------------------------------------------------------

def test_bucket_time_is_a_high_quantile_of_its_window():
    model, clock = ServiceTimeModel(window=10, quantile=0.9), FakeClock(0.0)
    for run in (0.010, 0.011, 0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019):
        measure(model, clock, S1, run, 1)
    assert model.bucket_s(S1, clock.t) == pytest.approx(0.0181)
    assert model.bucket_s(S8, clock.t) == pytest.approx(0.0181 * 8)  # above the largest: by FLOPs
    measure(model, clock, S4, 0.04, 3)
    assert model.bucket_s(S2, clock.t) == pytest.approx(0.0181 + (0.04 - 0.0181) / 3)  # between, by FLOPs
    assert model.bucket_s(BucketInfo("score.tiny", "score", 1e8), clock.t) == pytest.approx(0.0181)  # below


def test_a_buckets_fastest_run_is_its_own_recent_minimum_or_nothing():
    """bucket_min_s: a lower bound on the next batch (when a queued request can no longer finish in
    time): the fastest of its own window, never interpolated from neighbours, 0 once stale."""
    model, clock = ServiceTimeModel(window=4, ttl_s=60.0), FakeClock(0.0)
    assert model.bucket_min_s(S1, clock.t) == 0.0  # never run
    for run in (0.020, 0.012, 0.015):
        measure(model, clock, S1, run, 1)
    assert model.bucket_min_s(S1, clock.t) == pytest.approx(0.012)
    assert model.bucket_min_s(S2, clock.t) == 0.0  # its neighbour's times bound nothing of its own
    for run in (0.030, 0.031, 0.032, 0.033):  # the 12 ms run leaves the window of 4
        measure(model, clock, S1, run, 1)
    assert model.bucket_min_s(S1, clock.t) == pytest.approx(0.030)
    assert model.bucket_min_s(S1, clock.t + 61.0) == 0.0  # nothing lately: not known


def test_overlapping_batches_give_parallelism_and_count_once_in_rho():
    # two lanes in flight: runs of 1 s overlapping by half: the executor finishes one every 0.5 s
    model = ServiceTimeModel(utilisation_window_s=100.0, num_lanes=2)
    for i in range(40):
        model.batch_started(i, S1, i * 0.5)
        model.batch_finished(i, S1, (i * 0.5, i * 0.5 + 1.0), {2: 1})
    assert model.bucket_s(S1, 20.5) == pytest.approx(1.0)
    assert model.parallelism(20.5) == pytest.approx(40 / 20.5)
    assert model.utilisation(None, 20.5) == pytest.approx(20.5 / 100.0)  # the union of the runs, not their sum


def test_inflight_remaining_with_one_lane_and_with_two():
    for lanes, want in ((1, 0.6 + 1.0), (2, 0.6 + 0.8)):
        model = ServiceTimeModel(num_lanes=lanes)
        clock = FakeClock(0.0)
        measure(model, clock, S1, 1.0, 3)
        model.batch_started(1, S1, 10.0)
        model.batch_started(2, S1, 10.2)
        assert model.inflight_remaining_s(10.4) == pytest.approx(want)


def test_utilisation_by_level_counts_only_that_level_and_above():
    model, clock = ServiceTimeModel(utilisation_window_s=10.0), FakeClock(0.0)
    measure(model, clock, S1, 0.5, 10, gap_s=0.5, levels={1: 1, 3: 3})
    assert model.utilisation(1, clock.t) == pytest.approx(0.125)
    assert model.utilisation(2, clock.t) == pytest.approx(0.125)
    assert model.utilisation(3, clock.t) == pytest.approx(0.5)
    clock.t += 5.0  # idle for half the window
    assert model.utilisation(None, clock.t) == pytest.approx(0.25)


def test_higher_lane_load_stretches_a_lower_lanes_wait():
    ctl, clock, _ = make(utilisation_window_s=10.0, safety_margin=0.0, response_margin_s=0.0)
    measure(ctl.model, clock, S1, 0.1, 10)
    t_idle = Ticket("n", "score", N, cost=SCORE_COST)
    quiet = ctl.predict_latency_s(t_idle)
    measure(ctl.model, clock, S1, 0.1, 100, levels={1: 1})  # ONLINE kept it busy all the window
    for i in range(5):
        admit(ctl, f"n{i}")
    stretched = ctl.predict_latency_s(t_idle) - 0.1
    plain = ctl.stats()["queue_work_s"]["NORMAL"]
    assert quiet == pytest.approx(0.1)
    assert stretched == pytest.approx(plain * (1 + ctl.config.online_burst), rel=0.05)  # ρ_ONLINE = 1: burst cap


def test_config_is_validated():
    for bad in ({"max_queue_online": 0}, {"online_burst": 0}, {"service_quantile": 0.0}, {"outlier_factor": 0.5},
                {"default_service_s": 0.0}, {"safety_margin": -0.1}, {"max_queue_normal": 2.5},
                {"max_retry_after_s": 0.0}, {"min_retry_after_s": 3.0}, {"max_client_work_s": -1.0},
                {"client_id_metadata": "X-Client"}, {"max_inflight_rpcs": 0}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)


def test_predictions_learn_from_their_own_errors():
    ctl, clock, _ = make(safety_margin=0.0, response_margin_s=0.0, calibration_decay_s=10.0, max_calibration=3.0)
    measure(ctl.model, clock, S1, 0.1, 3)
    t = Ticket("x", "score", N, cost=SCORE_COST)
    assert ctl.predict_latency_s(t) == pytest.approx(0.1)
    ctl.model.observe_prediction(0.1, 0.15, clock.t)  # a request took half again what was predicted
    assert ctl.model.calibration_at(clock.t) == pytest.approx(1.5) and ctl.predict_latency_s(t) == pytest.approx(0.15)
    ahead = admit(ctl, "ahead")  # lanes not idle: the calibrated prediction decides
    with pytest.raises(Overloaded):
        admit(ctl, "tight", deadline=clock.t + 0.22)
    ctl.take([ahead])
    ctl.finished([ahead])
    ctl.model.observe_prediction(0.1, 0.05, clock.t)  # a fast one does not undo it
    ctl.model.observe_prediction(0.1, 1.0, clock.t)
    assert ctl.model.calibration_at(clock.t) == 3.0  # at most max_calibration
    clock.t += 10.0  # its excess decays: e^-1 after calibration_decay_s
    assert ctl.model.calibration_at(clock.t) == pytest.approx(1 + 2 / 2.718281828, rel=1e-6)
    clock.t += 200.0
    assert ctl.model.calibration_at(clock.t) == pytest.approx(1.0)
    ctl.model.observe_lag(0.03)  # a busy event loop answers late: every prediction carries it
    assert ctl.response_margin_s() == pytest.approx(0.03) and ctl.predict_latency_s(t) == pytest.approx(0.13)


def test_each_lane_s_own_error_is_kept_beside_the_calibration():
    """The calibration is the worst error of any lane; each lane's own is kept too, decaying the
    same way, so the metrics show which lane's predictions miss (a lower lane's requests are
    overtaken by higher ones that come after them)."""
    ctl, clock, _ = make(calibration_decay_s=10.0, max_calibration=2.0)
    m = ctl.model
    m.observe_prediction(0.1, 0.11, clock.t, lane=int(Priority.ONLINE))
    m.observe_prediction(0.1, 0.18, clock.t, lane=int(Priority.NORMAL))
    m.observe_prediction(0.1, 0.5, clock.t)  # no lane given: the calibration only
    assert m.calibration_at(clock.t) == 2.0
    assert m.lane_error_at(int(Priority.ONLINE), clock.t) == pytest.approx(1.1)
    assert m.lane_error_at(int(Priority.NORMAL), clock.t) == pytest.approx(1.8)
    assert m.lane_error_at(int(Priority.BACKGROUND), clock.t) == 1.0  # nothing seen
    m.observe_prediction(0.1, 0.105, clock.t, lane=int(Priority.ONLINE))  # smaller: kept the worst
    clock.t += 10.0
    assert m.lane_error_at(int(Priority.NORMAL), clock.t) == pytest.approx(1 + 0.8 / 2.718281828, rel=1e-6)
    assert ctl.stats()["model"]["error_by_priority"] == {
        "ONLINE": pytest.approx(1 + 0.1 / 2.718281828, rel=1e-6),
        "NORMAL": pytest.approx(1 + 0.8 / 2.718281828, rel=1e-6), "BACKGROUND": 1.0}


def test_admission_gate_shape_is_never_larger_than_the_decoded_request(model):
    """The server's gate admits on Codec.shape_of before decoding; refusing on it is right only if
    it is no larger than what decoding makes (ids exact, text at its fewest possible tokens), with
    the same samples, beam width, new tokens and priority."""
    import random

    from service.serving.grpc_codec import Codec
    from service.serving.proto_gen import load as load_stubs

    pb2 = load_stubs().pb2
    codec = Codec(model.artifact, model.tokenizer)
    rng = random.Random(5)
    # decomposed sequences that NFC composes into fewer characters (e + two marks, Hangul jamo)
    words = ["running", "shoes", " trail", "é", "数据", "🙂", "a", " ", "xyz", "\n", "e\u0301\u0302",
             "\u1100\u1161\u11a8", "\u1100\u1161\u11a8" * 4, "a\u0308\u0301"]

    def segment() -> object:
        if rng.random() < 0.5:
            return pb2.Segment(ids=[rng.randrange(1000) for _ in range(rng.randint(1, 40))])
        return pb2.Segment(text="".join(rng.choice(words) for _ in range(rng.randint(1, 30))))

    for _ in range(200):
        prio = rng.choice([0, 1, 2, 3])
        if rng.random() < 0.5:
            msg = pb2.ScoreRequest(samples=[segment() for _ in range(rng.randint(1, 6))], label_ids=[3], priority=prio)
            if rng.random() < 0.5:
                msg.prefix.CopyFrom(segment())
            shape, priority = codec.shape_of("score", msg)
            real, real_priority = codec.score_request(msg)
            assert shape.num_samples == real.num_samples and shape.num_tokens <= real.num_tokens
            assert all(len(a) <= len(b) for a, b in zip(shape.samples, real.samples))
            assert len(shape.prefix_ids) <= len(real.prefix_ids)
        else:
            msg = pb2.BeamSearchRequest(prompt=segment(), beam_width=rng.randint(1, 8), new_tokens=rng.randint(1, 3),
                                        priority=prio)
            shape, priority = codec.shape_of("beam", msg)
            real, real_priority = codec.beam_request(msg)
            assert len(shape.prompt_ids) <= len(real.prompt_ids)
            assert (shape.beam_width, shape.new_tokens) == (real.beam_width, real.new_tokens)
        assert priority == real_priority
    # outside the limits, or an unknown priority: no shape (decoding names the field)
    lim = model.artifact.limits
    assert codec.shape_of("beam", pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[1]), beam_width=lim.max_beam_width + 1,
                                                        new_tokens=1)) is None
    assert codec.shape_of("score", pb2.ScoreRequest(samples=[pb2.Segment(ids=[1])], priority=9)) is None
    assert codec.shape_of("score", pb2.ScoreRequest()) is None
