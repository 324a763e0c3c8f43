"""The agreement metrics of `slmrank evaluate` (service/evaluate/metrics.py) against brute-force
references written pair by pair, on random inputs drawn from small sets (so that ties are common),
and the tolerance checks' handling of what is not finite."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from service.evaluate import metrics as mx
from service.evaluate.tolerances import ANSWERS_METRIC, TOLERANCES, check, check_limit, resolve_limits


def tau_b_reference(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b by counting every pair: (C - D) / sqrt((C + D + Tx)(C + D + Ty)), Tx the
    pairs tied in x only, Ty in y only (tied in both: in neither)."""
    n = len(x)
    if n < 2:
        return 1.0
    c = d = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            a, b = x[i] - x[j], y[i] - y[j]
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif (a > 0) == (b > 0):
                c += 1
            else:
                d += 1
    den_x, den_y = c + d + tx, c + d + ty  # untied pairs of x, of y
    if den_x == 0 or den_y == 0:  # the module's convention: both all tied 1, one of them 0
        return 1.0 if den_x == den_y else 0.0
    return (c - d) / math.sqrt(den_x * den_y)


def top_k_reference(x: list[float], k: int) -> set[int]:
    """i is in the top k when fewer than k samples are strictly better."""
    return {i for i in range(len(x)) if sum(v > x[i] for v in x) < k}


