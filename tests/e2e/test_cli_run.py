"""`slmrank run` end to end, as a subprocess, on embedded:tiny with a mixed JSONL request file."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 151936  # embedded:tiny uses the Qwen vocabulary


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slmrank_cache")


def _slmrank(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SLMRANK_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _lines() -> list[object]:
    rng = random.Random(12345)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    return [
        {"id": "score-prefix", "kind": "score", "prefix_ids": ids(12), "samples": [ids(3), ids(7), ids(1)],
         "label_ids": ids(4)},
        {"id": "bad-kind", "kind": "rerank", "samples": [ids(2)]},
        {"id": "score-plain", "kind": "score", "samples": [ids(5), ids(2)], "label_ids": ids(2)},
        '{"id": "broken", "kind": ',
        {"id": "beam-4", "kind": "beam", "prompt_ids": ids(20), "beam_width": 4, "new_tokens": 3},
        {"id": "bad-width", "kind": "beam", "prompt_ids": ids(5), "beam_width": 0, "new_tokens": 2},
        {"id": 7, "kind": "beam", "prompt_ids": ids(6), "beam_width": 1, "new_tokens": 2},
        {"id": "bad-vocab", "kind": "score", "samples": [[VOCAB]], "label_ids": [1]},
        "[1, 2]",
        {"id": "beam-3", "kind": "beam", "prompt_ids": ids(9), "beam_width": 3, "new_tokens": 5},
    ]


ERRORS = {1: "kind", 3: "line 4", 5: "beam_width", 7: "samples[0][0]", 8: "line 9"}


@pytest.fixture(scope="session")
def requests_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("req") / "requests.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in _lines()))
    return p


@pytest.fixture(scope="session")
def first_run(cache: Path, requests_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("out") / "first.jsonl"
    proc = _slmrank(cache, "run", "--model", "embedded:tiny", "--requests", str(requests_file), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


def _check_output(lines: list[object], out: list[dict]) -> None:
    assert len(out) == len(lines), "one output line per input line"
    for n, (line, got) in enumerate(zip(lines, out)):
        if n in ERRORS:
            assert set(got) == {"id", "error"}, got
            assert ERRORS[n] in got["error"], got
            assert got["id"] == (line["id"] if isinstance(line, dict) else None)
            continue
        assert got["id"] == line["id"], "ids preserved, in input order"
        assert "error" not in got, got
        if line["kind"] == "score":
            assert set(got) == {"id", "scores"}
            assert len(got["scores"]) == len(line["samples"])
            for row in got["scores"]:
                assert len(row) == len(line["label_ids"])
                assert all(math.isfinite(x) and x <= 0.0 for x in row)
        else:
            assert set(got) == {"id", "beams"}
            beams = got["beams"]
            assert len(beams) == line["beam_width"]
            assert all(len(b["ids"]) == line["new_tokens"] for b in beams)
            assert all(0 <= t < VOCAB for b in beams for t in b["ids"])
            lp = [b["logprob"] for b in beams]
            assert all(math.isfinite(x) and x <= 0.0 for x in lp)
            assert lp == sorted(lp, reverse=True), "best first"
            assert len({tuple(b["ids"]) for b in beams}) == len(beams), "beams are distinct sequences"


def test_run_mixed_file(first_run: Path, cache: Path):
    out = [json.loads(x) for x in first_run.read_text().splitlines()]
    _check_output(_lines(), out)
    # the artifact was built into SLMRANK_CACHE
    assert list(cache.glob("artifacts/*/manifest.msgpack")), "no artifact in SLMRANK_CACHE"


def test_run_twice_is_byte_identical(first_run: Path, cache: Path, requests_file: Path, tmp_path: Path):
    out = tmp_path / "second.jsonl"
    proc = _slmrank(cache, "run", "--model", "embedded:tiny", "--requests", str(requests_file), "--out", str(out),
                    "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == first_run.read_bytes()


def test_built_artifact_dir_gives_the_same_output(first_run: Path, cache: Path, requests_file: Path,
                                                  tmp_path: Path):
    art = tmp_path / "art"
    proc = _slmrank(cache, "build", "--model", "embedded:tiny", "--out", str(art), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (art / "manifest.msgpack").exists()
    out = tmp_path / "from_dir.jsonl"
    proc = _slmrank(cache, "run", "--model", str(art), "--requests", str(requests_file), "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes() == first_run.read_bytes()


def test_run_bfloat16(first_run: Path, cache: Path, requests_file: Path, tmp_path: Path):
    out = tmp_path / "bf16.jsonl"
    proc = _slmrank(cache, "run", "--model", "embedded:tiny", "--requests", str(requests_file), "--out", str(out),
                    "--dtype", "bfloat16", "--quiet")
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    _check_output(_lines(), got)
    ref = [json.loads(x) for x in first_run.read_text().splitlines()]
    for n, (a, b) in enumerate(zip(got, ref)):
        if n in ERRORS:
            assert a == b  # errors do not depend on the compute dtype
        elif "scores" in a:  # bf16 is close to float32, not equal
            diffs = [abs(x - y) for ra, rb in zip(a["scores"], b["scores"]) for x, y in zip(ra, rb)]
            scale = max(abs(y) for rb in b["scores"] for y in rb)
            assert max(diffs) <= 0.05 * scale + 0.05, (max(diffs), scale)
    valid = [n for n in range(len(ref)) if n not in ERRORS]
    assert any(got[n] != ref[n] for n in valid), "--dtype bfloat16 gave float32's exact output: flag ignored?"


def test_run_missing_requests_file_fails_cleanly(cache: Path, tmp_path: Path):
    proc = _slmrank(cache, "run", "--model", "embedded:tiny", "--requests", str(tmp_path / "nope.jsonl"),
                    "--out", str(tmp_path / "o.jsonl"), "--quiet")
    assert proc.returncode != 0
    assert "nope.jsonl" in proc.stderr


def test_run_on_a_checkpoint_dir_sees_updated_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`run --model CKPT_DIR` builds the checkpoint into the cache once; when the checkpoint's weights
    are replaced afterwards, the next run must answer with the new weights, never the stale artifact."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from service.cli import main as cli_main

    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=0.3)
    ckpt, req = tmp_path / "ckpt", tmp_path / "in.jsonl"
    sample, labels = [5, 17, 300, 2], [9, 111]
    req.write_text(json.dumps({"id": "a", "kind": "score", "samples": [sample], "label_ids": labels}) + "\n")
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).eval()
        model.save_pretrained(ckpt)
        out = tmp_path / f"out{seed}.jsonl"
        assert cli_main(["run", "--model", str(ckpt), "--requests", str(req), "--out", str(out), "--quiet"]) == 0
        got = json.loads(out.read_text())["scores"][0]
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([sample])).logits[0, -1], -1)[labels].tolist()
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4, \
            f"checkpoint version {seed}: got {got}, the checkpoint's own model gives {want}"


def test_jsonl_lines_split_only_on_newline(first_run: Path, cache: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch):
    """JSONL records end at '\\n' only: a string value may hold U+2028, U+2029 or U+0085 raw (valid JSON),
    and such a line is still one request with its id preserved."""
    from service.cli import main as cli_main

    monkeypatch.setenv("SLMRANK_CACHE", str(cache))
    ids = ["plain", "caf\u00e9", "a\u2028b", "c\u2029d", "e\u0085f"]
    lines = [json.dumps({"id": i, "kind": "score", "samples": [[11, 12, 13]], "label_ids": [3, 4]},
                        ensure_ascii=False) for i in ids]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
    assert cli_main(["run", "--model", "embedded:tiny", "--requests", str(inp), "--out", str(out), "--quiet"]) == 0
    records = out.read_bytes().decode("utf-8").split("\n")
    assert records[-1] == ""
    got = [json.loads(r) for r in records[:-1]]
    assert [g.get("id") for g in got] == ids, [g.get("error") for g in got]
    assert all(g["scores"] == got[0]["scores"] for g in got), "the same request gives the same scores"
