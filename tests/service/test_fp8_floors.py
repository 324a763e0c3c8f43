"""FP8 where it gains (`slmrank build --fp8 mlp:ROWS,...`, issue 29's measured policy): a part given a
row floor keeps its weights in the model dtype too (NAME.full, NAME.min_rows), and each GEMM of fewer
activation rows than the floor runs on that copy; a bucket's rows are fixed, so its CUDA graph takes
one of the two. On the H200 (2026-12-05, docs/performance.md) FP8 gained on W1's batches of 7,680
token rows and lost on one request (960 rows) and on W3's beams; the floors keep the small GEMMs off
it.

On the CPU (float32; FP8 emulated as on the GPU's fallback), both runtimes, byte for byte:
- a floor above every batch's rows answers exactly as the plain build; a floor of 1 exactly as the
  build with every part in FP8; a floor between a small and a large Score batch answers the small
  one as the plain build and the large one as the FP8 build;
- the policy is recorded in the manifest, shown by ModelInfo and the build's line, checked against
  the weights by both loaders (a copy without its floor is refused), and the float64 truth of such an
  artifact uses the model-dtype copies;
- a bad ROWS is one line naming --fp8 and exit 2 (tests/service/test_fp8_artifact.py).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from cpp_dag import _core as core
from service.artifact.artifact import MANIFEST, WEIGHTS, ArtifactError, build_artifact, load_artifact
from service.artifact.manifest import write_manifest
from service.cli import main as cli_main
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.engine import execute
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest

VOCAB = 512  # tests/service/conftest.py's tiny checkpoints
PARTS = ("mlp", "attn", "head")


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def builds(request, tmp_path_factory: pytest.TempPathFactory):
    """(the checkpoint, its plain artifact, the decoder layers in FP8, every part floored at 100 rows:
    a Score batch's head has a row a sample, fewer than 100 here, so only its layers cross the floor)."""
    m = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp(f"floors_{request.param}")
    layers_fp8 = load_artifact(build_artifact(str(m.ckpt), root / "fp8", quiet=True, fp8=("mlp", "attn")))
    floored = load_artifact(build_artifact(str(m.ckpt), root / "floored", quiet=True, fp8=PARTS,
                                           fp8_min_rows={part: 100 for part in PARTS}))
    return m.ckpt, m.artifact, layers_fp8, floored


def _score(rng: random.Random, samples: int, length: int) -> ScoreRequest:
    ids = lambda n: tuple(rng.randrange(VOCAB) for _ in range(n))  # noqa: E731
    return ScoreRequest(tuple(ids(length) for _ in range(samples)), ids(2), ids(4))


def _both(art, reqs: list) -> list:
    """The requests through the Python and the C++ runtime, which must agree byte for byte."""
    cpp = CppRuntime(art)
    try:
        got = execute(art, PythonRuntime(art), reqs)
        assert execute(art, cpp, reqs) == got, "the two runtimes take the same weights at the same rows"
    finally:
        cpp.shutdown()
    return got


def _rows(art, reqs: list) -> int:
    """The token rows of the batch these Score requests form (their bucket's)."""
    from service.runtime.batch import pack_score, pick_score_bucket

    return int(pack_score(reqs, pick_score_bucket(art.buckets, reqs), art.limits.max_labels).inputs["tokens"].numel())


def test_a_floor_splits_small_batches_from_large_ones(builds) -> None:
    _, plain, layers_fp8, floored = builds
    rng = random.Random(5)
    small, large = [_score(rng, 2, 3)], [_score(rng, 12, 20)]
    assert _rows(floored, small) < 100 <= _rows(floored, large)  # the layers' rows on either side of the floor
    assert _both(floored, small) == _both(plain, small)
    assert _both(floored, large) == _both(layers_fp8, large)
    assert _both(layers_fp8, small) != _both(plain, small)  # the FP8 GEMMs do answer otherwise


@pytest.mark.parametrize("floor", [1, 1 << 20])
def test_a_floor_of_one_is_all_fp8_and_one_above_every_batch_is_the_plain_build(builds, floor: int,
                                                                                  tmp_path: Path) -> None:
    ckpt, plain, _, _ = builds
    art = load_artifact(build_artifact(str(ckpt), tmp_path / "a", quiet=True, fp8=PARTS,
                                       fp8_min_rows={p: floor for p in PARTS}))
    full_fp8 = load_artifact(build_artifact(str(ckpt), tmp_path / "fp8", quiet=True, fp8=PARTS))
    rng = random.Random(floor)
    reqs = [_score(rng, 12, 20), _score(rng, 3, 5),
            BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(9)), 6, 3), BeamRequest((1, 2, 3), 40, 2)]
    assert _both(art, reqs) == _both(full_fp8 if floor == 1 else plain, reqs)