def test_kendall_tau_b_on_known_values() -> None:
    assert mx.kendall_tau_b([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert mx.kendall_tau_b([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    # scipy.stats.kendalltau's documented example (tau-b with ties in both): -0.47140452079103173
    assert mx.kendall_tau_b([12, 2, 1, 12, 2], [1, 4, 7, 1, 0]) == pytest.approx(-0.47140452079103173, abs=1e-15)
    assert mx.kendall_tau_b([5.0], [1.0]) == 1.0  # one sample: nothing to disagree on
    assert mx.kendall_tau_b([1, 1, 1], [2, 2, 2]) == 1.0
    assert mx.kendall_tau_b([1, 1, 1], [1, 2, 3]) == 0.0  # one side lost the order
    assert mx.kendall_tau_b([1, math.nan, 3], [1, 2, 3]) < 1.0  # a NaN ranks last


@pytest.mark.parametrize("seed", range(5))
def test_kendall_tau_b_equals_the_pairwise_count_on_random_inputs_with_ties(seed: int) -> None:
    rng = random.Random(seed)
    tied = 0
    for _ in range(200):
        n = rng.randrange(0, 20)
        levels = rng.choice([2, 3, 5, 1000])  # 2 levels: many ties; 1000: few
        x = [float(rng.randrange(levels)) for _ in range(n)]
        y = [float(rng.randrange(levels)) for _ in range(n)]
        if rng.random() < 0.3:  # y a noisy copy of x: taus near 1, not only near 0
            y = [v + rng.choice([0.0, 0.0, 1.0]) for v in x]
        tied += len(set(x)) < n
        assert mx.kendall_tau_b(x, y) == pytest.approx(tau_b_reference(x, y), abs=1e-12), (x, y)
    assert tied > 100  # the inputs did have ties


@pytest.mark.parametrize("seed", range(3))
def test_top_k_agreement_equals_the_reference_sets(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(300):
        n, k = rng.randrange(1, 12), rng.choice([1, 3])
        x = [float(rng.randrange(4)) for _ in range(n)]
        y = [float(rng.randrange(4)) for _ in range(n)]
        assert mx.top_k(x, k) == top_k_reference(x, k)
        want = min(1.0, len(top_k_reference(x, k) & top_k_reference(y, k)) / min(k, n))
        assert mx.top_k_agreement(x, y, k) == want
    assert mx.top_k_agreement([3, 1, 2], [3, 2, 1], 1) == 1.0
    assert mx.top_k_agreement([3, 1, 2], [1, 3, 2], 1) == 0.0
    assert mx.top_k_agreement([1, 5, 4, 3, 0], [5, 4, 1, 3, 0], 3) == pytest.approx(2 / 3)


@pytest.mark.parametrize("seed", range(3))
def test_beam_overlap_equals_counting_shared_sequences(seed: int) -> None:
    rng = random.Random(200 + seed)
    for _ in range(300):
        length = rng.randrange(1, 4)
        pool = [tuple(rng.randrange(3) for _ in range(length)) for _ in range(12)]
        a = list(dict.fromkeys(rng.sample(pool, rng.randrange(0, 8))))
        b = list(dict.fromkeys(rng.sample(pool, rng.randrange(0, 8))))
        shared = sum(1 for s in a if any(s == t for t in b))
        want = (1.0 if not b else 0.0) if not a else shared / len(a)
        assert mx.beam_overlap(a, [list(s) for s in b]) == want
    assert mx.beam_overlap([(1, 2), (3, 4)], [(3, 4), (5, 6), (1, 2)]) == 1.0  # |A∩B|/|A|: B's extras don't count


def test_beam_top1_takes_ties_at_the_top() -> None:
    a = [((1,), -1.0), ((2,), -1.0), ((3,), -2.0)]
    assert mx.beam_top1(a, [((2,), -1.1)]) and mx.beam_top1(a, [((1,), -0.9)])
    assert not mx.beam_top1(a, [((3,), -1.0)])
    assert mx.beam_top1([], []) and not mx.beam_top1(a, [])


def test_abs_delta_makes_anything_not_finite_fail() -> None:
    d = mx.abs_delta([0.0, -math.inf, -math.inf, 1.0, math.nan, 2.0], [0.5, -math.inf, -3.0, math.nan, math.nan, 2.0])
    assert d.tolist() == [0.5, 0.0, math.inf, math.inf, math.inf, 0.0]
    assert mx.p99(d) == math.inf and mx.p99([]) == 0.0
    values = np.random.default_rng(0).random(1000)
    s = np.sort(values)
    pos = 0.99 * (len(s) - 1)  # linear interpolation between the two closest ranks
    assert mx.p99(values) == pytest.approx(s[int(pos)] + (pos - int(pos)) * (s[int(pos) + 1] - s[int(pos)]))


def test_rank_key() -> None:
    scores = [[-1.0, -3.0], [-2.0, -1.0]]
    assert mx.rank_key(scores, "first").tolist() == [-1.0, -2.0]
    assert mx.rank_key(scores, "margin").tolist() == [2.0, -1.0] == mx.rank_key(scores, "auto").tolist()
    assert mx.rank_key([[-1.0], [-2.0]], "auto").tolist() == [-1.0, -2.0]
    with pytest.raises(ValueError, match="margin: needs two labels"):
        mx.rank_key([[-1.0]], "margin")


def test_checks_bound_each_metric_and_fail_nan() -> None:
    limits = resolve_limits({"max_abs_logprob": 0.1}, {"max_abs_logprob": 0.2, "min_kendall_tau": None})
    assert limits["max_abs_logprob"] == 0.2  # the flag over the file
    assert limits["min_kendall_tau"] == next(t.default for t in TOLERANCES if t.name == "min_kendall_tau")
    metrics = {ANSWERS_METRIC: 0, "score.abs_logprob_max": 0.2, "score.abs_logprob_p99": math.nan,
               "score.kendall_tau_mean": 0.95}
    by_name = {c["name"]: c for c in check(limits, metrics)}
    assert by_name["answers"]["passed"] and by_name["max_abs_logprob"]["passed"]  # at the limit holds
    assert not by_name["max_p99_abs_logprob"]["passed"]  # NaN never passes
    assert by_name["min_kendall_tau"]["passed"] and by_name["min_kendall_tau"]["value"] == 0.95
    assert by_name["min_beam_overlap"]["value"] is None and by_name["min_beam_overlap"]["passed"]  # not measured
    assert not {c["name"]: c for c in check(limits, {**metrics, ANSWERS_METRIC: 1})}["answers"]["passed"]
    for name, value in (("min_kendall_tau", 1.5), ("max_abs_logprob", -0.1), ("max_abs_logprob", math.inf)):
        with pytest.raises(ValueError, match="must be"):
            check_limit(name, value, name)
