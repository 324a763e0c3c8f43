"""ops/bench/overload_bench.py's open loop ends on its own: an overload run on the H200 once ran past
its time limit and its clients' outcomes were lost. Calls still unanswered a grace after the
last send are cancelled and reported (CLIENT_CANCELLED); progress is reported while it runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ops.bench import overload_bench as ob


def test_open_loop_cancels_what_is_never_answered_and_reports_the_rest() -> None:
    answered = 0

    async def call(msg: Any, timeout: float | None = None, metadata: Any = None) -> None:
        nonlocal answered
        if msg % 2:  # every other call is never answered
            await asyncio.Event().wait()
        answered += 1

    reports: list[tuple[float, int, int]] = []

    async def run() -> list[ob.Outcome]:
        return await ob.open_loop(call, lambda i: (i, ob.NORMAL, None), rate_per_s=400.0, duration_s=0.5,
                                  grace_s=0.3, progress=lambda t, out, sent: reports.append((t, len(out), sent)))

    t0 = time.monotonic()
    outcomes = asyncio.run(run())
    took = time.monotonic() - t0
    codes = [o.code for o in outcomes]
    assert took < 0.5 + 0.3 + 1.0, took  # the send window, the grace, slack: not the calls' forever
    assert codes.count("OK") == answered > 50
    assert abs(codes.count("CLIENT_CANCELLED") - answered) <= 1  # the odd-numbered half, within one
    assert reports == [], reports  # the first report is due at 10 s of the schedule


def test_open_loop_reports_progress_on_its_schedule() -> None:
    async def call(msg: Any, timeout: float | None = None, metadata: Any = None) -> None:
        return None

    reports: list[tuple[float, int, int]] = []
    outcomes = asyncio.run(ob.open_loop(call, lambda i: (i, ob.NORMAL, None), rate_per_s=200.0, duration_s=1.05,
                                        progress=lambda t, out, sent: reports.append((t, len(out), sent)),
                                        progress_every_s=0.25))
    assert [int(t / 0.25) for t, _, _ in reports] == [1, 2, 3, 4]
    assert all(0 < answered <= sent < len(outcomes) for _, answered, sent in reports)


def _stats(expired: int, cancelled: int, late: int, front_refused: int = 0, cancelled_in_flight: int = 0) -> dict[str, Any]:
    return {"queue_depth": {"ONLINE": 0, "NORMAL": 0, "BACKGROUND": 0}, "inflight": 0,
            "admitted_by_priority": {"ONLINE": 0, "NORMAL": 0, "BACKGROUND": 0},
            "refused": {"queue_full": 0, "front_deadline": front_refused, "front_backlog": 2 * front_refused},
            "expired": expired, "cancelled": cancelled, "drained": 0, "expired_in_flight": 0,
            "cancelled_in_flight": cancelled_in_flight, "answered_late": late, "batches": 0, "batches_failed": 0, "batch_sizes": {}, "buckets": {}}


def test_the_server_view_splits_admitted_late_requests_by_why() -> None:
    """The H200 overload run must show that no admitted request ends late: the server's metrics,
    scraped before and after the window, separate the requests that expired or were cancelled
    (in its queue, or in a running batch) from those run and answered after their deadline."""
    from ops.bench.bench_grpc import _SAMPLE
    from service.observe.metrics import render, scheduler_families

    def scraped(stats: dict[str, Any]) -> dict[tuple[str, str], float]:
        out = {}
        for line in render(scheduler_families(stats)).splitlines():
            if m := _SAMPLE.match(line):
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
        return out

    view = ob.server_view(scraped(_stats(2, 1, 0, 1, 1)), scraped(_stats(9, 4, 3, 11, 3)), window_s=1.0, sent=100)
    assert view["admitted_late"] == {"expired": 7, "cancelled": 3, "answered_late": 3, "expired_in_flight": 0,
                                     "cancelled_in_flight": 2}
    # serve --fronts: what the fronts refused never reached the engine's RPC counts, and is not
    # counted as never finished
    assert view["front_refused"] == 30 and view["never_finished"] == 100 - 30


def test_the_quiet_caller_calls_one_at_a_time_and_keeps_only_the_floors_refusals() -> None:
    """A quiet caller stands for one of many light callers: it calls slmrank, then the floor, then
    pauses, one call at a time (its latencies hold no queue of its own); its outcomes carry the
    status, the retry hint and the impossible-deadline mark as a grpc.aio caller's do, and a floor
    call that is not refused is not a refusal latency."""
    from ops.bench.h2call import Answer

    calls: list[tuple[str, int, float | None]] = []
    unavailable, ok, late = 14, 0, 4

    def call(msg: int, deadline_s: float | None) -> Answer:
        calls.append(("slmrank", msg, deadline_s))
        if msg % 3 == 0:
            return Answer(unavailable, "overloaded (deadline): x; retry after 7 ms", {"retry-after-ms": "7"},
                          latency_s=0.001)
        if msg % 3 == 1:
            return Answer(late, "the deadline in 0.0010 s is shorter ...; no retry can meet it", latency_s=0.002)
        return Answer(ok, "", {}, b"", latency_s=0.02)

    def floor(msg: int, deadline_s: float | None) -> Answer:
        calls.append(("floor", msg, deadline_s))
        return Answer(unavailable if msg % 2 else ok, "", latency_s=0.0005 + msg * 1e-6)

    outcomes, floor_latencies = ob.quiet_loop(call, floor, lambda i: (i, ob.NORMAL, 0.5), duration_s=0.2,
                                              interval_s=0.005)
    n = len(outcomes)
    assert n > 10
    assert calls == [c for i in range(n) for c in (("slmrank", i, 0.5), ("floor", i, 1.0))]
    assert [o.code for o in outcomes] == [("UNAVAILABLE", "DEADLINE_EXCEEDED", "OK")[i % 3] for i in range(n)]
    assert [o.retry_after_ms for o in outcomes[:3]] == [7, None, None]
    assert [o.impossible for o in outcomes[:3]] == [False, True, False]
    assert [o.latency_s for o in outcomes[:3]] == [0.001, 0.002, 0.02]
    assert floor_latencies == [0.0005 + i * 1e-6 for i in range(n) if i % 2]
    assert all(b.sent_s - a.sent_s >= 0.005 for a, b in zip(outcomes, outcomes[1:]))


def test_split_cpus_gives_the_clients_the_last_cpus_and_the_server_the_rest() -> None:
    assert ob.split_cpus([3, 0, 2, 1, 5, 4], 2) == ({0, 1, 2, 3}, {4, 5})
    for bad in (0, 6, 7):
        with pytest.raises(SystemExit, match="--client-cpus"):
            ob.split_cpus(range(6), bad)


def test_the_admission_summary_shows_when_and_why_a_run_refused() -> None:
    """A run that serves less than its capacity must say why: the sampled calibration and ingress
    delay, and the refusals by reason in each 10 s (counters sampled each second, a failed scrape
    skipped)."""
    rows = [{"t_s": 1.0, "calibration": 1.0, "ingress_s": 0.001},
            {"t_s": 2.0, "calibration": 1.5, "ingress_s": 0.003, "refused": {"front_deadline": 5.0}},
            {"t_s": 3.0},  # no answer from /metrics
            {"t_s": 11.0, "calibration": 2.0, "ingress_s": 0.002, "lane_error": {"ONLINE": 1.2, "NORMAL": 2.0},
             "refused": {"front_deadline": 9.0, "front_backlog": 4.0}},
            {"t_s": 12.0, "calibration": 1.5, "ingress_s": 0.0, "lane_error": {"ONLINE": 1.0, "NORMAL": 1.5},
             "refused": {"front_deadline": 9.0, "front_backlog": 10.0}}]
    a = ob.admission_summary(rows)
    assert a["calibration_mean"] == 1.5 and a["calibration_max"] == 2.0
    assert a["ingress_ms_mean"] == 1.5 and a["ingress_ms_max"] == 3.0
    assert a["lane_error_mean"] == {"NORMAL": 1.75, "ONLINE": pytest.approx(1.1)}
    assert a["refused_per_10s"] == [{"from_s": 0, "refused": {"front_deadline": 5}},
                                    {"from_s": 10, "refused": {"front_deadline": 4, "front_backlog": 10}}]
    assert ob.admission_summary([{"t_s": 1.0, "rss_mb": 5.0}]) is None  # no metrics: nothing to say
