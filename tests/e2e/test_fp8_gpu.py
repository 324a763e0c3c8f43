"""FP8 (e4m3) builds on the GPU (issue 29): `slmrank build --fp8 mlp,attn,head` of both embedded
model shapes run in bfloat16 on the fast path (kernels="triton", CUDA graphs in the C++ runtime) take
torch._scaled_mm for every quantized linear, and

- the Python runtime and the C++ one (CUDA graphs) give byte-identical answers (the same ATen and
  Triton calls, in the same order);
- quantizing the activations inside the kernels that produce them (the norms, SiLU*up, the
  one-kernel quantizer) changes no byte against quantize_rows' ATen ops on the same path;
- the answers are finite, move off the bf16 build's (the e4m3 GEMMs really ran), and stay near them:
  Score log-probs within 1.0, the best beam's log-prob within 1.0 a token (random weights, whose
  near-flat distributions reorder beams at any rounding: a bound that catches a missing scale, which
  puts logits off by up to 448x, not a quality claim; `slmrank evaluate` with float64 truth measures
  the quality: ops/bench/fp8_policies.py).

- a build with row floors (`--fp8 mlp:512,attn:512`) answers a batch below the floor as the bf16
  build and one above it as the FP8 build, byte for byte, in CUDA graphs;
- `--fp8 auto` times every part at its buckets' rows and builds what its timings choose.

Marked gpu and slow (builds eight 0.5B artifacts)."""

from __future__ import annotations

import random

import pytest
import torch

from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult
from tests.e2e.test_float32_accuracy import run_both_runtimes

# tens of GB of GPU memory a worker: under --dist loadgroup two such groups share a GPU, not eight workers
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu-memory-b")]
VOCAB = 151936


@pytest.fixture(scope="module", params=["embedded:qwen2.5-0.5b", "embedded:qwen3-0.6b"])
def pair(request, tmp_path_factory: pytest.TempPathFactory):
    from service.artifact.artifact import build_artifact, load_artifact

    root = tmp_path_factory.mktemp("fp8gpu")
    base = load_artifact(build_artifact(request.param, root / "bf16", quiet=True))
    fp8 = load_artifact(build_artifact(request.param, root / "fp8", quiet=True, fp8=("mlp", "attn", "head")))
    return base, fp8


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def test_fp8_runtimes_identical_in_graphs_and_near_bf16(pair) -> None:
    base, fp8 = pair
    rng = random.Random(29)
    labels = _ids(rng, 4)
    reqs = [ScoreRequest(tuple(_ids(rng, 48) for _ in range(15)), labels, _ids(rng, 32)),
            ScoreRequest(tuple(_ids(rng, rng.randint(3, 30)) for _ in range(6)), labels),
            BeamRequest(_ids(rng, 128), 100, 5),
            BeamRequest(_ids(rng, 40), 16, 3)]
    got = run_both_runtimes(fp8, reqs, dtype=torch.bfloat16)  # asserts the runtimes agree byte for byte
    ref = run_both_runtimes(base, reqs, dtype=torch.bfloat16)
    moved = False
    for req, a, b in zip(reqs, got, ref):
        if isinstance(req, ScoreRequest):
            assert isinstance(a, ScoreResult) and isinstance(b, ScoreResult), (a, b)
            x, y = torch.tensor(a.scores, dtype=torch.float64), torch.tensor(b.scores, dtype=torch.float64)
            assert torch.isfinite(x).all()
            delta = float((x - y).abs().max())
            assert delta < 1.0, delta
            moved |= delta > 0
        else:
            assert isinstance(a, BeamResult) and isinstance(b, BeamResult), (a, b)
            assert len(a.beams) == req.beam_width
            scores = [bm.logprob for bm in a.beams]
            assert all(s > -1e9 for s in scores) and scores == sorted(scores, reverse=True)
            # the best beam's log-prob near bf16's (random weights: which beams win may differ a lot)
            assert abs(a.beams[0].logprob - b.beams[0].logprob) < 1.0 * len(a.beams[0].ids)
            moved |= [bm.ids for bm in a.beams] != [bm.ids for bm in b.beams] or a.beams[0].logprob != b.beams[0].logprob
    assert moved, "the fp8 build answered exactly as the bf16 one: its e4m3 GEMMs did not run"


def test_fp8_weights_take_scaled_mm(pair) -> None:
    """Every quantized linear of the fp8 build meets uses_scaled_mm's conditions on the GPU in bf16
    (K and N multiples of 16), so none silently falls back to the float32 emulation."""
    from kernels.fp8_linear import uses_scaled_mm
    from service.model.checkpoint import fp8_weight_names

    _, fp8 = pair
    weights = fp8.load_weights(dtype=torch.bfloat16)
    names = fp8_weight_names(fp8.config, fp8.fp8)
    assert names
    for name in names:
        w = weights[name]
        assert w.dtype == torch.float8_e4m3fn, name
        probe = torch.zeros(1, w.shape[1], dtype=torch.bfloat16, device="cuda")
        assert uses_scaled_mm(probe, w), (name, tuple(w.shape))


