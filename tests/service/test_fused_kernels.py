"""kernels="triton": the decoder layers with the fused Triton kernels (RMSNorm, residual add +
RMSNorm, SiLU*up, one-kernel decode attention) give Hugging Face's results, like the plain-torch
path. On a CPU the Python runtime runs the kernels through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET); on a GPU both runtimes launch the AOT cubins (tests/kernels/test_aot_launch.py,
tests/cpp_dag GPU identity)."""

from __future__ import annotations

import random

import pytest

from service.runtime.engine import execute
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def fused(request):
    m = request.getfixturevalue(request.param)
    return m, PythonRuntime(m.artifact, kernels="triton")


def test_fused_runtime_equals_hf_and_the_plain_path(fused, hf_ref) -> None:
    m, rt = fused
    assert rt.ctx.fused is not None and rt.kernels == "triton"
    rng = random.Random(3)
    reqs = [ScoreRequest(samples=tuple(hf_ref.rand_ids(rng, rng.randint(1, 7)) for _ in range(3)),
                         label_ids=hf_ref.rand_ids(rng, 4), prefix_ids=hf_ref.rand_ids(rng, 6)),
            ScoreRequest(samples=(hf_ref.rand_ids(rng, 5),), label_ids=hf_ref.rand_ids(rng, 2)),
            BeamRequest(hf_ref.rand_ids(rng, 9), 4, 3),
            BeamRequest(hf_ref.rand_ids(rng, 14), 2, 2)]
    got = execute(m.artifact, rt, reqs)
    plain = execute(m.artifact, m.runtime, reqs)
    for req, res, ref in zip(reqs, got, plain):
        if isinstance(req, ScoreRequest):
            assert isinstance(res, ScoreResult), res
            for sample, row, ref_row in zip(req.samples, res.scores, ref.scores):
                want = hf_ref.label_logprobs(m.hf, list(req.prefix_ids) + list(sample), list(req.label_ids))
                assert max(abs(a - b) for a, b in zip(row, want)) <= TOL
                assert max(abs(a - b) for a, b in zip(row, ref_row)) <= TOL
        else:
            assert isinstance(res, BeamResult), res
            want_ids, want_scores = hf_ref.beam(m.hf, list(req.prompt_ids), req.beam_width, req.new_tokens)
            assert [b.ids for b in res.beams] == want_ids == [b.ids for b in ref.beams]
            assert max(abs(b.logprob - s) for b, s in zip(res.beams, want_scores)) <= TOL


def test_bad_kernel_choices_are_refused(qwen2_tiny, monkeypatch) -> None:
    from service.runtime.cpp_runtime import CppRuntime

    with pytest.raises(ValueError, match="kernels: 'fast' is not one of aten, triton"):
        PythonRuntime(qwen2_tiny.artifact, kernels="fast")
    with pytest.raises(ValueError, match="launches the Triton kernels on CUDA only"):
        CppRuntime(qwen2_tiny.artifact, kernels="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="only under Triton's interpreter"):
        PythonRuntime(qwen2_tiny.artifact, kernels="triton")


def test_every_fused_call_is_bound_by_the_extension_too() -> None:
    """On a GPU the Python runtime's ctx.fused is the extension's TritonKernels, not JitKernels: a name
    the service calls on `fused` must be bound there as well as here. (2026-12-06: beam_state called
    fused.own_suffix_rows, which only JitKernels had; every CPU test passed, and every fused
    BeamSearch of the Python runtime failed on the GPU.)"""
    import re

    from service.runtime.fused import JitKernels
    from service.siblings import ROOT

    source = (ROOT / "cpp_dag" / "bindings.cpp").read_text()
    block = source[source.index("py::class_<TritonKernels"):]
    bound = set(re.findall(r'\.def\(\s*"(\w+)"', block))
    called = {name for path in (ROOT / "service").rglob("*.py")
              for name in re.findall(r"\bfused\.([a-z_0-9]+)\(", path.read_text())}
    assert {"beam_commit", "decode_attention_qkv", "rms_norm"} <= called  # the scan sees the calls
    assert called - bound == set(), "called on fused but not bound by cpp_dag/bindings.cpp's TritonKernels"
    jit = {name for name in dir(JitKernels()) if not name.startswith("_")}
    assert called - jit == set(), "called on fused but missing from JitKernels"
    assert jit - bound == set(), "JitKernels offers what the extension does not: the GPU path would lack it"
