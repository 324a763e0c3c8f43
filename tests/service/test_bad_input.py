"""Bad requests are refused one by one, naming the field and the limit, through `execute` and through
the `slmrank run` JSONL path; the valid requests around them are still answered as if run alone.

Model: the tiny random Qwen2 checkpoint of conftest.py (vocabulary 512, 256 positions), so its
limits are: prompt 251 tokens, beam width 400, new tokens 5, 64 samples, 256 score tokens, 16 labels.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.cli import main as cli_main
from service.runtime.engine import execute
from service.runtime.requests import BeamRequest, BeamResult, RequestError, ScoreRequest, ScoreResult

V = 512  # vocabulary of the tiny checkpoints


@dataclass
class Case:
    name: str
    line: Any  # a JSON object (dict) or a raw line (str)
    field: str  # must appear in the error message
    numbers: tuple[int, ...] = ()  # the limit(s) that must appear in the message
    via_execute: bool = True  # representable as a request object (not a JSON/kind problem)
    extra: dict[str, Any] = field(default_factory=dict)


def _limits_cases(lim) -> list[Case]:
    p = lim.max_prompt_tokens
    ok_samples = [[1, 2, 3]]
    return [
        Case("unknown_kind", {"id": "k", "kind": "generate", "prompt_ids": [1]}, "kind", via_execute=False),
        Case("missing_kind", {"id": "k2", "samples": ok_samples, "label_ids": [1]}, "kind", via_execute=False),
        Case("empty_samples", {"id": "e1", "kind": "score", "samples": [], "label_ids": [1]}, "samples"),
        Case("empty_sample", {"id": "e2", "kind": "score", "samples": [[4, 5], []], "label_ids": [1]},
             "samples[1]", (1,)),
        Case("sample_id_over_vocab", {"id": "v1", "kind": "score", "samples": [[1, V]], "label_ids": [1]},
             "samples[0][1]", (V,)),
        Case("huge_sample_id", {"id": "v1b", "kind": "score", "samples": [[2 ** 63 + 5]], "label_ids": [1]},
             "samples[0][0]", (V,)),
        Case("prefix_id_over_vocab", {"id": "v2", "kind": "score", "prefix_ids": [3, 600], "samples": ok_samples,
                                      "label_ids": [1]}, "prefix_ids[1]", (V,)),
        Case("label_id_over_vocab", {"id": "v3", "kind": "score", "samples": ok_samples, "label_ids": [2, 1000]},
             "label_ids[1]", (V,)),
        Case("prompt_id_over_vocab", {"id": "v4", "kind": "beam", "prompt_ids": [5, 9999], "beam_width": 2,
                                      "new_tokens": 1}, "prompt_ids[1]", (V,)),
        Case("negative_sample_id", {"id": "n1", "kind": "score", "samples": [[-1]], "label_ids": [1]},
             "samples[0][0]", (V,)),
        Case("negative_prefix_id", {"id": "n1b", "kind": "score", "prefix_ids": [-7], "samples": ok_samples,
                                    "label_ids": [1]}, "prefix_ids[0]", (V,)),
        Case("negative_label_id", {"id": "n2", "kind": "score", "samples": ok_samples, "label_ids": [-3]},
             "label_ids[0]", (V,)),
        Case("negative_prompt_id", {"id": "n3", "kind": "beam", "prompt_ids": [1, 2, -2], "beam_width": 2,
                                    "new_tokens": 1}, "prompt_ids[2]", (V,)),
        Case("float_sample_id", {"id": "f1", "kind": "score", "samples": [[1, 2.5]], "label_ids": [1]},
             "samples[0][1]"),
        Case("string_label_id", {"id": "f2", "kind": "score", "samples": ok_samples, "label_ids": ["7"]},
             "label_ids[0]"),
        Case("bool_prompt_id", {"id": "f3", "kind": "beam", "prompt_ids": [3, True], "beam_width": 2,
                                "new_tokens": 1}, "prompt_ids[1]"),
        Case("float_prefix_id", {"id": "f4", "kind": "score", "prefix_ids": [1.0], "samples": ok_samples,
                                 "label_ids": [1]}, "prefix_ids[0]"),
        Case("beam_width_0", {"id": "w0", "kind": "beam", "prompt_ids": [1, 2], "beam_width": 0, "new_tokens": 2},
             "beam_width", (1, lim.max_beam_width)),
        Case("beam_width_over", {"id": "w1", "kind": "beam", "prompt_ids": [1, 2],
                                 "beam_width": lim.max_beam_width + 1, "new_tokens": 2},
             "beam_width", (lim.max_beam_width,)),
        Case("beam_width_missing", {"id": "w2", "kind": "beam", "prompt_ids": [1, 2], "new_tokens": 2},
             "beam_width"),
        Case("beam_width_float", {"id": "w3", "kind": "beam", "prompt_ids": [1, 2], "beam_width": 2.0,
                                  "new_tokens": 2}, "beam_width"),
        Case("new_tokens_0", {"id": "t0", "kind": "beam", "prompt_ids": [1, 2], "beam_width": 2, "new_tokens": 0},
             "new_tokens", (1, lim.max_new_tokens)),
        Case("new_tokens_over", {"id": "t1", "kind": "beam", "prompt_ids": [1, 2], "beam_width": 2,
                                 "new_tokens": lim.max_new_tokens + 1}, "new_tokens", (lim.max_new_tokens,)),
        Case("prompt_too_long", {"id": "p1", "kind": "beam", "prompt_ids": [7] * (p + 1), "beam_width": 2,
                                 "new_tokens": 1}, "prompt_ids", (p,)),
        Case("prompt_empty", {"id": "p2", "kind": "beam", "prompt_ids": [], "beam_width": 2, "new_tokens": 1},
             "prompt_ids", (1,)),
        Case("too_many_samples", {"id": "s1", "kind": "score", "samples": [[3]] * (lim.max_samples + 1),
                                  "label_ids": [1]}, "samples", (lim.max_samples,)),
        Case("too_many_score_tokens", {"id": "s2", "kind": "score", "prefix_ids": [9] * 200,
                                       "samples": [[1] * 40, [2] * 40], "label_ids": [1]},
             "samples", (lim.max_score_tokens,)),
        Case("too_many_labels", {"id": "l1", "kind": "score", "samples": ok_samples,
                                 "label_ids": list(range(lim.max_labels + 1))}, "label_ids", (lim.max_labels,)),
        Case("missing_label_ids", {"id": "l2", "kind": "score", "samples": ok_samples}, "label_ids"),
        Case("empty_label_ids", {"id": "l3", "kind": "score", "samples": ok_samples, "label_ids": []}, "label_ids"),
        Case("samples_not_a_list", {"id": "l4", "kind": "score", "samples": "1 2 3", "label_ids": [1]}, "samples",
             via_execute=False),
        Case("invalid_json", '{"id": "j1", "kind": "score", "samples": [[1, 2]', "line", via_execute=False),
        Case("non_object_json", '[1, 2, 3]', "line", via_execute=False),
        Case("json_string", '"score"', "line", via_execute=False),
    ]


def _to_request(obj: dict[str, Any]) -> ScoreRequest | BeamRequest:
    """Builds the request object as it is, without parse_request's checks: validation must catch it."""
    if obj["kind"] == "score":
        return ScoreRequest(samples=tuple(tuple(s) for s in obj["samples"]),
                            label_ids=tuple(obj.get("label_ids", ())),
                            prefix_ids=tuple(obj.get("prefix_ids", ())), id=obj["id"])
    return BeamRequest(prompt_ids=tuple(obj["prompt_ids"]), beam_width=obj.get("beam_width"),
                       new_tokens=obj.get("new_tokens"), id=obj["id"])


