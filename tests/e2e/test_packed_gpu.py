"""On the GPU at real shapes (issue 26): a request's answer packed into one batch with requests of other
shapes against its answer alone, on the C++ runtime in CUDA graphs with the Triton kernels, the
serving path. Score requests of 3-12 samples of 8-100 tokens, half with a 32-256-token prefix;
BeamSearch requests of widths 20-150 and prompts 32-480, packed by their own widths.

On the CPU the two are equal byte for byte (tests/service/test_batching.py). On the GPU they need
not be: packed, a row's attention walks its keys in blocks that start where its tile's union of
ranges starts, and cuBLAS may choose another kernel for another number of rows. Asserted: the same
beams, and float32 log-probs within 1e-5 (Score) and 1e-4 (beams); bfloat16 within what its own
rounding gives (the beams' ids may differ at a near tie: counted, at most one in ten). Whether the
bytes are the same is printed (`-s`), one line per model and dtype, for the docs. Marked gpu and slow."""

from __future__ import annotations

import random

import pytest
import torch

from service.runtime.engine import execute, plan_batches
from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult

# tens of GB of GPU memory a worker: under --dist loadgroup two such groups share a GPU, not eight workers
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu-memory-b")]
VOCAB = 151936
# |packed - alone| allowed: float32 as the CPU's batching tests, bfloat16 a few of its ulps at |log p| ~ 12
SCORE_TOL = {torch.float32: 1e-5, torch.bfloat16: 0.25}
BEAM_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


def _score_requests(rng: random.Random) -> list[ScoreRequest]:
    return [ScoreRequest(samples=tuple(_ids(rng, rng.randint(8, 100)) for _ in range(rng.randint(3, 12))),
                         label_ids=(1000, 2000), prefix_ids=_ids(rng, rng.randint(32, 256)) if i % 2 else (),
                         id=f"s{i}")
            for i in range(4)]


def _beam_requests(rng: random.Random) -> list[BeamRequest]:
    return [BeamRequest(_ids(rng, prompt), width, 3, id=f"b{i}")
            for i, (width, prompt) in enumerate([(20, 480), (60, 32), (100, 200), (150, 128)])]


@pytest.fixture(scope="module", params=["embedded:qwen2.5-0.5b", "embedded:qwen3-0.6b"])
def art(request, tmp_path_factory: pytest.TempPathFactory):
    from service.artifact.artifact import build_artifact, load_artifact

    return load_artifact(build_artifact(request.param, tmp_path_factory.mktemp("packed_gpu") / "art", quiet=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_packed_answers_equal_alone_on_the_gpu(art, dtype: torch.dtype):
    from service.runtime.cpp_runtime import CppRuntime

    rng = random.Random(26)
    scores, beams = _score_requests(rng), _beam_requests(rng)
    assert len(plan_batches(art, scores)) == 1 and len(plan_batches(art, beams)) == 1, "meant as one batch a kind"
    cpp = CppRuntime(art, device="cuda", dtype=dtype, use_graphs=True, kernels="triton")
    try:
        alone = [execute(art, cpp, [r])[0] for r in scores + beams]
        packed = execute(art, cpp, scores) + execute(art, cpp, beams)
    finally:
        cpp.shutdown()

    score_diff, score_bitwise = 0.0, True
    beam_diff, beam_bitwise, beams_differing, beams_total = 0.0, True, 0, 0
    for got, want in zip(packed, alone):
        if isinstance(want, ScoreResult):
            assert isinstance(got, ScoreResult) and [len(r) for r in got.scores] == [len(r) for r in want.scores]
            score_bitwise &= got.scores == want.scores
            score_diff = max([score_diff] + [abs(a - b) for ra, rb in zip(got.scores, want.scores)
                                             for a, b in zip(ra, rb)])
        else:
            assert isinstance(want, BeamResult) and isinstance(got, BeamResult) and len(got.beams) == len(want.beams)
            beam_bitwise &= got.beams == want.beams
            wanted = {tuple(b.ids): b.logprob for b in want.beams}
            beams_total += len(want.beams)
            beams_differing += sum(tuple(b.ids) not in wanted for b in got.beams)
            beam_diff = max([beam_diff] + [abs(b.logprob - wanted[tuple(b.ids)]) for b in got.beams
                                           if tuple(b.ids) in wanted])
    name = f"{art.config.arch} {str(dtype).removeprefix('torch.')}"
    print(f"\n[packed-vs-alone] {name}: Score bitwise {score_bitwise}, max |diff| {score_diff:.3g}; "
          f"BeamSearch bitwise {beam_bitwise}, beams not in the request's answer alone {beams_differing} of "
          f"{beams_total}, max |diff| of the shared ones {beam_diff:.3g}")
    assert score_diff <= SCORE_TOL[dtype], f"{name}: a Score packed moved by {score_diff}"
    assert beam_diff <= BEAM_TOL[dtype], f"{name}: a beam's log-prob packed moved by {beam_diff}"
    if dtype == torch.float32:
        assert beams_differing == 0, f"{name}: {beams_differing} beams differ packed from alone"
    else:
        assert beams_differing <= beams_total // 10, f"{name}: {beams_differing} of {beams_total} beams differ"
