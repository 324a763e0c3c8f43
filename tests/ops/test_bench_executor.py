"""ops/bench_executor.py's per-phase split of a graph batch's wall time (stage, launch, device
wait, finish, the Python around the call): the phases add up to the wall time, and only a graph
replay (where the executor's clock marks the phases) is split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ops"))
import bench_executor as be  # noqa: E402


def test_host_phases_split_a_graph_batch_and_add_up_to_its_wall_time() -> None:
    t = {"graph": True, "start_ns": 5_000_000, "h2d_end_ns": 5_120_000, "launch_ns": 5_170_000,
         "d2h_end_ns": 20_170_000, "done_ns": 20_230_000}
    p = be.host_phases(t, wall_ms=16.0)
    assert p == pytest.approx({"stage": 0.12, "launch": 0.05, "device_wait": 15.0, "finish": 0.06, "python": 0.77})
    assert sum(p.values()) == pytest.approx(16.0)
    assert be.host_phases({**t, "graph": False}, 16.0) is None  # eager: the nodes carry the times
    assert be.host_phases(None, 16.0) is None  # a runtime without the executor's timings