def test_the_policy_is_recorded_shown_and_checked(builds, tmp_path: Path) -> None:
    from service.evaluate.truth import Float64Model
    from service.serving.client import info_summary
    from service.serving.model_info import model_info
    from service.serving.proto_gen import load as load_stubs

    _, plain, _, floored = builds
    assert floored.fp8 == PARTS and floored.fp8_min_rows == {"mlp": 100, "attn": 100, "head": 100}
    w = floored.load_weights(dtype=torch.bfloat16)
    cpp = core.load_artifact(str(floored.path), "cpu", "bfloat16")["weights"]
    base = plain.load_weights(dtype=torch.bfloat16)
    for weights in (w, cpp):
        assert weights["layers.1.wgu"].dtype == torch.float8_e4m3fn
        assert torch.equal(weights["layers.1.wgu.full"], base["layers.1.wgu"])  # the plain build's own bytes
        assert weights["lm_head.min_rows"].dtype == torch.int64 and weights["lm_head.min_rows"].tolist() == [100]
    info = model_info(load_stubs().pb2, "x", floored, SimpleNamespace(name="python"))
    assert dict(info.weights_fp8_min_rows) == {"mlp": 100, "attn": 100, "head": 100}
    assert "fp8 e4m3 mlp:100,attn:100,head:100" in info_summary(info)
    truth = Float64Model(floored)  # the model's own weights, not their e4m3 rounding
    assert torch.equal(truth.w["layers.0.wqkv"], plain.load_weights()["layers.0.wqkv"].double())
    assert "layers.0.wqkv.full" not in truth.w and "layers.0.wqkv.min_rows" not in truth.w

    # the manifest says other floors than the weights hold: refused
    edited = Path(shutil.copytree(floored.path, tmp_path / "edited"))
    m = msgpack.unpackb((edited / MANIFEST).read_bytes())
    m["weights"]["fp8_min_rows"] = {"mlp": 100}
    write_manifest(edited, m)
    with pytest.raises(ArtifactError, match="row floors do not match the manifest"):
        load_artifact(edited).load_weights()
    # a model-dtype copy without its floor: refused by both loaders (the C++ one unverified, past the hash)
    tensors = load_file(str(edited / WEIGHTS))
    del tensors["layers.0.wo.min_rows"]
    save_file(tensors, str(edited / WEIGHTS), metadata={"format": "slmrank-artifact"})
    with pytest.raises(ValueError, match=r"missing \['layers\.0\.wo\.min_rows'\]"):
        load_artifact(edited, verify=False).load_weights()
    with pytest.raises(ValueError, match=r"missing \[layers\.0\.wo\.min_rows\]"):
        core.load_artifact(str(edited), "cpu", None, False)


def test_the_build_line_names_the_floors(qwen2_tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["build", "--model", str(qwen2_tiny.ckpt), "--out", str(tmp_path / "a"), "--fp8", "mlp:2048,head",
                   "--quiet"])
    assert rc == 0 and "(fp8 e4m3: mlp:2048,head)" in capsys.readouterr().out
    assert load_artifact(tmp_path / "a").fp8_min_rows == {"mlp": 2048}


def _timed(*pairs: tuple[int, float, float]) -> list[dict[str, float]]:
    return [{"rows": r, "bf16_ms": b, "fp8_ms": f} for r, b, f in pairs]


def test_choose_floors_keeps_what_gains_from_where_it_gains_for_good() -> None:
    from service.artifact.fp8_measure import choose_floors

    timings = {
        "mlp": _timed((64, 1.0, 1.5), (1024, 2.0, 2.2), (2048, 4.0, 3.1), (8192, 9.0, 7.0)),  # gains from 2048
        "attn": _timed((64, 1.0, 0.9), (1024, 2.0, 2.5), (2048, 4.0, 3.0), (8192, 9.0, 8.0)),  # a lone early gain
        "head": _timed((8, 1.0, 0.8), (400, 2.0, 1.7)),  # gains at every count: always FP8
    }
    assert choose_floors(timings) == (("mlp", "attn", "head"), {"mlp": 2048, "attn": 2048})
    lost_at_the_top = {"mlp": _timed((64, 1.0, 0.5), (8192, 9.0, 9.5)), "head": []}
    assert choose_floors(lost_at_the_top) == ((), {})


def test_row_tiers_are_the_rows_each_part_runs_at(qwen2_tiny) -> None:
    from service.artifact.fp8_measure import row_tiers

    buckets = qwen2_tiny.artifact.buckets
    tiers = row_tiers(buckets)
    assert tiers["mlp"] == tiers["attn"] == sorted({b.max_tokens for b in buckets.score}
                                                   | {b.max_prompt_tokens for b in buckets.beam}
                                                   | {b.max_rows for b in buckets.beam})
    assert tiers["head"] == sorted({b.max_samples for b in buckets.score} | {b.max_requests for b in buckets.beam}
                                   | {b.max_rows for b in buckets.beam})


def test_fp8_auto_needs_a_gpu_to_time_on(qwen2_tiny, tmp_path: Path, monkeypatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without one, wherever this runs
    rc = cli_main(["build", "--model", str(qwen2_tiny.ckpt), "--out", str(tmp_path / "a"), "--fp8", "auto", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--fp8 auto times the GEMMs on a CUDA device" in err, err
    assert not (tmp_path / "a" / MANIFEST).exists()


def test_fp8_auto_builds_what_its_timings_choose_and_records_them(qwen2_tiny, tmp_path: Path, monkeypatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The build's wiring, with the GPU timer replaced by fixed timings (it runs on a GPU only:
    tests/e2e/test_fp8_gpu.py times for real): the parts and floors choose_floors picks are built,
    the timings recorded in the manifest and printed."""
    from service.artifact import fp8_measure

    timed = {"device": "test timings", "parts": {
        "mlp": _timed((64, 1.0, 1.2), (256, 2.0, 1.5)), "attn": _timed((64, 1.0, 1.2), (256, 2.0, 2.5)),
        "head": _timed((8, 1.0, 0.5))}}
    monkeypatch.setattr(fp8_measure, "measure", lambda cfg, buckets, device, progress: timed)
    rc = cli_main(["build", "--model", str(qwen2_tiny.ckpt), "--out", str(tmp_path / "a"), "--fp8", "auto", "--quiet"])
    out = capsys.readouterr().out
    art = load_artifact(tmp_path / "a")
    assert rc == 0 and art.fp8 == ("mlp", "head") and art.fp8_min_rows == {"mlp": 256}
    assert art.manifest["weights"]["fp8_measured"] == timed
    assert "(fp8 e4m3: mlp:256,head)" in out and "mlp  -> FP8 from 256 rows" in out and "attn -> bf16" in out, out
