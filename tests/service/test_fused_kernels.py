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


def _bound_methods() -> dict[str, list[str]]:
    """cpp_dag/bindings.cpp's TritonKernels: each bound method's py::arg names, in order."""
    import re

    from service.siblings import ROOT

    source = (ROOT / "cpp_dag" / "bindings.cpp").read_text()
    block = source[source.index("py::class_<TritonKernels"):]
    return {m.group(1): re.findall(r'py::arg\("(\w+)"\)', part)
            for part in re.split(r"\n\s*\.def\(", block)[1:] if (m := re.match(r'\s*"(\w+)"', part))}


def _fused_calls() -> list[tuple[str, str, int | None, list[str]]]:
    """Every call `<...>fused.NAME(...)` in service/: (where, NAME, positional count or None with *args,
    keyword names)."""
    import ast

    from service.siblings import ROOT

    calls = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if (owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")) == "fused":
                    starred = any(isinstance(a, ast.Starred) for a in node.args)
                    calls.append((f"{path.name}:{node.lineno}", node.func.attr, None if starred else len(node.args),
                                  [k.arg for k in node.keywords]))
    return calls


def test_every_fused_call_is_bound_by_the_extension_too() -> None:
    """On a GPU the Python runtime's ctx.fused is the extension's TritonKernels, not JitKernels: a call
    the service makes on `fused` must be bound there, with its keywords, as well as here, and each
    method's parameters must come in the same order in both (a JitKernels-only parameter, such as a
    tile, has a default and is never passed). (2026-12-06: beam_state called fused.own_suffix_rows,
    which only JitKernels had; every CPU test passed, and every fused BeamSearch of the Python
    runtime failed on the GPU.)"""
    import inspect

    from service.runtime.fused import JitKernels

    bound, jit = _bound_methods(), JitKernels()
    calls = _fused_calls()
    assert {"beam_commit", "decode_attention_qkv", "rms_norm"} <= {name for _, name, _, _ in calls}  # the scan sees them
    for where, name, positional, keywords in calls:
        assert name in bound, f"{where}: fused.{name} is not bound by cpp_dag/bindings.cpp's TritonKernels"
        assert hasattr(jit, name), f"{where}: fused.{name} is missing from JitKernels"
        assert set(keywords) <= set(bound[name]), f"{where}: fused.{name}: keywords {keywords} not all bound"
        assert positional is None or positional + len(keywords) <= len(bound[name]), where
    public = {n for n in dir(jit) if not n.startswith("_")}
    assert public - set(bound) == set(), "JitKernels offers what the extension does not: the GPU path would lack it"
    for name in public:
        params = inspect.signature(getattr(jit, name)).parameters
        extra = [n for n in params if n not in bound[name]]
        assert all(params[n].default is not inspect.Parameter.empty for n in extra), (name, extra)
        assert [n for n in params if n in bound[name]] == bound[name], (name, list(params), bound[name])
