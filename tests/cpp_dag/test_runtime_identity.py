"""The C++ DAG runtime and the Python artifact runtime agree byte for byte (CPU, float32).

- `slmrank run --runtime cpp` and `--runtime python` write identical output files for a mixed
  request file (Score with/without a shared prefix, batched Score, BeamSearch with B in 1..400 and
  every T in 1..5, batched BeamSearch, error lines), on Qwen2, Qwen3 and classification-head
  checkpoints;
- BeamSearch step by step: after every node the same buffers hold the same bytes (candidate
  tokens, cumulative scores, parents, sequences, suffix K/V of every layer, prompt K/V, hidden x);
- Score step by step: the hidden state after every layer (and every other traced buffer).

Each also on the same checkpoints built with FP8 (e4m3) linear layers (`--fp8 mlp,attn,head`; the
classifier `mlp,attn`): kernels/fp8_linear.py's emulation and cpp_dag/layer_ops.cpp's agree byte for byte.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.engine import plan_batches, validate
from service.runtime.jsonl import parse_request
from service.runtime.requests import BeamRequest, RequestError, ScoreRequest

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512  # the small checkpoints of tests/cpp_dag/conftest.py


# ---- the request file ----------------------------------------------------------------------------

def _lm_lines() -> tuple[list[Any], dict[int, str]]:
    """A mixed request file for an LM checkpoint; returns (lines, {line index: error field})."""
    rng = random.Random(2024)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    lines: list[Any] = [
        # a Score with a shared prefix, alone in its batch (the next line is a beam)
        {"id": "s-prefix", "kind": "score", "prefix_ids": ids(12), "samples": [ids(3), ids(7), ids(1)],
         "label_ids": ids(4)},
        {"id": "b1-t1", "kind": "beam", "prompt_ids": ids(9), "beam_width": 1, "new_tokens": 1},
        # a Score without a prefix, alone
        {"id": "s-plain", "kind": "score", "samples": [ids(5), ids(2)], "label_ids": ids(2)},
        {"id": "bad-kind", "kind": "rerank", "samples": [ids(2)]},
        {"id": "b3-t2", "kind": "beam", "prompt_ids": ids(17), "beam_width": 3, "new_tokens": 2},
        # several Score requests batched together (with and without prefixes, 1..16 labels)
        {"id": "s-batch-0", "kind": "score", "prefix_ids": ids(5), "samples": [ids(4), ids(4)],
         "label_ids": ids(16)},
        {"id": "s-batch-1", "kind": "score", "samples": [ids(1)], "label_ids": ids(1)},
        '{"id": "broken", "kind": ',  # invalid JSON, between two batched Score requests
        {"id": "s-batch-2", "kind": "score", "prefix_ids": ids(20), "samples": [ids(6), ids(2), ids(9), ids(3)],
         "label_ids": ids(3)},
        {"id": "s-batch-3", "kind": "score", "samples": [ids(11)], "label_ids": ids(5)},
        {"id": "bad-vocab", "kind": "beam", "prompt_ids": [1, VOCAB], "beam_width": 2, "new_tokens": 2},
        {"id": "b16-t3", "kind": "beam", "prompt_ids": ids(30), "beam_width": 16, "new_tokens": 3},
        {"id": "s-big", "kind": "score", "prefix_ids": ids(30), "samples": [ids(2) for _ in range(30)],
         "label_ids": ids(8)},
        {"id": "b70-t4", "kind": "beam", "prompt_ids": ids(5), "beam_width": 70, "new_tokens": 4},
        {"id": "too-wide", "kind": "beam", "prompt_ids": ids(5), "beam_width": 401, "new_tokens": 2},
        {"id": "b5-t5", "kind": "beam", "prompt_ids": ids(1), "beam_width": 5, "new_tokens": 5},
        # several BeamSearch requests batched (same T, widths 4/16/2: the bucket's width is 16)
        {"id": "bb-0", "kind": "beam", "prompt_ids": ids(8), "beam_width": 4, "new_tokens": 3},
        {"id": "bb-1", "kind": "beam", "prompt_ids": ids(3), "beam_width": 16, "new_tokens": 3},
        {"id": "bb-2", "kind": "beam", "prompt_ids": ids(25), "beam_width": 2, "new_tokens": 3},
        # a batched pair of wide beams (B > 64), then the widest beam allowed
        {"id": "bw-0", "kind": "beam", "prompt_ids": ids(6), "beam_width": 65, "new_tokens": 2},
        {"id": "bw-1", "kind": "beam", "prompt_ids": ids(14), "beam_width": 100, "new_tokens": 2},
        {"id": "b400-t1", "kind": "beam", "prompt_ids": ids(10), "beam_width": 400, "new_tokens": 1},
        {"id": "s-bad-label", "kind": "score", "samples": [ids(2)], "label_ids": [-1]},
        "[1, 2]",  # valid JSON, not an object
        # a batched pair between 128 and 256 wide, apart from the 400-wide one (a Score between):
        # the default table's 256-wide tier
        {"id": "s-apart", "kind": "score", "samples": [ids(3)], "label_ids": ids(2)},
        {"id": "bm-0", "kind": "beam", "prompt_ids": ids(7), "beam_width": 140, "new_tokens": 2},
        {"id": "bm-1", "kind": "beam", "prompt_ids": ids(12), "beam_width": 170, "new_tokens": 3},
    ]
    errors = {3: "kind", 7: "line 8", 10: "prompt_ids[1]", 14: "beam_width", 22: "label_ids[0]", 23: "line 24"}
    return lines, errors


def _cls_lines() -> tuple[list[Any], dict[int, str]]:
    """Score-only requests for the classification-head checkpoint (no label ids), plus errors."""
    rng = random.Random(77)
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    lines: list[Any] = [
        {"id": "c-prefix", "kind": "score", "prefix_ids": ids(10), "samples": [ids(3), ids(1), ids(6)]},
        {"id": "c-beam", "kind": "beam", "prompt_ids": ids(4), "beam_width": 2, "new_tokens": 2},
        {"id": "c-plain", "kind": "score", "samples": [ids(7)]},
        {"id": "c-batch-0", "kind": "score", "samples": [ids(2), ids(9)]},
        {"id": "c-labels", "kind": "score", "samples": [ids(2)], "label_ids": [3]},
        {"id": "c-batch-1", "kind": "score", "prefix_ids": ids(4), "samples": [ids(5)]},
        '{"kind": "score", "samples": [[1, 2]',
        {"id": "c-batch-2", "kind": "score", "samples": [ids(1), ids(1), ids(13)]},
        {"id": "c-vocab", "kind": "score", "samples": [[VOCAB + 3]]},
    ]
    errors = {1: "kind", 4: "label_ids", 6: "line 7", 8: "samples[0][0]"}
    return lines, errors


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _slmrank_subprocess(cache: Path, *args: str) -> tuple[int, str]:
    env = dict(os.environ, SLMRANK_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stderr


def _slmrank_in_process(cache: Path, *args: str) -> tuple[int, str]:
    """service.cli.main in this process (saves a torch import per run); stderr captured."""
    import contextlib
    import io

    from service import cli

    err = io.StringIO()
    old = os.environ.get("SLMRANK_CACHE")
    os.environ["SLMRANK_CACHE"] = str(cache)
    try:
        with contextlib.redirect_stderr(err):
            rc = cli.main(list(args))
    finally:
        if old is None:
            del os.environ["SLMRANK_CACHE"]
        else:
            os.environ["SLMRANK_CACHE"] = old
    return rc, err.getvalue()


def _differing_lines(a: bytes, b: bytes) -> list[str]:
    return [json.loads(x).get("id") for x, y in zip(a.decode().splitlines(), b.decode().splitlines()) if x != y]


def _check_output(data: bytes, lines: list[Any], errors: dict[int, str], cfg) -> None:
    got = [json.loads(ln) for ln in data.decode().splitlines()]
    assert len(got) == len(lines)
    assert sum("error" in g for g in got) == len(errors)
    assert sum("error" not in g for g in got) == len(lines) - len(errors)
    for n, (line, res) in enumerate(zip(lines, got)):
        if n in errors:
            assert set(res) == {"id", "error"} and errors[n] in res["error"], (n, res)
            continue
        assert res["id"] == line["id"], "ids in input order"
        if line["kind"] == "score":
            width = cfg.num_labels if cfg.has_cls_head else len(line["label_ids"])
            assert len(res["scores"]) == len(line["samples"])
            assert all(len(row) == width for row in res["scores"])
            assert all(isinstance(v, float) and v == v for row in res["scores"] for v in row)
        else:
            assert len(res["beams"]) == line["beam_width"]
            assert all(len(b["ids"]) == line["new_tokens"] for b in res["beams"])
            assert all(0 <= t < VOCAB for b in res["beams"] for t in b["ids"])
            logprobs = [b["logprob"] for b in res["beams"]]
            assert logprobs == sorted(logprobs, reverse=True), "best first"
            assert len({tuple(b["ids"]) for b in res["beams"]}) == len(res["beams"]), "distinct beams"


# qwen2 runs the real command line (two processes); qwen3 and the classifier call the CLI's main()
@pytest.mark.parametrize("model_name,how", [("qwen2_small", "subprocess"), ("qwen3_small", "in-process"),
                                            ("qwen2_cls_small", "in-process"), ("qwen2_small_fp8", "in-process"),
                                            ("qwen2_cls_small_fp8", "in-process")])
def test_cli_outputs_byte_identical(model_name: str, how: str, request: pytest.FixtureRequest,
                                    tmp_path: Path) -> None:
    model = request.getfixturevalue(model_name)
    is_cls = model.artifact.config.has_cls_head
    lines, errors = _cls_lines() if is_cls else _lm_lines()
    req_file = _write(tmp_path / "requests.jsonl", lines)

    # The file really exercises batching: several whole requests share a batch, of each kind.
    valid = []
    for line in lines:
        try:
            req = parse_request(line if isinstance(line, str) else json.dumps(line))
            validate(model.artifact, req)
            valid.append(req)
        except RequestError:
            pass
    batches = [[valid[i] for i in b] for b in plan_batches(model.artifact, valid)]
    assert max(len(b) for b in batches if isinstance(b[0], ScoreRequest)) >= 3
    if not is_cls:  # (a classification model serves no beams to separate Score batches)
        assert any(len(b) == 1 and not b[0].prefix_ids for b in batches if isinstance(b[0], ScoreRequest))
        assert any(len(b) == 1 and b[0].prefix_ids for b in batches if isinstance(b[0], ScoreRequest))
        beam_batches = [b for b in batches if isinstance(b[0], BeamRequest)]
        assert max(len(b) for b in beam_batches) >= 3
        assert {r.new_tokens for b in beam_batches for r in b} == {1, 2, 3, 4, 5}
        assert any(len({r.new_tokens for r in b}) > 1 for b in beam_batches), "no batch of different new_tokens"
        assert any(r.beam_width > 64 for b in beam_batches if len(b) > 1 for r in b)
        assert any(pick_beam_bucket(model.artifact.buckets, b).beam_width == 256 for b in beam_batches if len(b) > 1)

    cache = tmp_path / "cache"  # one cache: the second run loads the artifact the first one built
    slmrank = _slmrank_subprocess if how == "subprocess" else _slmrank_in_process
    outs = {}
    for runtime in ("python", "cpp"):
        out = tmp_path / f"{runtime}.jsonl"
        # an fp8 model runs its artifact (a checkpoint would be built without fp8)
        model_arg = model.artifact.path if model.artifact.fp8 else model.ckpt
        rc, stderr = slmrank(cache, "run", "--model", str(model_arg), "--runtime", runtime,
                             "--requests", str(req_file), "--out", str(out))
        assert rc == 0, stderr
        assert f"through the {runtime} runtime" in stderr
        outs[runtime] = out.read_bytes()

    # The files are not trivial: one line per input, results and errors where expected.
    for runtime in ("python", "cpp"):
        _check_output(outs[runtime], lines, errors, model.artifact.config)
    assert outs["cpp"] == outs["python"], \
        f"the two runtimes' output files differ in the lines of {_differing_lines(outs['cpp'], outs['python'])}"


# ---- step by step ----------------------------------------------------------------------------------

def _python_trace(run, batch, names: list[str]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    out: list[tuple[str, dict[str, torch.Tensor]]] = []

    def fn(node, env) -> None:  # clone: nodes write some buffers in place (beam_seqs, suffix K/V)
        out.append((node.name, {n: env[n].detach().cpu().clone() for n in names if n in env}))

    run(batch, trace=fn)
    return out


def _compare_traces(cpp_trace, py_trace, helpers, must_have: dict[str, list[str]]) -> None:
    """Same nodes in the same order; after every node the same traced buffers, byte-equal.
    must_have: node-name predicate key -> buffers that must be present after such nodes."""
    assert [n for n, _ in cpp_trace] == [n for n, _ in py_trace]
    checked: dict[str, int] = {}
    for (node, cbufs), (_, pbufs) in zip(cpp_trace, py_trace):
        assert set(cbufs) == set(pbufs), f"after {node}: buffers {sorted(cbufs)} vs {sorted(pbufs)}"
        for name in sorted(cbufs):
            assert helpers.same_bytes(cbufs[name], pbufs[name]), \
                f"after node {node}: {name} differs: {helpers.describe_diff(cbufs[name], pbufs[name])}"
            checked[name] = checked.get(name, 0) + 1
        for key, required in must_have.items():
            if key(node) if callable(key) else node == key:
                missing = [b for b in required if b not in cbufs]
                assert not missing, f"after {node}: {missing} were not traced"
    assert checked, "nothing was compared"


def _beam_buffers(num_layers: int) -> list[str]:
    names = ["beam_tokens", "beam_scores", "beam_parents", "beam_seqs", "x", "logits"]
    for i in range(num_layers):
        names += [f"suffix_k.{i}", f"suffix_v.{i}", f"prompt_k.{i}", f"prompt_v.{i}"]
    return names


BEAM_CASES = {
    # several requests of different widths in one bucket (plus a padding request), every decode step
    "mixed-widths-t5": ([(7, 3), (4, 16), (1, 1)], 5),
    # packed beam rows of many widths and prompt lengths (the widths' sum, padded to a rows tier)
    "packed-mixed-t4": ([(30, 20), (5, 2), (60, 7), (11, 33), (2, 1)], 4),
    "wide-b70-t3": ([(12, 70)], 3),
    "two-wide-t2": ([(3, 65), (9, 128)], 2),
    "greedy-t4": ([(20, 1)], 4),
    "t1": ([(6, 4), (2, 9)], 1),
}


@pytest.mark.parametrize("case", list(BEAM_CASES))
@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small", "qwen2_small_fp8", "qwen3_small_fp8"])
def test_beam_step_by_step(model_name: str, case: str, request: pytest.FixtureRequest, helpers) -> None:
    model = request.getfixturevalue(model_name)
    art, cfg = model.artifact, model.artifact.config
    rng = random.Random(hash(case) & 0xFFFF)
    shapes, new_tokens = BEAM_CASES[case]
    reqs = [BeamRequest(helpers.rand_ids(rng, n), b, new_tokens) for n, b in shapes]
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert bucket is not None
    batch = pack_beam(reqs, bucket)
    names = _beam_buffers(cfg.num_layers)

    cpp_trace = model.cpp.trace(batch, names)
    py_trace = _python_trace(model.python.run_beam, batch, names)

    expected_nodes = [n.name for n in art.beam_dag if n.step < new_tokens]
    assert [n for n, _ in cpp_trace] == expected_nodes
    beam_state = ["beam_tokens", "beam_scores", "beam_parents", "beam_seqs"]
    suffix = [f"suffix_{kv}.{i}" for i in range(cfg.num_layers) for kv in "kv"]
    prompt = [f"prompt_{kv}.{i}" for i in range(cfg.num_layers) for kv in "kv"]
    must_have = {
        "beam_init": beam_state + suffix,
        (lambda n: n.endswith("beam_step")): beam_state + suffix,
        f"layer.{cfg.num_layers - 1}": prompt,  # after the prefill layers
        (lambda n: ".layer." in n or n.startswith("layer.")): ["x"],
    }
    _compare_traces(cpp_trace, py_trace, helpers, must_have)
    num_steps = sum(n.endswith("beam_step") for n, _ in cpp_trace)
    assert num_steps == new_tokens - 1
    # the last traced state is the result, and the plain runs give the same bytes
    seqs_c, scores_c = model.cpp.run_beam(batch)
    seqs_p, scores_p = model.python.run_beam(batch)
    assert helpers.same_bytes(seqs_c, seqs_p) and helpers.same_bytes(scores_c, scores_p)
    assert helpers.same_bytes(cpp_trace[-1][1]["beam_seqs"], seqs_c)
    # the search is not degenerate: live beams have finite scores, a narrower request's extra ranks -inf
    for r, req in enumerate(reqs):
        assert torch.isfinite(scores_c[r, :req.beam_width]).all()
        assert torch.isneginf(scores_c[r, req.beam_width:]).all()


SCORE_CASES = {
    "prefix+plain": [((9,), (3, 5, 1)), ((), (4, 2))],
    "one-plain": [((), (6,))],
    "many": [((20,), (2,) * 10), ((3,), (7, 7)), ((), (1, 1, 1)), ((), (30,))],
}


@pytest.mark.parametrize("case", list(SCORE_CASES))
@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small", "qwen2_cls_small", "qwen2_small_fp8",
                                        "qwen3_small_fp8", "qwen2_cls_small_fp8"])
def test_score_step_by_step(model_name: str, case: str, request: pytest.FixtureRequest, helpers) -> None:
    model = request.getfixturevalue(model_name)
    art, cfg = model.artifact, model.artifact.config
    rng = random.Random(len(case) * 7919)
    reqs = []
    for prefix_len, samples in SCORE_CASES[case]:
        labels = () if cfg.has_cls_head else helpers.rand_ids(rng, 1 + rng.randrange(6))
        reqs.append(ScoreRequest(tuple(helpers.rand_ids(rng, n) for n in samples), labels,
                                 helpers.rand_ids(rng, prefix_len[0]) if prefix_len else ()))
    bucket = pick_score_bucket(art.buckets, reqs)
    assert bucket is not None
    batch = pack_score(reqs, bucket, 1 if cfg.has_cls_head else art.limits.max_labels)
    names = ["x", "h", "logits", "scores", "mask_self", "mask_ctx"]

    cpp_trace = model.cpp.trace(batch, names)
    py_trace = _python_trace(model.python.run_score, batch, names)
    assert [n for n, _ in cpp_trace] == [n.name for n in art.score_dag]
    layers = {f"layer.{i}": ["x"] for i in range(cfg.num_layers)}
    _compare_traces(cpp_trace, py_trace, helpers, {**layers, "embed": ["x"], cpp_trace[-1][0]: ["scores"]})
    scores_c, scores_p = model.cpp.run_score(batch), model.python.run_score(batch)
    assert helpers.same_bytes(scores_c, scores_p)
    n = sum(r.num_samples for r in reqs)
    assert torch.isfinite(scores_c[:n]).all()


@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small"])
def test_the_fp8_models_take_the_fp8_path(model_name: str, request: pytest.FixtureRequest, helpers) -> None:
    """The fp8 builds above really run e4m3 GEMMs: their weights are e4m3 in the Python runtime, and
    both runtimes' scores move off the unquantized model's, within bounds."""
    plain, fp8 = request.getfixturevalue(model_name), request.getfixturevalue(model_name + "_fp8")
    assert fp8.python.ctx.layers[0].wgu.dtype == torch.float8_e4m3fn
    assert fp8.python.ctx.layers[1].wqkv_scale.dtype == torch.float32
    assert fp8.python.ctx.weights["lm_head"].dtype == torch.float8_e4m3fn
    rng = random.Random(29)
    reqs = [ScoreRequest(tuple(helpers.rand_ids(rng, n) for n in (4, 6, 2)), helpers.rand_ids(rng, 3),
                         helpers.rand_ids(rng, 8))]
    batch = pack_score(reqs, pick_score_bucket(fp8.artifact.buckets, reqs), fp8.artifact.limits.max_labels)
    quantized, reference = fp8.cpp.run_score(batch)[:3], plain.cpp.run_score(batch)[:3]
    assert helpers.same_bytes(quantized, fp8.python.run_score(batch)[:3])
    delta = float((quantized - reference).abs().max())
    # these random small models are sensitive: every GEMM in e4m3 moved a log-prob of magnitude up to
    # 13.6 by 2.44 (qwen2); missing scales would put the logits off by 448x
    assert 0 < delta < 5, delta
