"""`slmrank evaluate` end to end on the CPU, over the tiny Qwen2 checkpoint's artifact (vocabulary
512: seconds a run): identical artifacts pass with zero deltas; a candidate with one weight tensor
perturbed (a valid artifact, every hash right) is rejected with exit 1, the exceeded tolerances
named; tolerances from a file and flags; the float64 truth beside both sides; the result recorded
in the candidate (both loaders load it) and shown by ModelInfo and `slmrank client info`; bad
flags are one line and exit 2."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from cpp_dag import _core as core
from service.artifact.artifact import FORMAT, MANIFEST, WEIGHTS, build_artifact, load_artifact, sha256_file
from service.artifact.manifest import write_manifest
from service.cli import main as cli_main

VOCAB = 512  # tests/service/conftest.py's tiny checkpoints


def request_lines(seed: int = 5) -> list[dict[str, Any]]:
    """Score requests of 15 samples after a prefix (2 labels), one without a prefix (3 labels),
    BeamSearch of widths 1-16, and a line both sides refuse (beam_width 0)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    lines: list[dict[str, Any]] = [
        {"id": f"s{i}", "kind": "score", "prefix_ids": ids(12),
         "samples": [ids(rng.randrange(2, 7)) for _ in range(15)], "label_ids": ids(2)} for i in range(6)]
    lines.append({"id": "s-plain", "kind": "score", "samples": [ids(3), ids(5), ids(2), ids(4)], "label_ids": ids(3)})
    lines += [{"id": f"b{i}", "kind": "beam", "prompt_ids": ids(rng.randrange(3, 12)), "beam_width": w, "new_tokens": 3}
              for i, w in enumerate((1, 4, 8, 16))]
    lines.append({"id": "bad", "kind": "beam", "prompt_ids": ids(3), "beam_width": 0, "new_tokens": 2})
    return lines


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("evaluate") / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in request_lines()))
    return path


@pytest.fixture(scope="module")
def baseline(qwen2_tiny) -> Path:
    return qwen2_tiny.artifact.path


