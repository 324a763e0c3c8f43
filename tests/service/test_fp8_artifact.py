"""FP8 (e4m3) linear layers in the artifact (`slmrank build --fp8`, issue 29's CPU increment):

- the build stores the chosen GEMM weights as float8_e4m3fn with float32 per-output-channel scales
  (NAME.scale), records the policy in the manifest (weights.fp8, the nodes' precision) and keeps the
  other weights in the model dtype; both loaders keep the e4m3 weights and scales as stored under any
  compute dtype, and refuse weights that do not match the recorded policy (a malformed weights.fp8:
  tests/service/test_manifest.py);
- bad --fp8 values are one line naming the flag and exit 2;
- `slmrank evaluate` of an fp8 candidate against its float32 baseline runs, reports finite deltas,
  and a far-too-tight tolerance rejects it (exit 1); ModelInfo / `client info` show the policy;
- the float64 truth of an fp8 artifact dequantizes its weights exactly.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch

from cpp_dag import _core as core
from service.artifact.artifact import MANIFEST, build_artifact, load_artifact
from service.artifact.manifest import write_manifest
from service.cli import main as cli_main
from service.model.checkpoint import fp8_weight_names

VOCAB = 512  # tests/service/conftest.py's tiny checkpoints
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def fp8_art(qwen2_tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 (tied embeddings) with every part in e4m3."""
    return build_artifact(str(qwen2_tiny.ckpt), tmp_path_factory.mktemp("fp8") / "art", quiet=True,
                          fp8=("head", "mlp", "attn"))  # any order: recorded in FP8_PARTS' order


def test_the_build_stores_e4m3_weights_with_scales_and_records_the_policy(fp8_art: Path) -> None:
    art = load_artifact(fp8_art)
    assert art.fp8 == ("mlp", "attn", "head") and art.manifest["weights"]["fp8"] == ["mlp", "attn", "head"]
    assert art.manifest["weights"]["dtype"] == "float32" and art.weight_dtype == torch.float32
    layer = next(n for n in art.score_dag if n.type == "decoder_layer")
    head = next(n for n in art.beam_dag if n.type == "lm_head")
    assert layer.attrs["precision"] == "fp8:mlp,attn" and head.attrs["precision"] == "fp8:head"
    quantized = fp8_weight_names(art.config, art.fp8)
    assert "layers.1.wdown" in quantized and "lm_head" in quantized  # the tied head: its own e4m3 table
    for dtype in (None, torch.bfloat16):
        w = art.load_weights(dtype=dtype)
        cpp = core.load_artifact(str(fp8_art), "cpu", None if dtype is None else "bfloat16")["weights"]
        for weights in (w, cpp):
            for name in quantized:
                assert weights[name].dtype == E4M3 and weights[name + ".scale"].dtype == torch.float32
                assert (weights[name + ".scale"] > 0).all()
            assert weights["embed"].dtype == (dtype or torch.float32)  # the lookup's table stays in the model dtype
            assert weights["layers.0.attn_norm"].dtype == (dtype or torch.float32)


def test_e4m3_weights_are_the_baselines_quantized(fp8_art: Path, qwen2_tiny) -> None:
    base = qwen2_tiny.artifact.load_weights()
    w = load_artifact(fp8_art).load_weights()
    for name, src in (("layers.0.wgu", "layers.0.wgu"), ("layers.1.wqkv", "layers.1.wqkv"), ("lm_head", "embed")):
        back = w[name].double() * w[name + ".scale"].double().unsqueeze(1)
        ref = base[src].double()
        assert ((back - ref).abs() <= ref.abs().amax(1, keepdim=True) / 28 * 1.000001).all(), name
        assert not torch.equal(back, ref)


def _edited(src: Path, dst: Path, **weights_fields) -> Path:
    art = Path(shutil.copytree(src, dst))
    m = msgpack.unpackb((art / MANIFEST).read_bytes())
    m["weights"].update(weights_fields)
    write_manifest(art, m)
    return art


