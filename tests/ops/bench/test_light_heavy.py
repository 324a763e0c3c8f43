"""ops/bench/light_heavy.py: the report's p99 ratio and its verdict from known outcomes, and one short
run against a CPU server (tiny model, a scheduler constant changed by --set): both callers' requests
reach it, each condition is measured."""

from __future__ import annotations

from argparse import Namespace

import pytest

from ops.bench import light_heavy
from ops.bench.overload_bench import NORMAL, Outcome


def _ok(ms: list[float]) -> list[Outcome]:
    return [Outcome(sent_s=0.0, latency_s=m / 1e3, code="OK", priority=NORMAL) for m in ms]


@pytest.mark.parametrize("slowdown,within", [(1.5, True), (3.0, False)])
def test_report_compares_the_light_p99_beside_heavy_with_alone(slowdown: float, within: bool) -> None:
    alone = _ok([10.0] * 99 + [20.0])
    beside = _ok([10.0 * slowdown] * 99 + [20.0 * slowdown])
    heavy = _ok([500.0] * 4) + [Outcome(0.0, 0.001, "UNAVAILABLE", NORMAL, retry_after_ms=50)]
    r = light_heavy.report(alone, beside, heavy, Namespace(windows=2, window_s=1.0))
    assert r["p99_ratio"] == pytest.approx(slowdown, rel=1e-6)
    assert r["p99_within_2x"] is within
    assert r["heavy"]["codes"] == {"OK": 4, "UNAVAILABLE": 1}


def test_no_light_answer_gives_no_ratio() -> None:
    refused = [Outcome(0.0, 0.001, "UNAVAILABLE", NORMAL)]
    r = light_heavy.report(refused, _ok([5.0]), [], Namespace(windows=1, window_s=1.0))
    assert r["p99_ratio"] is None and r["p99_within_2x"] is False


def test_a_short_run_against_a_cpu_server(tmp_path) -> None:
    r = light_heavy.main(["--model", "embedded:tiny", "--light", "W1", "--heavy", "W2", "--device", "cpu",
                          "--windows", "1", "--window-s", "1", "--light-clients", "1", "--heavy-clients", "1",
                          "--set", "batcher.heavy_ratio=4", "--out", str(tmp_path)])
    assert r["light_alone"]["codes"].get("OK", 0) > 0 and r["light_beside_heavy"]["codes"].get("OK", 0) > 0
    assert r["heavy"]["sent"] > 0  # the heavy caller's requests reached the server (served or refused)
    assert (tmp_path / "light_heavy.json").exists()
    # --set: the server was serve_tuned's, with that constant changed
    assert "[serve_tuned] BatcherConfig.heavy_ratio = 4.0" in (tmp_path / "slmrank_server.log").read_text()
    assert r["set"] == ["batcher.heavy_ratio=4"]
    # the server's view: its batches, and the stages of the light (Score) requests in both conditions
    assert r["server_batches"]["all"] > 0
    for cond in ("alone", "beside"):
        assert r["server_stage_ms"][cond]["Score"]["execute"] > 0, r["server_stage_ms"]
    assert "BeamSearch" not in r["server_stage_ms"]["alone"]  # no heavy request finished in those windows
