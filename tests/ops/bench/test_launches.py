"""ops/bench/launches.py on the CPU: the launches a fused BeamSearch batch dispatches, node by node.
A prefill layer is 4 GEMMs and 5 Triton kernels, a decode step's 4 GEMMs and 4 (its q/k RoPE inside the
attention kernel); a beam step is its 6 Triton kernels (the merge a round of them here) and the suffix
gather (the bookkeeping is one kernel, beam_commit)."""

from __future__ import annotations

import os

import pytest
import torch

from ops.bench import launches

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts through Triton's interpreter (the CPU test run)")


def test_views_and_allocations_make_no_kernel() -> None:
    a = torch.zeros(4, 3)
    with launches.Counter() as c:
        a.view(12).unsqueeze(0).t()
        torch.empty(5)
        a.reshape(3, 4)  # contiguous: a view
        a.t().reshape(12)  # not: a copy
        a.add_(1)
    assert dict(c.aten) == {"clone": 1, "add_": 1}


def test_a_fused_beam_batch_dispatches_8_a_decode_layer_and_6_a_beam_step() -> None:
    result = launches.count("embedded:tiny", "beam,prompt=6,beam=4,new=3", 2)
    layers = [n for n in result["nodes"] if n["type"] == "decoder_layer"]
    assert len(layers) == 3 * result["layers"]
    for n in layers:
        assert sum(n["aten"].values()) == 4 and sum(n["triton"].values()) == (5 if n["step"] == 0 else 4), n
        assert ("qkv_rope_kernel" in n["triton"]) == (n["step"] == 0)
    steps = [n for n in result["nodes"] if n["type"] == "beam_step"]
    assert [n["step"] for n in steps] == [1, 2]
    for n in steps:
        # the merge: one round of beam_merge_kernel for 2 requests' 4 x 4 keys
        assert n["triton"] == {"beam_stats_kernel": 1, "beam_threshold_kernel": 1, "beam_collect_kernel": 1,
                               "beam_select_kernel": 1, "beam_merge_kernel": 1, "beam_commit_kernel": 1}
    # no ATen op: the suffix K/V is not gathered (beam_commit hands on each row's suffix_rows)
    assert steps[0]["aten"] == {} and steps[1]["aten"] == {}
    text = "\n".join(launches.table(result))
    assert "| beam_step |  | 0 + 6 | 0 + 6 |" in text