def test_weights_that_do_not_match_the_recorded_policy_are_refused_by_both_loaders(fp8_art: Path,
                                                                                  tmp_path: Path) -> None:
    art = _edited(fp8_art, tmp_path / "none", fp8=["mlp"])  # the file also has e4m3 attention weights
    with pytest.raises(ValueError, match=r"layers\.0\.wo: shape|unexpected \['layers\.0\.wo\.scale'"):
        load_artifact(art).load_weights()
    with pytest.raises(ValueError, match="unexpected .*wo.scale"):
        core.load_artifact(str(art), "cpu", None, False)


@pytest.mark.parametrize("value", ["mlp,bogus", "fp16", "mlp,mlp", "", "MLP", "mlp:0", "mlp:abc", "head:-3", "attn:"])
def test_a_bad_fp8_flag_is_one_line_naming_it_and_exit_2(value: str, qwen2_tiny, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["build", "--model", str(qwen2_tiny.ckpt), "--out", str(tmp_path / "x"), "--fp8", value, "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("slmrank build: error: --fp8 "), err
    assert not (tmp_path / "x" / MANIFEST).exists()


def _requests(path: Path) -> Path:
    rng = random.Random(29)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    lines = [{"id": f"s{i}", "kind": "score", "prefix_ids": ids(10), "samples": [ids(rng.randrange(2, 6)) for _ in range(12)],
              "label_ids": ids(2)} for i in range(5)]
    lines += [{"id": f"b{i}", "kind": "beam", "prompt_ids": ids(8), "beam_width": w, "new_tokens": 3}
              for i, w in enumerate((1, 4, 8))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_evaluate_an_fp8_candidate_against_its_float32_baseline(qwen2_tiny, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    cand = tmp_path / "fp8"
    assert cli_main(["build", "--model", str(qwen2_tiny.ckpt), "--out", str(cand), "--fp8", "mlp,attn", "--quiet"]) == 0
    assert "(fp8 e4m3: mlp,attn)" in capsys.readouterr().out
    req = _requests(tmp_path / "requests.jsonl")
    common = ["evaluate", "--baseline", str(qwen2_tiny.artifact.path), "--candidate", str(cand), "--requests", str(req),
              "--quiet", "--no-record"]
    rc = cli_main([*common, "--out", str(tmp_path / "report.json")])
    out = capsys.readouterr().out
    assert rc in (0, 1), out
    m = json.loads((tmp_path / "report.json").read_text())["metrics"]["candidate_vs_baseline"]
    assert m["answers.mismatched"] == 0 and (m["score.requests"], m["beam.requests"]) == (5, 3)
    for key in ("score.abs_logprob_max", "score.abs_logprob_p99", "score.kendall_tau_mean", "beam.overlap_mean",
                "beam.best_logprob_delta_max"):
        assert isinstance(m[key], float) and math.isfinite(m[key]), (key, m[key])
    assert 0 < m["score.abs_logprob_max"] < 5  # changed by the quantization, not broken by it
    assert "fp8 mlp,attn" in out  # the candidate's line says what it is
    rc = cli_main([*common, "--max-abs-logprob", "1e-9"])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip().splitlines()[-1].startswith("REJECTED: max_abs_logprob"), out


def test_model_info_shows_the_fp8_policy(fp8_art: Path) -> None:
    from service.serving.client import info_summary
    from service.serving.proto_gen import load as load_stubs
    from service.serving.model_info import model_info

    pb2 = load_stubs().pb2
    art = load_artifact(fp8_art)
    info = model_info(pb2, "x", art, SimpleNamespace(name="python"))
    assert list(info.weights_fp8) == ["mlp", "attn", "head"]
    assert "fp8 e4m3 mlp,attn,head" in info_summary(info)


def test_the_float64_truth_of_an_fp8_artifact_dequantizes_exactly(fp8_art: Path) -> None:
    from service.evaluate.truth import Float64Model

    art = load_artifact(fp8_art)
    model = Float64Model(art)
    w = art.load_weights()
    assert model.w["layers.0.wgu"].dtype == torch.float64 and "layers.0.wgu.scale" not in model.w
    assert torch.equal(model.w["layers.0.wgu"], w["layers.0.wgu"].double() * w["layers.0.wgu.scale"].double()[:, None])
    assert torch.equal(model.head, model.w["lm_head"])  # the tied head's own e4m3 table, dequantized
