"""Admission policy on a fake clock: lane order and the lower lanes' share, bounded lanes, refusal of
work that would finish late (measured τ, Kingman), draining, and dropped tickets never taken."""

from __future__ import annotations

import pytest

from service.serving.admission import AdmissionConfig, AdmissionController, Overloaded, Priority, ServiceTimeModel, Ticket

O, N, B = Priority.ONLINE, Priority.NORMAL, Priority.BACKGROUND


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeFuture:
    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled


def make(clock: FakeClock | None = None, **cfg) -> tuple[AdmissionController, FakeClock, list]:
    clock = clock or FakeClock()
    dropped: list = []
    ctl = AdmissionController(AdmissionConfig(**cfg), clock=clock, on_drop=lambda t, why: dropped.append((t.payload, why)))
    return ctl, clock, dropped


def admit(ctl: AdmissionController, name: str, priority: Priority = N, deadline: float | None = None,
          kind: str = "score") -> Ticket:
    t = Ticket(name, kind, priority, deadline, future=FakeFuture())
    ctl.admit(t)
    return t


def drain_order(ctl: AdmissionController) -> list[str]:
    out = []
    while (t := ctl.take_next()) is not None:
        out.append(t.payload)
    return out


def measure(model: ServiceTimeModel, clock: FakeClock, run_s: float, n: int, gap_s: float = 0.0,
            lanes: dict | None = None, kind: str = "score") -> None:
    """n batches of run_s each, back to back with gap_s idle between them, on the fake clock."""
    for _ in range(n):
        start = clock.t
        clock.t += run_s
        model.batch_started()
        model.batch_finished(kind, (start, clock.t), lanes or {N: 1})
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


# ---- refusal ----------------------------------------------------------------------------------------

def test_a_full_lane_refuses_with_a_retry_hint_and_other_lanes_still_admit():
    ctl, _, _ = make(max_queue_online=2, default_service_s=0.02)
    admit(ctl, "o1", O)
    admit(ctl, "o2", O)
    with pytest.raises(Overloaded) as e:
        admit(ctl, "o3", O)
    assert e.value.reason == "queue_full"
    assert e.value.retry_after_s == pytest.approx(2 * 0.02)
    admit(ctl, "n1", N)
    ctl.take_next()
    admit(ctl, "o3", O)  # a slot freed by taking
    s = ctl.stats()
    assert s["refused"]["queue_full"] == 1 and s["admitted"] == 4
    assert s["queue_depth"] == {"ONLINE": 2, "NORMAL": 1, "BACKGROUND": 0}


def test_deadline_refusal_uses_the_measured_batch_time():
    ctl, clock, _ = make(default_service_s=0.001, safety_margin=0.0, utilisation_window_s=1000.0)
    admit(ctl, "early", deadline=clock.t + 0.01)  # nothing measured: 1 ms assumed, fits 10 ms
    ctl.take_next()
    measure(ctl.model, clock, 0.05, 4, gap_s=1.0)
    assert ctl.model.tau_s == pytest.approx(0.05) and ctl.model.service_s("score") == pytest.approx(0.05)
    with pytest.raises(Overloaded) as e:
        admit(ctl, "late", deadline=clock.t + 0.03)  # its own batch alone takes 50 ms
    assert e.value.reason == "deadline" and e.value.retry_after_s > 0
    admit(ctl, "fits", deadline=clock.t + 0.5)

    # ten single-request batches queued ahead: ~10 x 50 ms before its own batch can start
    for i in range(9):
        admit(ctl, f"q{i}")
    with pytest.raises(Overloaded):
        admit(ctl, "behind", deadline=clock.t + 0.3)
    admit(ctl, "behind", deadline=clock.t + 2.0)
    # ONLINE does not queue behind NORMAL work
    admit(ctl, "online", O, deadline=clock.t + 0.3)
    assert ctl.stats()["refused"]["deadline"] == 2


def test_an_already_passed_deadline_is_refused():
    ctl, clock, _ = make(default_service_s=1e-6)
    with pytest.raises(Overloaded) as e:
        admit(ctl, "gone", deadline=clock.t - 0.001)
    assert e.value.reason == "deadline"
    assert ctl.depth() == 0 and ctl.stats()["admitted"] == 0


def test_draining_refuses_new_work_but_queued_work_is_still_taken():
    ctl, _, _ = make()
    admit(ctl, "n1")
    ctl.start_draining()
    with pytest.raises(Overloaded) as e:
        admit(ctl, "o1", O)
    assert e.value.reason == "draining"
    assert drain_order(ctl) == ["n1"]
    assert ctl.stats()["refused"]["draining"] == 1


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
    assert s["expired"] == 1 and s["cancelled"] == 2 and s["taken"] == 2
    assert sorted(dropped) == [("cancelled-lazily", "cancelled"), ("expires", "expired"), ("removed", "cancelled")]


def test_a_taken_ticket_cannot_be_removed():
    ctl, _, dropped = make()
    t = admit(ctl, "x")
    ctl.take_next()
    assert ctl.remove(t, "cancelled") is False and dropped == []
    assert ctl.stats()["cancelled"] == 0


