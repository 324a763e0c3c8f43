"""The agreement of two answers to one request, each a pure function of the two (numpy, no torch).

abs_delta(a, b)          |a - b| elementwise; equal values (-inf and -inf too) 0, any other
                         non-finite pair inf: a NaN can never pass a tolerance
kendall_tau_b(x, y)      Kendall's tau-b of two score lists over the same samples: pairs ordered
                         alike minus pairs ordered unlike, over the root of the untied pairs of
                         each side (a pair tied on one side counts in neither numerator term; tied
                         on both, in nothing). 1 with fewer than 2 samples or both sides all tied
                         (nothing to disagree on), 0 when exactly one side is all tied (its order
                         is lost)
top_k_agreement(x, y, k) |top-k of x ∩ top-k of y| / min(k, n), at most 1; a top-k holds every
                         sample tied with its k-th best, so a tie at the boundary is no disagreement
beam_overlap(a, b)       |A ∩ B| / |A| of the two beam sets' token sequences (1 when A is empty
                         and B too, 0 when only A is)
beam_top1(a, b)          the candidate's best sequence is among the baseline's best (ties included)
p99(values)              the 99th percentile (linear interpolation, numpy's default)
rank_key(scores, how)    a sample's ranking score from its label log-probs: "first" the first
                         label's, "margin" the first minus the second (README: " yes" minus " no"),
                         "auto" margin with two or more labels, else first
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RANK_BY = ("auto", "first", "margin")


def abs_delta(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    same = a == b  # -inf == -inf: the same answer
    d[same] = 0.0
    d[~np.isfinite(d)] = np.inf  # NaN on either side, or one side infinite
    return d


def _ordered(values: Sequence[float] | np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    return np.where(np.isnan(v), -np.inf, v)  # a NaN score ranks last (abs_delta already fails it)


def kendall_tau_b(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    x, y = _ordered(x), _ordered(y)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"kendall_tau_b: two lists of one length, got {x.shape} and {y.shape}")
    n = x.shape[0]
    if n < 2:
        return 1.0
    i, j = np.triu_indices(n, 1)
    dx, dy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])  # inf - inf is NaN: a tie at -inf
    dx, dy = np.nan_to_num(dx, nan=0.0), np.nan_to_num(dy, nan=0.0)
    untied_x, untied_y = int(np.count_nonzero(dx)), int(np.count_nonzero(dy))
    if untied_x == 0 or untied_y == 0:
        return 1.0 if untied_x == untied_y else 0.0
    return float(np.dot(dx, dy) / np.sqrt(float(untied_x) * float(untied_y)))


def top_k(values: Sequence[float] | np.ndarray, k: int) -> set[int]:
    """The indices of the k best, and of every sample tied with the k-th best."""
    v = _ordered(values)
    if v.size == 0:
        return set()
    kth = np.sort(v)[::-1][min(k, v.size) - 1]
    return set(np.flatnonzero(v >= kth).tolist())


def top_k_agreement(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray, k: int) -> float:
    n = len(x)
    if n == 0:
        return 1.0
    return min(1.0, len(top_k(x, k) & top_k(y, k)) / min(k, n))


def beam_overlap(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    sa, sb = {tuple(s) for s in a}, {tuple(s) for s in b}
    if not sa:
        return 1.0 if not sb else 0.0
    return len(sa & sb) / len(sa)


def beam_top1(a: Sequence[tuple[Sequence[int], float]], b: Sequence[tuple[Sequence[int], float]]) -> bool:
    """a, b: (ids, log-prob) best first."""
    if not a or not b:
        return not a and not b
    best = a[0][1]
    return tuple(b[0][0]) in {tuple(ids) for ids, lp in a if lp == best}


def p99(values: Sequence[float] | np.ndarray) -> float:
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        q = float(np.percentile(v, 99))
    return np.inf if np.isnan(q) else q  # inf - inf in the interpolation: the quantile is inf


def rank_key(scores: Sequence[Sequence[float]], how: str = "auto") -> np.ndarray:
    """scores: per sample, its label log-probs (or a head's outputs) -> one ranking score a sample."""
    if how not in RANK_BY:
        raise ValueError(f"rank_by: {how!r} is not one of {', '.join(RANK_BY)}")
    s = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    if how == "auto":
        how = "margin" if s.shape[1] >= 2 else "first"
    if how == "margin":
        if s.shape[1] < 2:
            raise ValueError("rank_by margin: needs two labels a sample")
        with np.errstate(invalid="ignore"):
            return s[:, 0] - s[:, 1]
    return s[:, 0]
