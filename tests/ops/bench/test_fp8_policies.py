"""ops/bench/fp8_policies.py on the CPU with the tiny model: one row per policy, from real `slmrank
evaluate --truth float64` reports (the float32 baseline within float32's error of the truth, the fp8
candidate clearly off both), and the request file it writes is one `slmrank run` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ops.bench import fp8_policies
from service.runtime.jsonl import parse_request
from service.runtime.requests import BeamRequest, ScoreRequest


def test_one_row_per_policy_from_real_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    out = tmp_path / "rows.json"
    monkeypatch.setattr(sys, "argv", ["fp8_policies", "--models", "tiny", "--policies", "mlp,mlp+attn+head",
                                      "--score", "2", "--beam", "1", "--device", "cpu", "--dir", str(tmp_path / "w"),
                                      "--out", str(out)])
    fp8_policies.main()
    rows = json.loads(out.read_text())
    assert [(r["model"], r["policy"]) for r in rows] == [("tiny", "mlp"), ("tiny", "mlp+attn+head")]
    for r in rows:
        assert r["baseline_vs_truth.score.abs_logprob_max"] < 1e-4  # float32 against float64
        assert r["candidate_vs_baseline.score.abs_logprob_max"] > 1e-3  # e4m3 GEMMs ran
        assert r["candidate_vs_truth.score.abs_logprob_max"] > 1e-3
        assert r["rc"] == (0 if r["passed"] else 1)
    table = capsys.readouterr().out.splitlines()
    assert table[-2].startswith("tiny          mlp ") and table[-1].startswith("tiny          mlp+attn+head")
    reqs = [parse_request(line) for line in (tmp_path / "w" / "requests.jsonl").read_text().splitlines()]
    assert [type(r) for r in reqs] == [ScoreRequest, BeamRequest, ScoreRequest]
    assert all(len(r.samples) == 15 for r in reqs if isinstance(r, ScoreRequest))
