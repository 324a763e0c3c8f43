"""Fill (service/artifact/buckets.py), the one answer to "which bucket holds these requests": on
random tables of both kinds and random request sequences (Score requests; BeamSearch ones of any
new_tokens, some with a catalog's fixed steps), after every fit and add it names exactly the first
bucket in pick order that holds the whole batch, as a search of the whole table does; its bound on
the later buckets (reach) never turns away a batch some bucket holds."""

from __future__ import annotations

import random

from service.artifact.buckets import ANY_STEPS, BeamBucket, Fill, ScoreBucket, pick_order


def first_holder(buckets: tuple, totals: tuple):
    return next((b for b in buckets if b.holds(*totals)), None)


def random_table(rng: random.Random, beam: bool) -> tuple:
    if beam:
        out = set()
        for _ in range(rng.randint(1, 60)):
            r, w = rng.randint(1, 8), rng.choice([4, 16, 64, 100, 128, 256, 400])
            out.add(BeamBucket(rng.randint(1, 5), r, rng.choice([128, 256, 512, 1024, 2048]), w, rng.randint(w, r * w)))
    else:
        out = {ScoreBucket(rng.choice([64, 128, 512, 1024, 2048]), rng.choice([16, 32, 64, 128]), rng.randint(1, 16))
               for _ in range(rng.randint(1, 40))}
    return tuple(sorted(out, key=pick_order))


def random_dims(rng: random.Random, beam: bool) -> tuple[int, ...]:
    if beam:
        n = rng.randint(1, 5)
        steps = n if rng.random() < 0.2 else ANY_STEPS  # a catalog's request runs exactly its new tokens
        return rng.randint(1, 600), rng.choice([1, 4, 20, 100, 128, 200, 256, 400]), n, steps
    return rng.randint(1, 900), rng.randint(1, 60)


def test_fill_names_the_first_holder_in_order_after_every_request() -> None:
    rng = random.Random()  # fresh tables and requests each run
    for trial in range(400):
        beam = trial % 2 == 1
        table = random_table(rng, beam)
        fill, totals = Fill(table), table[0].ZERO
        for _ in range(12):
            d = random_dims(rng, beam)
            grown = table[0].grow(totals, *d)
            want = first_holder(table, grown)
            assert fill.fit(*d) == want, (trial, totals, d)
            if want is None and rng.random() < 0.7:
                continue  # it does not join; the next request is tried against the same batch
            assert fill.add(*d) == want and fill.bucket == want
            totals = grown
            assert fill.totals == totals
            if want is None:
                assert fill.fit(*random_dims(rng, beam)) is None  # once beyond every bucket, always
                break
            assert fill.buckets[fill.index] == want


def test_reach_bounds_every_later_bucket() -> None:
    rng = random.Random()
    for beam in (False, True):
        table = random_table(rng, beam)
        reach = Fill(table).reach
        for i in range(len(table)):
            for b in table[i:]:
                assert all(x <= y for x, y in zip(b.reach, reach[i]))
            # a bucket's own limits are held by it and within its reach
            b = table[i]
            top = (b.max_requests, b.max_tokens, b.max_samples) if not beam else \
                (b.max_requests, b.max_prompt_tokens, b.beam_width, b.max_rows, b.new_tokens, b.new_tokens)
            assert b.holds(*top) and all(x <= y for x, y in zip(b.reach_of(top), reach[i]))


def test_buckets_out_of_pick_order_are_searched_in_the_order_given() -> None:
    """Fill's least-work bound assumes pick order; given another order it still names the first
    holder of that order."""
    rng = random.Random()
    for trial in range(100):
        table = list(random_table(rng, beam=True))
        rng.shuffle(table)
        table = tuple(table)
        fill, totals = Fill(table), table[0].ZERO
        for _ in range(6):
            d = random_dims(rng, True)
            grown = table[0].grow(totals, *d)
            want = first_holder(table[fill.index:], grown)
            assert fill.fit(*d) == want, trial
            if want is None:
                break
            fill.add(*d)
            totals = grown