# ---- the queueing model ----------------------------------------------------------------------------

def _model(**cfg) -> tuple[ServiceTimeModel, FakeClock]:
    clock = FakeClock(0.0)
    return ServiceTimeModel(AdmissionConfig(**cfg), clock), clock


def test_utilisation_is_busy_time_over_the_window():
    model, clock = _model(utilisation_window_s=10.0)
    measure(model, clock, 0.3, 10, gap_s=0.7)  # 30% busy over the last 10 s
    assert model.utilisation(now=clock.t) == pytest.approx(0.3)
    measure(model, clock, 0.8, 10, gap_s=0.2)
    assert model.utilisation() == pytest.approx(0.8)
    clock.t += 5.0  # idle for half the window
    assert model.utilisation() == pytest.approx(0.4)


def test_overlapping_batches_count_once_in_rho_and_tau():
    # two lanes in flight: runs of 1 s overlapping by half: the executor finishes one every 0.5 s
    model, clock = _model(utilisation_window_s=100.0, ewma_alpha=0.5)
    for i in range(40):
        model.batch_started()
        model.batch_finished("score", (i * 0.5, i * 0.5 + 1.0), {N: 1})
    clock.t = 20.5
    assert model.service_s("score") == pytest.approx(1.0)
    assert model.tau_s == pytest.approx(0.5)
    assert model.utilisation() == pytest.approx(20.5 / 100.0)  # the union of the runs, not their sum


def test_utilisation_by_priority_counts_only_that_lane_and_above():
    model, clock = _model(utilisation_window_s=10.0)
    measure(model, clock, 0.5, 10, gap_s=0.5, lanes={O: 1, B: 3})
    assert model.utilisation(O) == pytest.approx(0.125)
    assert model.utilisation(N) == pytest.approx(0.125)
    assert model.utilisation(B) == pytest.approx(0.5)
    assert model.kingman_wait_s(O) < model.kingman_wait_s(B)


def test_kingman_term_matches_the_formula():
    model, clock = _model(utilisation_window_s=10.0, cv_alpha=0.1)
    measure(model, clock, 0.5, 20, gap_s=0.5)  # ρ = 0.5, constant service: c_s² = 0
    for i in range(20):
        model.observe_arrival(i * 1.0)  # regular arrivals: c_a² = 0
    assert model.cs2 == pytest.approx(0.0) and model.ca2 == pytest.approx(0.0)
    assert model.kingman_wait_s() == pytest.approx(0.0)
    for i in range(60):  # alternate gaps 0.2 / 1.8: mean 1, std 0.8 → c_a² ≈ 0.64
        model.observe_arrival(20 + i // 2 * 2.0 + (0.2 if i % 2 else 0.0))
    ca2 = model.ca2
    assert 0.4 < ca2 < 0.9
    assert model.kingman_wait_s() == pytest.approx(0.5 / 0.5 * (ca2 + 0.0) / 2 * 0.5)
    assert model.predict_wait_s(3) == pytest.approx(3 * 0.5 + model.kingman_wait_s())


def test_kingman_wait_grows_with_utilisation_and_variability():
    waits = []
    for busy in (0.2, 0.5, 0.8, 0.99):
        model, clock = _model(utilisation_window_s=10.0, rho_max=0.95)
        measure(model, clock, busy, 10, gap_s=1.0 - busy)
        waits.append(model.kingman_wait_s())
    assert waits == sorted(waits) and waits[0] < waits[1] < waits[2] < waits[3]
    # clamped at rho_max; constant runs: c_s² = 0; no arrivals seen: c_a² = 1 (M/D/1)
    assert waits[3] == pytest.approx(0.95 / 0.05 * (1.0 + 0.0) / 2 * model.tau_s)

    def wait_with_gaps(gaps: list[float]) -> float:
        model, clock = _model(utilisation_window_s=10.0)
        measure(model, clock, 0.5, 10, gap_s=0.5)
        t = 0.0
        for g in gaps * 20:
            t += g
            model.observe_arrival(t)
        return model.kingman_wait_s(now=clock.t)

    assert wait_with_gaps([1.0]) < wait_with_gaps([0.5, 1.5]) < wait_with_gaps([0.05, 1.95])


def test_a_busier_executor_refuses_a_deadline_an_idle_one_accepts():
    def refused(busy: float) -> bool:
        ctl, clock, _ = make(utilisation_window_s=10.0, safety_margin=0.0)
        measure(ctl.model, clock, busy * 0.1, 100, gap_s=(1 - busy) * 0.1)
        try:
            admit(ctl, "x", deadline=clock.t + 0.5)
            return False
        except Overloaded:
            return True

    assert not refused(0.3) and refused(0.97)


def test_config_is_validated():
    for bad in ({"max_queue_online": 0}, {"online_burst": 0}, {"ewma_alpha": 1.0}, {"rho_max": 0.0},
                {"default_service_s": 0.0}, {"safety_margin": -0.1}, {"max_queue_normal": 2.5}):
        with pytest.raises(ValueError):
            AdmissionConfig(**bad)