def test_quantizing_in_the_kernels_changes_no_byte(pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a mismatch it names the first e4m3 GEMM whose input differs between the two ways (its
    call number, weight shape, rows whose bytes or scales differ), not just the answers."""
    from service.model import layers
    from service.runtime import nodes
    from service.runtime.engine import execute
    from service.runtime.python_runtime import PythonRuntime

    _, fp8 = pair
    rng = random.Random(30)
    reqs = [ScoreRequest(tuple(_ids(rng, 24) for _ in range(9)), _ids(rng, 3), _ids(rng, 16)),
            BeamRequest(_ids(rng, 64), 32, 4)]
    decided, calls = [], []

    def spy(*args):
        decided.append(real(*args))
        return decided[-1]

    def recording(a_q, s_a, w_q, *rest):  # every e4m3 GEMM's input, whichever way it was quantized
        calls[-1].append((a_q.view(torch.uint8).clone(), s_a.reshape(-1).clone(), tuple(w_q.shape)))
        return real_scaled(a_q, s_a, w_q, *rest)

    real, real_scaled = layers.fp8_in_kernel, layers.scaled_linear
    fp8_module = layers._fp8
    monkeypatch.setattr(layers, "scaled_linear", recording)
    monkeypatch.setattr(fp8_module, "scaled_linear", recording)
    monkeypatch.setattr(layers, "fp8_in_kernel", spy)
    monkeypatch.setattr(nodes, "fp8_in_kernel", spy)
    calls.append([])
    in_kernels = execute(fp8, PythonRuntime(fp8, device="cuda", dtype=torch.bfloat16, kernels="triton"), reqs)
    assert decided and all(decided), "every e4m3 GEMM of this build is fed by a quantizing kernel"
    monkeypatch.setattr(layers, "fp8_in_kernel", lambda *args: False)
    monkeypatch.setattr(nodes, "fp8_in_kernel", lambda *args: False)
    calls.append([])
    by_aten_ops = execute(fp8, PythonRuntime(fp8, device="cuda", dtype=torch.bfloat16, kernels="triton"), reqs)
    assert len(calls[0]) == len(calls[1]) > 0
    for i, ((qa, sa, wa), (qb, sb, wb)) in enumerate(zip(*calls)):
        assert wa == wb and qa.shape == qb.shape, (i, wa, wb, qa.shape, qb.shape)
        rows_q = (qa != qb).any(-1).nonzero().flatten().tolist()
        rows_s = (sa != sb).nonzero().flatten().tolist()
        assert not rows_q and not rows_s, (
            f"e4m3 GEMM call {i} of {len(calls[0])} (weight {wa}, input {tuple(qa.shape)}): the rows whose bytes "
            f"differ {rows_q[:12]} ({len(rows_q)}), whose scales differ {rows_s[:12]} ({len(rows_s)}); scales "
            f"{sa[rows_s[:4]].tolist()} in the kernels, {sb[rows_s[:4]].tolist()} by the ATen ops")
    assert in_kernels == by_aten_ops


@pytest.fixture(scope="module")
def floored(tmp_path_factory: pytest.TempPathFactory):
    """qwen3-0.6b built three ways: plain, its layers in FP8, its layers in FP8 from 512 rows up."""
    from service.artifact.artifact import build_artifact, load_artifact

    root = tmp_path_factory.mktemp("fp8floors")
    build = lambda name, **kw: load_artifact(build_artifact("embedded:qwen3-0.6b", root / name, quiet=True, **kw))
    return (build("bf16"), build("layers", fp8=("mlp", "attn")),
            build("floored", fp8=("mlp", "attn"), fp8_min_rows={"mlp": 512, "attn": 512}))


def test_row_floors_in_graphs_answer_as_the_build_each_batch_takes(floored) -> None:
    """In CUDA graphs on the fused path: a Score batch below the floor answers byte for byte as the
    bf16 build, one above it as the build with the layers always in FP8; the runtimes agree."""
    plain, layers, floors = floored
    rng = random.Random(31)
    labels = _ids(rng, 3)
    small = [ScoreRequest(tuple(_ids(rng, 12) for _ in range(4)), labels)]  # a bucket of < 512 token rows
    large = [ScoreRequest(tuple(_ids(rng, 64) for _ in range(15)), labels, _ids(rng, 32)) for _ in range(2)]
    answers = lambda art, reqs: run_both_runtimes(art, reqs, dtype=torch.bfloat16)  # noqa: E731
    assert answers(floors, small) == answers(plain, small)
    got = answers(floors, large)
    assert got == answers(layers, large)
    assert got != answers(plain, large)  # the e4m3 GEMMs ran


def test_fp8_auto_times_every_part_at_the_buckets_rows(tmp_path) -> None:
    """`slmrank build --fp8 auto` on the GPU: every part timed at each row count its GEMMs run at,
    the build being what choose_floors makes of the timings, and its answers equal in both runtimes."""
    from service.artifact.artifact import build_artifact, load_artifact
    from service.artifact.fp8_measure import choose_floors, row_tiers

    art = load_artifact(build_artifact("embedded:qwen3-0.6b", tmp_path / "auto", quiet=True, fp8_auto=True))
    measured = art.manifest["weights"]["fp8_measured"]
    tiers = row_tiers(art.buckets)
    assert {part: [r["rows"] for r in rows] for part, rows in measured["parts"].items()} == tiers
    assert all(r["bf16_ms"] > 0 and r["fp8_ms"] > 0 for rows in measured["parts"].values() for r in rows)
    assert (art.fp8, art.fp8_min_rows) == choose_floors(measured["parts"])
    rng = random.Random(32)
    labels = _ids(rng, 3)
    run_both_runtimes(art, [ScoreRequest(tuple(_ids(rng, 64) for _ in range(15)), labels, _ids(rng, 32)),
                            ScoreRequest(tuple(_ids(rng, 12) for _ in range(4)), labels),
                            BeamRequest(_ids(rng, 128), 100, 5)], dtype=torch.bfloat16)
