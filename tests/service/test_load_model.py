"""load_model: the runtime's graphs are captured before SERVING unless the server asked for lazy capture."""

from __future__ import annotations

import pytest

from service.runtime import factory
from service.serving.server import load_model


class _RecordingRuntime:
    """Wraps the real Python runtime and records capture() calls (CppRuntime's start-up hook)."""

    def __init__(self, inner) -> None:
        self.inner, self.captures, self.lanes_at_once = inner, 0, []

    def capture(self, quiet: bool = True, lanes_at_once: bool = False) -> list:
        self.captures += 1
        self.lanes_at_once.append(lanes_at_once)
        return []


@pytest.mark.parametrize("capture_graphs, at_once, expected", [(True, False, [False]), (True, True, [True]),
                                                               (False, True, [])])
def test_capture_at_start_up_only_when_asked(qwen2_tiny, monkeypatch, capture_graphs, at_once, expected):
    real_make_runtime = factory.make_runtime
    made: list[_RecordingRuntime] = []

    def make_runtime(name, artifact, device, dtype, kernels="aten", num_lanes=0, catalog_headroom=1.0,
                     beam_graphs="bucket"):
        made.append(_RecordingRuntime(real_make_runtime(name, artifact, device, dtype, kernels, num_lanes,
                                                        catalog_headroom)))
        return made[-1]

    monkeypatch.setattr(factory, "make_runtime", make_runtime)
    model = load_model(str(qwen2_tiny.artifact.path), "python", capture_graphs=capture_graphs,
                       capture_lanes_at_once=at_once)
    assert model.runtime is made[0]
    assert made[0].lanes_at_once == expected and made[0].captures == len(expected)
    assert model.tokenizer.vocab_size > 0


@pytest.mark.parametrize("device, capability, expected", [("cpu", None, "aten"), ("cuda", (9, 0), "triton"),
                                                           ("cuda:0", (9, 0), "triton"), ("cuda", (8, 0), "aten")])
def test_auto_kernels_are_the_fused_ones_on_hopper_only(monkeypatch, device, capability, expected) -> None:
    import torch

    from service.runtime.fused import resolve_kernels

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    assert resolve_kernels("auto", device) == expected
    assert resolve_kernels("aten", device) == "aten" and resolve_kernels("triton", device) == "triton"
    with pytest.raises(ValueError, match="kernels"):
        resolve_kernels("cuda-graphs", device)