def copy_artifact(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def damage(art: Path, tensor: str, scale: float, seed: int = 0) -> None:
    """Adds Gaussian noise (scale x the tensor's std) to one weight tensor and writes the artifact
    back valid: the weights file, its sha256 in the manifest, the manifest's digest."""
    weights = load_file(str(art / WEIGHTS))
    t = weights[tensor]
    g = torch.Generator().manual_seed(seed)
    weights[tensor] = (t + scale * t.float().std() * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(weights, str(art / WEIGHTS), metadata={"format": FORMAT})
    m = msgpack.unpackb((art / MANIFEST).read_bytes())
    m["weights"]["sha256"] = sha256_file(art / WEIGHTS)
    write_manifest(art, m)
    load_artifact(art)  # a valid artifact: every hash right


def evaluate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli_main(["evaluate", *args, "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_identical_artifacts_pass_with_zero_deltas(baseline: Path, requests_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cand = copy_artifact(baseline, tmp_path / "cand")
    before = sha256_file(cand / MANIFEST)
    rc, out, _ = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(cand), "--requests",
                          str(requests_file), "--out", str(tmp_path / "report.json"))
    assert rc == 0, out
    assert "ACCEPTED: 9 checks hold" in out
    report = json.loads((tmp_path / "report.json").read_text())
    m = report["metrics"]["candidate_vs_baseline"]
    assert m["answers.mismatched"] == 0 and m["answers.refused_by_both"] == 1
    assert (m["score.requests"], m["beam.requests"]) == (7, 4)
    assert m["score.values"] == 6 * 15 * 2 + 4 * 3
    assert m["score.abs_logprob_max"] == 0.0 and m["score.abs_logprob_p99"] == 0.0
    assert m["score.kendall_tau_mean"] == m["score.kendall_tau_min"] == 1.0
    assert m["score.top1_agreement"] == m["score.top3_agreement"] == 1.0
    assert m["beam.overlap_mean"] == m["beam.overlap_min"] == m["beam.top1_agreement"] == 1.0
    assert m["beam.best_logprob_delta_max"] == m["beam.shared_logprob_delta_max"] == 0.0
    assert report["passed"] and all(c["passed"] for c in report["checks"])
    assert len(report["per_request"]) == 11 and {r["id"] for r in report["per_request"]} >= {"s0", "s-plain", "b3"}
    # recorded in the candidate: its identity changed, the record names the one evaluated, both loaders load it
    art = load_artifact(cand)
    assert art.acceptance is not None and art.acceptance["passed"] is True
    assert art.acceptance["candidate"]["sha256"] == before != sha256_file(cand / MANIFEST)
    assert art.acceptance["baseline"]["sha256"] == sha256_file(baseline / MANIFEST)
    assert art.manifest["acceptance"]["sha256"] == sha256_file(cand / "acceptance.json")
    assert art.acceptance["tolerances"] == report["tolerances"] and art.acceptance["checks"] == report["checks"]
    assert "per_request" not in art.acceptance
    core.load_artifact(str(cand), "cpu", None, True)


@pytest.fixture(scope="module")
def damaged(baseline: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    art = copy_artifact(baseline, tmp_path_factory.mktemp("damaged") / "art")
    damage(art, "layers.1.wgu", scale=0.5)
    return art


def test_a_damaged_candidate_is_rejected_naming_the_tolerance(baseline: Path, damaged: Path, requests_file: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    cand = copy_artifact(damaged, tmp_path / "cand")
    rc, out, _ = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(cand), "--requests",
                          str(requests_file), "--out", str(tmp_path / "report.json"))
    assert rc == 1, out
    report = json.loads((tmp_path / "report.json").read_text())
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert "max_abs_logprob" in failed and not report["passed"]
    verdict = out.strip().splitlines()[-2]  # the last line says where it was recorded
    assert verdict.startswith("REJECTED: ") and all(name in verdict for name in failed), out
    assert all(f"{name} " in out and "EXCEEDED" in line for name in failed
               for line in out.splitlines() if line.startswith(name + " "))
    m = report["metrics"]["candidate_vs_baseline"]
    assert m["score.abs_logprob_max"] > report["tolerances"]["max_abs_logprob"]
    assert m["answers.mismatched"] == 0
    # a failed evaluation is recorded as such
    rec = load_artifact(cand).acceptance
    assert rec is not None and rec["passed"] is False and rec["checks"] == report["checks"]


def test_tolerances_from_a_file_and_flags_over_it(baseline: Path, damaged: Path, requests_file: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    loose = {"max_abs_logprob": 1e6, "max_p99_abs_logprob": 1e6, "min_kendall_tau": -1, "min_top1_agreement": 0,
             "min_top3_agreement": 0, "min_beam_overlap": 0, "min_beam_top1_agreement": 0,
             "max_beam_logprob_delta": 1e6}
    tol = tmp_path / "tolerances.json"
    tol.write_text(json.dumps(loose))
    common = ["--baseline", str(baseline), "--candidate", str(damaged), "--requests", str(requests_file),
              "--tolerances", str(tol), "--no-record"]
    rc, out, _ = evaluate(capsys, *common)
    assert rc == 0 and "ACCEPTED" in out, out
    rc, out, _ = evaluate(capsys, *common, "--max-abs-logprob", "0.01")
    assert rc == 1 and out.strip().splitlines()[-1].startswith("REJECTED: max_abs_logprob "), out
    assert load_artifact(damaged).acceptance is None  # --no-record


def test_float64_truth_stands_beside_both_sides(baseline: Path, requests_file: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A bfloat16 copy of the float32 baseline: the baseline is within float32 rounding of the
    float64 truth, the candidate within bfloat16's, and the candidate-vs-truth column shows it."""
    cand = build_artifact(str(baseline.parent / "qwen2"), tmp_path / "bf16", dtype="bfloat16", quiet=True)
    rc, out, _ = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(cand), "--requests",
                          str(requests_file), "--truth", "float64", "--out", str(tmp_path / "report.json"),
                          "--max-abs-logprob", "5", "--max-p99-abs-logprob", "5", "--max-beam-logprob-delta", "5",
                          "--min-beam-overlap", "0", "--min-beam-top1-agreement", "0", "--min-top1-agreement", "0",
                          "--min-top3-agreement", "0", "--min-kendall-tau", "-1")
    assert rc == 0, out
    assert "baseline vs truth" in out and "candidate vs truth" in out
    metrics = json.loads((tmp_path / "report.json").read_text())["metrics"]
    base, cand_m = metrics["baseline_vs_truth"], metrics["candidate_vs_truth"]
    assert base["score.requests"] == cand_m["score.requests"] == 7 and base["beam.requests"] == 4
    assert base["score.abs_logprob_max"] < 1e-4 < cand_m["score.abs_logprob_max"]
    assert base["beam.overlap_mean"] == 1.0 and base["beam.best_logprob_delta_max"] < 1e-4
    assert cand_m["score.abs_logprob_max"] == pytest.approx(
        metrics["candidate_vs_baseline"]["score.abs_logprob_max"], abs=1e-4)


def test_a_line_only_one_side_answers_fails_the_answers_check(baseline: Path, qwen2_tiny, requests_file: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """A candidate built with a narrower beam limit refuses the 16-wide line the baseline answers:
    `answers` is exceeded, the line named in the report; the other lines still agree exactly."""
    cand = build_artifact(str(qwen2_tiny.ckpt), tmp_path / "narrow", quiet=True, limit_overrides={"max_beam_width": 8})
    rc, out, _ = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(cand), "--requests",
                          str(requests_file), "--out", str(tmp_path / "report.json"), "--no-record")
    assert rc == 1 and out.strip().splitlines()[-1] == "REJECTED: answers 1 (limit ≤ 0)", out
    report = json.loads((tmp_path / "report.json").read_text())
    (row,) = [r for r in report["per_request"] if "mismatch" in r]
    assert row["id"] == "b3" and row["mismatch"]["baseline"] == "answered"
    assert "beam_width" in row["mismatch"]["candidate"] and "8" in row["mismatch"]["candidate"]
    m = report["metrics"]["candidate_vs_baseline"]
    assert m["beam.requests"] == 3 and m["beam.overlap_min"] == 1.0 and m["score.abs_logprob_max"] == 0.0


def test_artifacts_whose_token_ids_differ_are_a_usage_error(baseline: Path, embedded_tiny, requests_file: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(embedded_tiny[0]), "--requests",
                            str(requests_file))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "vocabulary of 151936 tokens, the baseline's has 512: token ids would not mean the same" in err
    assert load_artifact(embedded_tiny[0]).acceptance is None


def test_model_info_and_client_info_show_the_recorded_result(baseline: Path, damaged: Path, requests_file: Path,
                                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    """A served candidate says what its evaluation found: ModelInfo.acceptance (the record's
    fields, every check) and `slmrank client info` (FAILED, the exceeded checks named)."""
    from service.model.tokenizer import load_tokenizer
    from service.runtime.python_runtime import PythonRuntime
    from service.serving.client import RankerClient
    from service.serving.server import Model, RankerServer, ServerConfig
    from service.serving.server_thread import ServerThread

    cand = copy_artifact(damaged, tmp_path / "cand")
    rc, _, _ = evaluate(capsys, "--baseline", str(baseline), "--candidate", str(cand), "--requests", str(requests_file))
    assert rc == 1
    art = load_artifact(cand)
    rec = art.acceptance
    assert rec is not None
    model = Model(art, PythonRuntime(art), load_tokenizer(art.tokenizer_dir), spec=str(cand))
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=5), lambda: model))
    try:
        srv.wait_serving()
        with RankerClient(srv.target, timeout_s=30) as c:
            info = c.model_info()
        assert info.HasField("acceptance")
        a = info.acceptance
        assert a.passed is False and a.date == rec["date"]
        assert a.baseline_sha256 == sha256_file(baseline / MANIFEST) == rec["baseline"]["sha256"]
        assert a.requests_sha256 == rec["requests"]["sha256"] == hashlib.sha256(requests_file.read_bytes()).hexdigest()
        assert a.record_sha256 == sha256_file(cand / "acceptance.json")
        assert a.evaluated_sha256 == rec["candidate"]["sha256"] != info.artifact_sha256
        assert a.requests == 11
        assert [(c.name, c.bound, c.limit, c.passed) for c in a.checks] == [
            (c["name"], c["bound"], c["limit"], c["passed"]) for c in rec["checks"]]
        assert [c.value for c in a.checks] == pytest.approx([c["value"] for c in rec["checks"]])
        assert cli_main(["client", "info", "--target", srv.target]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("acceptance"))
        assert f"FAILED {rec['date']}: against baseline {a.baseline_sha256[:16]}…, 11 requests" in row
        assert "  exceeded: max_abs_logprob " in out
    finally:
        srv.stop()


@pytest.mark.parametrize("args, words", [
    (["--max-abs-logprob", "-1"], "--max-abs-logprob: must be in [0, inf], got -1.0"),
    (["--min-kendall-tau", "1.5"], "--min-kendall-tau: must be in [-1, 1], got 1.5"),
    (["--min-beam-overlap", "nan"], "--min-beam-overlap: must be a finite number"),
    (["--max-abs-logprob", "x"], "argument --max-abs-logprob: invalid float value: 'x'"),
    (["--max-abs-logprop", "1"], "unrecognized arguments: --max-abs-logprop"),
    (["--truth", "float128"], "argument --truth: invalid choice: 'float128'"),
    (["--tolerances", "{tol}"], "'max_abs' is no tolerance"),
    (["--baseline", "{tmp}/nowhere"], "--baseline {tmp}/nowhere: no such artifact directory"),
    (["--requests", "{tmp}/none.jsonl"], "--requests {tmp}/none.jsonl: no such file"),
    (["--candidate", "{base}"], "--candidate is the --baseline"),
    (["--baseline", "{tmp}"], "--baseline {tmp}: not an artifact directory"),
], ids=lambda v: str(v)[:28])
def test_bad_flags_are_one_line_and_exit_2(baseline: Path, requests_file: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    (tmp_path / "tol.json").write_text('{"max_abs": 0.1}')
    cand = copy_artifact(baseline, tmp_path / "cand")
    given = {"--baseline": str(baseline), "--candidate": str(cand), "--requests": str(requests_file)}
    fill = {"tol": str(tmp_path / "tol.json"), "tmp": str(tmp_path), "base": str(baseline)}
    extra = [a.format(**fill) for a in args]
    for flag in list(given):
        if flag in extra:
            given.pop(flag)
    argv = [x for kv in given.items() for x in kv] + extra
    rc = exit_code(["evaluate", *argv, "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("slmrank evaluate: error: ") and words.format(**fill) in err, err
    assert load_artifact(cand).acceptance is None


def exit_code(argv: list[str]) -> int:
    """main's return value, or argparse's exit status (its own usage errors exit)."""
    try:
        return cli_main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_a_missing_required_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = exit_code(["evaluate", "--baseline", "a"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "the following arguments are required: --candidate, --requests" in err
