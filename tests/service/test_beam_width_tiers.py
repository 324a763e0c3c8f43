"""The default table's widest-request tiers (service/artifact/buckets.py, beam_width_tiers): a
packed BeamSearch batch whose widest request lies between the narrow tier (128) and the limit (400)
runs in a bucket sized by its own rows, not in one of the limit's width with far more rows; and the
batches the middle tier does not concern (widest <= 128 or > 256: W2, W3 and W5 among them) pick
exactly the bucket they picked without it."""

from __future__ import annotations

import random

import pytest

from service.artifact import buckets as B
from service.artifact.buckets import BeamBucket, Fill, default_bucket_table, pick_order
from service.model.config import ServingLimits
from service.runtime.batch import dims
from service.runtime.requests import BeamRequest

LIMITS = ServingLimits()


def request(prompt: int, width: int, new_tokens: int = 5) -> BeamRequest:
    return BeamRequest(prompt_ids=tuple(range(1, prompt + 1)), beam_width=width, new_tokens=new_tokens)


def picked(beams: list[BeamBucket], reqs: list[BeamRequest]) -> BeamBucket | None:
    """The bucket a batch of these requests runs in: the first in pick_order that holds all."""
    fill = Fill(tuple(sorted(beams, key=pick_order)))
    for r in reqs:
        if fill.fit(*dims(r)) is None:
            return None
        fill.add(*dims(r))
    return fill.bucket  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tables() -> tuple[list[BeamBucket], list[BeamBucket]]:
    """(the default table's beam buckets, the same built with only the narrow and the limit's width)."""
    now = list(default_bucket_table(LIMITS).beam)
    mp = pytest.MonkeyPatch()
    mp.setattr(B, "beam_width_tiers", lambda max_width: sorted({min(B.NARROW_BEAM_WIDTH, max_width), max_width}))
    try:
        before = list(default_bucket_table(LIMITS).beam)
    finally:
        mp.undo()
    return now, before


def test_width_tiers_are_the_narrow_tier_its_octaves_and_the_limit() -> None:
    assert B.beam_width_tiers(400) == [128, 256, 400]
    assert B.beam_width_tiers(1000) == [128, 256, 512, 1000]
    assert B.beam_width_tiers(256) == [128, 256]
    assert B.beam_width_tiers(100) == [100]


def test_a_batch_between_the_narrow_tier_and_256_runs_in_its_own_rows(tables) -> None:
    """Random batches of 2-8 requests, 129-256 wide (prompts short enough not to bind): the bucket's
    rows are the least row tier that holds their rows and, at 2 x rows / 256 requests a bucket,
    their count. Without the 256 tier most of them ran in the 400-wide buckets (512 rows for 3)."""
    now, before = tables
    tiers = B.beam_row_tiers(LIMITS.max_beam_width, 1600)
    rng = random.Random()  # fresh batches each run
    worse = 0
    for _ in range(300):
        reqs = [request(rng.randint(8, 32), rng.randint(129, 256)) for _ in range(rng.randint(2, 8))]
        rows = sum(r.beam_width for r in reqs)
        want = next((t for t in tiers if t >= rows and min(8, max(2, -(-2 * t // 256))) >= len(reqs)), None)
        got = picked(now, reqs)
        if want is None or want > 1536:
            continue
        assert got is not None and got.max_rows == want, (rows, len(reqs), got, want)
        old = picked(before, reqs)
        assert old is None or old.work >= got.work
        worse += old is None or old.work > got.work
    assert worse > 100  # the tier changes most of these batches (e.g. 3 requests of 333 rows: 512 -> 384)


@pytest.mark.parametrize("widths", [(20, 128), (257, 400)], ids=["narrow", "wide"])
def test_batches_the_middle_tier_does_not_concern_pick_the_same_bucket(tables, widths) -> None:
    now, before = tables
    rng = random.Random()
    for _ in range(300):
        lo, hi = widths
        reqs = [request(rng.randint(8, 480), rng.randint(lo, hi), rng.randint(1, 5)) for _ in range(rng.randint(1, 8))]
        assert picked(now, reqs) == picked(before, reqs), reqs


@pytest.mark.parametrize("prompt,width,new_tokens", [(128, 100, 5), (480, 100, 5), (480, 400, 5), (1000, 256, 3)],
                         ids=["W2", "W3", "W5", "W6"])
def test_the_fixed_beam_shapes_run_in_no_more_rows_than_before(tables, prompt, width, new_tokens) -> None:
    """1-8 requests of each fixed shape: W2, W3 and W5 pick the very same bucket as before the middle
    tier; W6's 256-wide requests, two or more a batch, the 256 tier's: never more padded work (5 of
    them: 1,280 rows where the 400-wide buckets took 1,536)."""
    now, before = tables
    for n in range(1, 9):
        reqs = [request(prompt, width, new_tokens)] * n
        a, b = picked(now, reqs), picked(before, reqs)
        assert (a is None) == (b is None), n
        if a is None or b is None:
            continue
        assert a == b if width != 256 else a.work <= b.work and a.beam_width <= b.beam_width, (n, a, b)


@pytest.mark.parametrize("model", ["tiny", "qwen3-0.6b"])
def test_the_aten_capture_order_takes_the_most_ranks_first(model) -> None:
    """CppRuntime.capture sorts buckets by _footprint, largest first, so that later captures reuse the
    lane pool's blocks. The ATen beam step gathers every rank's candidates, [R x B, V]: at 1,536 rows
    the 400-wide bucket (8 x 400 ranks) needs more than the 256-wide one (8 x 256), and was captured
    after it, so the pool grew by 1.8 GiB (tests/cpp_dag/test_gpu_runtime.py, H100, 2026-12-07). With
    the ATen path the first beam bucket has the most logits rows (2N + R x B) of all; the fused path's
    order is by rows alone, as before."""
    from service.model.checkpoint import embedded_spec
    from service.runtime.cpp_runtime import _footprint

    cfg = embedded_spec(model).config
    beams = [b for b in default_bucket_table(LIMITS).beam if b.new_tokens == 5]

    def logits_rows(b: BeamBucket) -> int:
        return 2 * b.max_rows + b.max_requests * b.beam_width

    aten = sorted(beams, key=lambda b: _footprint(b, cfg, aten=True), reverse=True)
    assert logits_rows(aten[0]) == max(map(logits_rows, beams))
    assert (aten[0].max_rows, aten[0].beam_width) == (max(b.max_rows for b in beams), LIMITS.max_beam_width)
    # at the most rows, each prompt tier's limit-wide bucket before its 256-wide twin
    top = [b for b in aten if b.max_rows == aten[0].max_rows]
    for b in top:
        if b.beam_width == 256:
            twin = next(t for t in top if t.beam_width == LIMITS.max_beam_width
                        and t.max_prompt_tokens == b.max_prompt_tokens)
            assert aten.index(twin) < aten.index(b), (twin.key, b.key)
    # without the ATen candidates the footprint is the rows' and the prompt's, whatever the width
    fused = sorted(beams, key=lambda b: _footprint(b, cfg), reverse=True)
    assert fused[0].max_rows == aten[0].max_rows
    assert _footprint(aten[0], cfg) == _footprint(
        next(b for b in beams if b.max_rows == aten[0].max_rows and b.max_prompt_tokens == aten[0].max_prompt_tokens
             and b.beam_width != aten[0].beam_width), cfg)