def _valid_lines(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(V) for _ in range(n)]  # noqa: E731
    return [
        {"id": "ok-score-prefix", "kind": "score", "prefix_ids": ids(9), "samples": [ids(4), ids(6), ids(1)],
         "label_ids": ids(5)},
        {"id": "ok-beam", "kind": "beam", "prompt_ids": ids(11), "beam_width": 4, "new_tokens": 2},
        {"id": "ok-score", "kind": "score", "samples": [ids(3), ids(8)], "label_ids": ids(3)},
        {"id": 17, "kind": "beam", "prompt_ids": ids(5), "beam_width": 1, "new_tokens": 2},
    ]


def _assert_close(got: Any, want: Any, tol: float = 1e-5) -> None:
    """Result equality up to float rounding (scores) and exact for token ids."""
    if isinstance(want, ScoreResult):
        assert isinstance(got, ScoreResult), got
        assert [len(r) for r in got.scores] == [len(r) for r in want.scores]
        for a, b in zip(got.scores, want.scores):
            assert max(abs(x - y) for x, y in zip(a, b)) <= tol
    else:
        assert isinstance(want, BeamResult) and isinstance(got, BeamResult), got
        assert [b.ids for b in got.beams] == [b.ids for b in want.beams]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.beams, want.beams)) <= tol


def _check_message(msg: str, case: Case) -> None:
    assert case.field in msg, f"{case.name}: field {case.field!r} not named in {msg!r}"
    for n in case.numbers:
        assert str(n) in msg, f"{case.name}: limit {n} not in {msg!r}"


