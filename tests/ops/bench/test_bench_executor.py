"""ops/bench/bench_executor.py's per-phase split of a graph batch's wall time (stage, launch, device
wait, finish, the Python around the call): the phases add up to the wall time, and only a graph
replay (where the executor's clock marks the phases) is split."""

from __future__ import annotations

import dataclasses

import pytest

from ops.bench import bench_executor as be
from service.runtime.timings import BatchTimings


def test_host_phases_split_a_graph_batch_and_add_up_to_its_wall_time() -> None:
    t = BatchTimings(submit_ns=5_000_000, start_ns=5_000_000, h2d_end_ns=5_120_000, launch_ns=5_170_000,
                     d2h_end_ns=20_170_000, done_ns=20_230_000, graph=True, nodes=())
    p = be.host_phases(t, wall_ms=16.0)
    assert p == pytest.approx({"stage": 0.12, "launch": 0.05, "device_wait": 15.0, "finish": 0.06, "python": 0.77})
    assert sum(p.values()) == pytest.approx(16.0)
    assert be.host_phases(dataclasses.replace(t, graph=False), 16.0) is None  # eager: the nodes carry the times
    assert be.host_phases(None, 16.0) is None  # a runtime without the executor's timings


def test_kernel_profile_ranks_one_batchs_ops_by_their_own_time(tmp_path) -> None:
    """On the CPU the profile's rows are ATen ops (on the GPU, kernels): counted, ranked by their
    own time, with their shares of the sum; the CPU run has no graph, so its nodes' host time stands
    in for the graph's device time."""
    import torch

    from service.artifact.artifact import build_artifact, load_artifact

    art = load_artifact(build_artifact("embedded:tiny", tmp_path / "art", quiet=True))
    be.WORKLOAD_MODELS["T"] = ("tiny", 2)
    real_workload = be.workload
    be.workload = lambda name, g: (be.BeamRequest(prompt_ids=be.ids(g, 12), beam_width=4, new_tokens=3)
                                   if name == "T" else real_workload(name, g))
    try:
        r = be.kernel_profile({"tiny": art}, torch.Generator().manual_seed(1), [("T", 2)], "aten", device="cpu")
    finally:
        be.workload = real_workload
        del be.WORKLOAD_MODELS["T"]
    p = r["T/x2/aten"]
    assert p["bucket"].startswith("beam.") and p["launches"] >= 10 and p["kernel_ms"] > 0
    times = [row[2] for row in p["top"]]
    assert times == sorted(times, reverse=True) and all(row[0].startswith("aten::") for row in p["top"])
    assert 0 < sum(row[3] for row in p["top"]) <= 1.0 + 1e-6
    assert any(row[0] in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm") for row in p["top"])
    assert p["graph_ms"] > 0 and p["wall_ms_p50"] > 0 and p["phases_ms"] == {}
