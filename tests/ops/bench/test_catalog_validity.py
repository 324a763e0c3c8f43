"""ops/bench/catalog_validity.py's judge: it passes a valid constrained answer and names each kind of
invalid one (the 100,000-request run counts on it)."""

from __future__ import annotations

from ops.bench.catalog_validity import check
from service.runtime.requests import Beam, BeamRequest, BeamResult, RequestError

ITEMS = {(1, 2, 3): "a", (1, 2, 4): "b", (5, 6, 7): "c"}
REQ = BeamRequest((9, 9), 2, 3, catalog="cat")


def test_a_valid_answer_passes() -> None:
    assert check(REQ, BeamResult([Beam([1, 2, 3], -1.0, "a"), Beam([5, 6, 7], -2.0, "c")]), ITEMS) is None
    free = BeamRequest((9,), 2, 3)
    assert check(free, BeamResult([Beam([1, 1, 1], -1.0), Beam([2, 2, 2], -3.0)]), None) is None


def test_each_invalid_answer_is_named() -> None:
    cases = {
        "is no item": [Beam([1, 2, 5], -1.0, "a"), Beam([5, 6, 7], -2.0, "c")],  # ids of no item
        "is no item of": [Beam([1, 2, 3], -1.0, "b"), Beam([5, 6, 7], -2.0, "c")],  # the wrong item id
        "best first": [Beam([1, 2, 3], -3.0, "a"), Beam([5, 6, 7], -2.0, "c")],
        "1 beams, expected 2": [Beam([1, 2, 3], -1.0, "a")],
        "a beam twice": [Beam([1, 2, 3], -1.0, "a"), Beam([1, 2, 3], -1.0, "a")],
    }
    for words, beams in cases.items():
        problem = check(REQ, BeamResult(beams), ITEMS)
        assert problem is not None and words.split()[-1] in problem, (words, problem)
    assert "no beams" in check(REQ, RequestError("catalog", "unknown"), ITEMS)
    assert "unconstrained" in check(BeamRequest((9,), 2, 3), BeamResult([Beam([1, 2, 3], -1.0, "a")] * 2), None)