def _interleave(bad: list[Any], good: list[Any]) -> list[Any]:
    out: list[Any] = []
    for i, b in enumerate(bad):
        out.append(b)
        if i % 4 == 0:
            out.append(good[(i // 4) % len(good)])
    return out + good


# ---- through execute --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm(qwen2_tiny):
    return qwen2_tiny


@pytest.fixture(scope="module")
def alone(lm):
    """Each valid request executed on its own."""
    return {obj["id"]: execute(lm.artifact, lm.runtime, [_to_request(obj)])[0] for obj in _valid_lines(3)}


@pytest.fixture(scope="module")
def executed(lm):
    cases = [c for c in _limits_cases(lm.artifact.limits) if c.via_execute]
    reqs = _interleave([_to_request(c.line) for c in cases], [_to_request(o) for o in _valid_lines(3)])
    return cases, reqs, execute(lm.artifact, lm.runtime, reqs)


def test_execute_refuses_each_bad_request_naming_field_and_limit(executed):
    cases, reqs, results = executed
    assert len(results) == len(reqs)
    by_id = {r.id: res for r, res in zip(reqs, results)}
    for case in cases:
        res = by_id[case.line["id"]]
        assert isinstance(res, RequestError), f"{case.name}: not refused, got {res!r}"
        _check_message(str(res), case)


def test_execute_answers_valid_requests_among_bad_ones(executed, alone):
    _, reqs, results = executed
    seen = 0
    for req, res in zip(reqs, results):
        if req.id in alone:
            _assert_close(res, alone[req.id])
            seen += 1
    assert seen >= len(alone)


def test_limits_are_what_the_cases_assume(lm):
    lim = lm.artifact.limits
    assert lm.artifact.config.vocab_size == V
    assert (lim.max_prompt_tokens, lim.max_score_tokens) == (251, 256)


# ---- through the JSONL CLI ----------------------------------------------------------------------

def _run_cli(tmp_path, model_dir, lines: list[Any]) -> list[dict[str, Any]]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    rc = cli_main(["run", "--model", str(model_dir), "--requests", str(inp), "--out", str(out), "--quiet"])
    assert rc == 0
    text = out.read_text()
    assert text.endswith("\n")
    return [json.loads(x) for x in text.splitlines()]


def test_cli_refuses_each_bad_line_and_answers_the_rest(tmp_path, lm, alone):
    cases = _limits_cases(lm.artifact.limits)
    lines = _interleave([c.line for c in cases], _valid_lines(3))
    out = _run_cli(tmp_path, lm.artifact.path, lines)
    assert len(out) == len(lines), "one output line per input line"
    case_of = {id(c.line): c for c in cases}
    for lineno, (line, got) in enumerate(zip(lines, out), 1):
        case = case_of.get(id(line))
        if case is None:  # a valid request
            assert got["id"] == line["id"]
            assert "error" not in got, got
            want = alone[line["id"]]
            if isinstance(want, ScoreResult):
                _assert_close(ScoreResult(got["scores"]), want)
            else:
                from service.runtime.requests import Beam
                _assert_close(BeamResult([Beam(b["ids"], b["logprob"]) for b in got["beams"]]), want)
            continue
        assert set(got) == {"id", "error"}, f"{case.name}: {got}"
        _check_message(got["error"], case)
        if isinstance(line, dict):
            assert got["id"] == line["id"], f"{case.name}: id not preserved"
        else:  # no id could be read: the message says which line of the file
            assert got["id"] is None
            assert f"line {lineno}" in got["error"], f"{case.name}: {got['error']!r} does not say line {lineno}"


def test_cli_bad_id_type(tmp_path, lm):
    out = _run_cli(tmp_path, lm.artifact.path,
                   [{"id": [1], "kind": "score", "samples": [[1]], "label_ids": [1]}])
    assert len(out) == 1 and "error" in out[0] and "id" in out[0]["error"]


# ---- classification model ---------------------------------------------------------------------

def test_classification_model_refuses_label_ids_and_beams(tmp_path, qwen2_cls):
    m = qwen2_cls
    good = {"id": "c-ok", "kind": "score", "samples": [[1, 2, 3], [4]], "prefix_ids": [9, 8]}
    bad = [Case("cls_label_ids", {"id": "c1", "kind": "score", "samples": [[1, 2]], "label_ids": [3]}, "label_ids",
                (m.artifact.config.num_labels,)),
           Case("cls_beam", {"id": "c2", "kind": "beam", "prompt_ids": [1, 2], "beam_width": 2, "new_tokens": 1},
                "kind")]
    want = execute(m.artifact, m.runtime, [_to_request(good)])[0]
    assert isinstance(want, ScoreResult) and all(len(r) == 3 for r in want.scores)

    results = execute(m.artifact, m.runtime, [_to_request(bad[0].line), _to_request(good), _to_request(bad[1].line)])
    for case, res in zip(bad, [results[0], results[2]]):
        assert isinstance(res, RequestError), f"{case.name}: {res!r}"
        _check_message(str(res), case)
    _assert_close(results[1], want)

    out = _run_cli(tmp_path, m.artifact.path, [bad[0].line, good, bad[1].line])
    assert [o["id"] for o in out] == ["c1", "c-ok", "c2"]
    for case, got in zip(bad, [out[0], out[2]]):
        assert set(got) == {"id", "error"}
        _check_message(got["error"], case)
    _assert_close(ScoreResult(out[1]["scores"]), want)
