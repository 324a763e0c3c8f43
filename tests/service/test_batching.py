"""Batching whole requests into buckets never changes a result beyond float rounding, never splits a
request, and masks the beams a narrower request does not have."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket, unpack_beam, unpack_score
from service.artifact.buckets import ANY_STEPS, BeamBucket, BucketTable, ScoreBucket, token_tiers
from service.runtime.engine import execute, plan_batches
from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult

TOL = 1e-5


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


def _score_reqs(rng: random.Random, n: int, vocab: int, max_labels: int) -> list[ScoreRequest]:
    return [ScoreRequest(samples=tuple(_ids(rng, rng.randint(1, 10), vocab) for _ in range(rng.randint(1, 6))),
                         label_ids=_ids(rng, rng.randint(1, max_labels), vocab),
                         prefix_ids=_ids(rng, rng.randint(1, 15), vocab) if rng.random() < 0.6 else (),
                         id=f"s{i}")
            for i in range(n)]


def _assert_same_score(got: ScoreResult, want: ScoreResult) -> None:
    """Byte for byte: on the CPU a request's rows compute with the same shapes and offsets packed as
    alone (attention a block at a time: service/model/layers.py::blockwise_self_attention)."""
    assert isinstance(got, ScoreResult) and isinstance(want, ScoreResult)
    assert [len(r) for r in got.scores] == [len(r) for r in want.scores]
    diff = max(abs(a - b) for ra, rb in zip(got.scores, want.scores) for a, b in zip(ra, rb))
    assert got.scores == want.scores, f"score changed by {diff} with batching/padding"


def _assert_same_beams(got: BeamResult, want: BeamResult, exact: bool = False) -> None:
    assert isinstance(got, BeamResult) and isinstance(want, BeamResult)
    assert len(got.beams) == len(want.beams)
    assert [b.ids for b in got.beams] == [b.ids for b in want.beams]
    diff = max(abs(a.logprob - b.logprob) for a, b in zip(got.beams, want.beams))
    assert diff <= (0.0 if exact else TOL), f"beam score changed by {diff} with batching/padding"


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def m(request):
    return request.getfixturevalue(request.param)


def test_attention_blocks_are_the_ranges_that_see_only_themselves():
    """Against the definition, on random packed Score layouts: a range is closed (no row in it sees a
    key before it; none before it sees one in it) and no smaller closed range splits it."""
    from service.model.layers import attention_blocks
    from service.runtime.batch import NO_CONTEXT
    from service.runtime.nodes import _causal_within

    rng = random.Random(11)
    for _ in range(50):
        seg, ctx, pos = [], [], []  # as pack_score lays requests out
        num_segs = 0
        for r in range(rng.randint(1, 5)):
            prefix, n_prefix = NO_CONTEXT, 0
            if rng.random() < 0.5:
                prefix, n_prefix, num_segs = num_segs, rng.randint(1, 6), num_segs + 1
                seg += [prefix] * n_prefix
                ctx += [NO_CONTEXT] * n_prefix
                pos += list(range(n_prefix))
            for _ in range(rng.randint(1, 4)):
                n = rng.randint(1, 5)
                seg += [num_segs] * n
                ctx += [prefix] * n
                pos += list(range(n_prefix, n_prefix + n))
                num_segs += 1
        pad = rng.randint(0, 6)
        seg += [-1] * pad
        ctx += [NO_CONTEXT] * pad
        pos += [0] * pad
        seg_t, ctx_t, pos_t = torch.tensor(seg), torch.tensor(ctx), torch.tensor(pos)
        mask_self, mask_ctx = _causal_within(pos_t, seg_t), ctx_t.unsqueeze(1) == seg_t.unsqueeze(0)
        vis = (mask_self | mask_ctx).tolist()
        n = len(seg)
        closed = [i for i in range(n + 1)
                  if not any(vis[r][c] for r in range(n) for c in range(n) if (r >= i) != (c >= i))]
        blocks = attention_blocks(mask_self, mask_ctx)
        assert [s for s, _ in blocks] + [n] == closed, (seg, ctx)


# ---- Score ------------------------------------------------------------------------------------

def test_score_alone_equals_in_batch_and_in_a_bigger_bucket(m):
    art, rt = m.artifact, m.runtime
    rng = random.Random(2024)
    reqs = _score_reqs(rng, 7, art.config.vocab_size, art.limits.max_labels)
    alone = [execute(art, rt, [r])[0] for r in reqs]

    together = execute(art, rt, reqs)
    assert len(plan_batches(art, reqs)) == 1
    for got, want in zip(together, alone):
        _assert_same_score(got, want)

    shuffled = list(range(len(reqs)))
    random.Random(5).shuffle(shuffled)
    for i, got in zip(shuffled, execute(art, rt, [reqs[i] for i in shuffled])):
        _assert_same_score(got, alone[i])

    # the same batch padded into a bucket several times larger: far more padding tokens and rows
    # (not the 8192-token one: the reference runtime's dense masks make that one slow on a CPU)
    fit = pick_score_bucket(art.buckets, reqs)
    big = max((b for b in art.buckets.score if b.max_tokens <= max(1024, fit.max_tokens)),
              key=lambda b: (b.max_tokens, b.max_samples))
    assert big.max_tokens >= 2 * fit.max_tokens
    batch = pack_score(reqs, big, art.limits.max_labels)
    for got, want in zip(unpack_score(batch, rt.run_score(batch)), alone):
        _assert_same_score(got, want)


# ---- BeamSearch -------------------------------------------------------------------------------

def test_beam_alone_equals_in_batch_and_in_a_bigger_bucket(m):
    """Requests of different widths and prompt lengths share one batch of packed beam rows (their
    widths' sum, not the widest x requests); each request's answer equals its answer alone byte for
    byte (on the CPU the prompt attention runs a request's rows at a time, and GEMMs of few rows are
    padded: service/model/layers.py), and the batch with far more beam rows and ranks (its prompt
    tokens and request slots kept) gives the batch's very bytes."""
    art, rt = m.artifact, m.runtime
    rng = random.Random(77)
    v = art.config.vocab_size
    shapes = [(7, 12), (2, 40), (16, 3), (1, 25), (9, 1)]
    reqs = [BeamRequest(_ids(rng, n, v), b, 3, id=f"b{i}") for i, (b, n) in enumerate(shapes)]
    alone = [execute(art, rt, [r])[0] for r in reqs]
    for r, res in zip(reqs, alone):
        assert len(res.beams) == r.beam_width and all(len(b.ids) == r.new_tokens for b in res.beams)

    assert len(plan_batches(art, reqs)) == 1
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert bucket.max_requests > len(reqs), "meant to include a padding request slot"
    assert sum(r.beam_width for r in reqs) < bucket.max_rows < len(reqs) * bucket.beam_width, \
        "packed rows: the widths' sum, padded to a tier, below requests x the widest"
    together = execute(art, rt, reqs)
    for i, (got, want) in enumerate(zip(together, alone)):
        _assert_same_beams(got, want, exact=True)

    # the largest bucket's rows and width for this T (400 beams per request), the batch's prompt tokens
    big = max((b for b in art.buckets.beam if b.new_tokens == 3),
              key=lambda b: (b.max_rows, b.max_prompt_tokens, b.beam_width))
    assert big.beam_width == art.limits.max_beam_width
    batch = pack_beam(reqs, BeamBucket(3, bucket.max_requests, bucket.max_prompt_tokens, big.beam_width,
                                       big.max_rows))
    seqs, scores = rt.run_beam(batch)
    for got, want in zip(unpack_beam(batch, seqs, scores), together):
        _assert_same_beams(got, want, exact=True)


def test_narrow_beam_is_masked_in_a_wider_bucket(m):
    art, rt = m.artifact, m.runtime
    rng = random.Random(303)
    v = art.config.vocab_size
    narrow = BeamRequest(_ids(rng, 9, v), 3, 4, id="narrow")
    wide = BeamRequest(_ids(rng, 20, v), 16, 4, id="wide")
    alone = execute(art, rt, [narrow])[0]
    assert pick_beam_bucket(art.buckets, [narrow]).beam_width < 16

    # co-batched with a B=16 request: the bookkeeping is 16 wide, the rows 3 + 16 (padded)
    bucket = pick_beam_bucket(art.buckets, [narrow, wide])
    assert bucket.beam_width >= 16
    got_narrow, got_wide = execute(art, rt, [narrow, wide])
    assert len(got_narrow.beams) == 3
    _assert_same_beams(got_narrow, alone)
    _assert_same_beams(got_wide, execute(art, rt, [wide])[0])

    # alone, but forced into a 16-wide bucket of more rows (its prompt tokens and request slots kept:
    # the CPU GEMM of the prefill's LM head rounds by its row count): the same bytes
    own = pick_beam_bucket(art.buckets, [narrow])
    batch = pack_beam([narrow], BeamBucket(4, own.max_requests, own.max_prompt_tokens, 16, 16 * own.max_requests))
    seqs, scores = rt.run_beam(batch)
    (res,) = unpack_beam(batch, seqs, scores)
    assert len(res.beams) == 3
    _assert_same_beams(res, alone, exact=True)
    # the masked beam slots never outrank a live one
    assert all(s == float("-inf") for s in scores[0, 3:].tolist())


def test_beams_between_128_and_256_wide_share_a_256_wide_bucket_of_their_own_rows(m):
    """Three requests 150-240 wide (the default table's middle width tier): their batch runs in a
    256-wide bucket of no more rows than the tier above their widths' sum, not in a 400-wide one of
    more, and each request's answer equals its answer alone byte for byte."""
    art, rt = m.artifact, m.runtime
    rng = random.Random(256)
    v = art.config.vocab_size
    reqs = [BeamRequest(_ids(rng, n, v), b, 3, id=f"m{i}") for i, (b, n) in enumerate([(150, 9), (200, 20), (240, 30)])]
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert bucket.beam_width == 256 and sum(r.beam_width for r in reqs) <= bucket.max_rows <= 640, bucket
    alone = [execute(art, rt, [r])[0] for r in reqs]
    for got, want in zip(execute(art, rt, reqs), alone):
        _assert_same_beams(got, want, exact=True)


# ---- plan_batches -----------------------------------------------------------------------------

def _request_strategy(vocab: int, lim):
    score = st.builds(
        lambda samples, prefix, labels: ScoreRequest(samples=samples, prefix_ids=prefix, label_ids=labels),
        st.lists(st.integers(1, 8).map(lambda n: (1,) * n), min_size=1, max_size=lim.max_samples)
          .map(tuple),
        st.integers(0, 60).map(lambda n: (2,) * n),
        st.just((3,)),
    ).filter(lambda r: r.num_tokens <= lim.max_score_tokens)
    beam = st.builds(lambda n, b, t: BeamRequest(prompt_ids=(4,) * n, beam_width=b, new_tokens=t),
                     st.integers(1, lim.max_prompt_tokens),
                     st.sampled_from([1, 2, 3, 4, 5, 16, 17, 64, 100, 128, 300, lim.max_beam_width]),
                     st.integers(1, lim.max_new_tokens))
    return st.lists(st.one_of(score, beam), min_size=1, max_size=60)


@pytest.fixture(scope="module")
def plan_artifact(qwen2_tiny):
    return qwen2_tiny.artifact


def test_plan_batches_property(plan_artifact):
    art = plan_artifact
    lim = art.limits

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(_request_strategy(art.config.vocab_size, lim))
    def check(reqs):
        batches = plan_batches(art, reqs)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(reqs))), "every request exactly once, none split"
        for b in batches:
            assert b, "empty batch"
            group = [reqs[i] for i in b]
            if isinstance(group[0], ScoreRequest):
                assert all(isinstance(r, ScoreRequest) for r in group)
                bucket = pick_score_bucket(art.buckets, group)
                assert bucket is not None and len(group) <= bucket.max_requests
                assert sum(r.num_tokens for r in group) <= bucket.max_tokens
                assert sum(r.num_samples for r in group) <= bucket.max_samples
            else:
                assert all(isinstance(r, BeamRequest) for r in group)
                bucket = pick_beam_bucket(art.buckets, group)
                assert bucket is not None
                # requests of different new_tokens share a batch, which runs its longest one's steps
                assert isinstance(bucket, BeamBucket) and bucket.new_tokens == max(r.new_tokens for r in group)
                assert max(r.beam_width for r in group) <= bucket.beam_width
                assert len(group) <= bucket.max_requests
                assert sum(len(r.prompt_ids) for r in group) <= bucket.max_prompt_tokens
                assert sum(r.beam_width for r in group) <= bucket.max_rows

    check()


def test_plan_batches_many_small_requests_share_batches(plan_artifact):
    """Batching actually happens: 300 small Score requests do not run one by one."""
    art = plan_artifact
    rng = random.Random(8)
    reqs = _score_reqs(rng, 300, art.config.vocab_size, art.limits.max_labels)
    batches = plan_batches(art, reqs)
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert len(batches) < 300 // 4
    for b in batches:
        assert isinstance(pick_score_bucket(art.buckets, [reqs[i] for i in b]), ScoreBucket)


def test_bucket_wider_than_the_vocabulary(tmp_path, hf_ref):
    """A small-vocabulary model (V=200): a B=150 request is within the limits and narrower than V; the
    default tiers would put it in a 256-wide bucket, wider than V. The limits and bucket table are capped
    at V, so it is answered (or refused cleanly, naming beam_width), and the other requests of the same
    call are answered either way."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from service.artifact.artifact import build_artifact, load_artifact
    from service.runtime.python_runtime import PythonRuntime
    from service.runtime.requests import RequestError

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=0.3)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "ckpt")
    art = load_artifact(build_artifact(str(tmp_path / "ckpt"), tmp_path / "art", quiet=True))
    rt = PythonRuntime(art)
    score = ScoreRequest(samples=((1, 2, 3), (4,)), label_ids=(5, 6))
    beam = BeamRequest(prompt_ids=(7, 8, 9, 10), beam_width=150, new_tokens=2)
    assert beam.beam_width <= art.limits.max_beam_width and beam.beam_width < cfg.vocab_size
    assert art.limits.max_beam_width <= cfg.vocab_size
    assert all(b.beam_width <= cfg.vocab_size for b in art.buckets.beam)

    res_score, res_beam = execute(art, rt, [score, beam])
    _assert_same_score(res_score, execute(art, rt, [score])[0])
    if isinstance(res_beam, RequestError):
        assert "beam_width" in str(res_beam)
        return
    assert isinstance(res_beam, BeamResult) and len(res_beam.beams) == 150
    want_ids, want_scores = hf_ref.beam(model, list(beam.prompt_ids), 150, 2)
    assert [b.ids for b in res_beam.beams[:20]] == want_ids[:20]
    assert max(abs(b.logprob - s) for b, s in zip(res_beam.beams, want_scores)) <= 1e-4


# ---- Score requests packed back to back -----------------------------------------------------

def test_pack_score_lays_the_requests_back_to_back() -> None:
    bucket = ScoreBucket(max_tokens=64, max_samples=8, max_requests=4)
    assert bucket.key == "score.t64.s8.r4"
    reqs = [ScoreRequest(samples=((5, 6), (7,)), label_ids=(1,), prefix_ids=(1, 2, 3)),
            ScoreRequest(samples=((8, 9, 10, 11),), label_ids=(2, 3))]
    batch = pack_score(reqs, bucket, num_labels=2)
    x = {k: v.tolist() for k, v in batch.inputs.items()}
    assert len(x["tokens"]) == 64 and x["request_rows"] == [0, 6, 10, 10, 64] and x["prefix_rows"] == [3, 0, 0, 0]
    assert x["tokens"][:10] == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11]
    assert x["positions"][:10] == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3]
    assert x["seg"][:10] == [0, 0, 0, 1, 1, 2, 3, 3, 3, 3]
    assert x["ctx"][:10] == [-2, -2, -2, 0, 0, 0, -2, -2, -2, -2]
    assert all(x["seg"][i] == -1 and x["tokens"][i] == 0 and x["positions"][i] == 0 for i in range(10, 64))
    assert x["last"] == [4, 5, 9, 0, 0, 0, 0, 0]
    assert x["labels"][:3] == [[1, 0], [1, 0], [2, 3]]


def _pack_score_by_rows(reqs: list[ScoreRequest], bucket: ScoreBucket, num_labels: int) -> dict[str, list]:
    """pack_score's contract written out a row at a time (the reference for its run-based packing)."""
    pad_row = (0, 0, -1, -2)
    rows, last, labels, starts, prefixes, seg = [], [], [], [], [], 0
    for req in reqs:
        starts.append(len(rows))
        prefixes.append(len(req.prefix_ids))
        prefix_seg = -2
        if req.prefix_ids:
            prefix_seg, seg = seg, seg + 1
            rows += [(t, p, prefix_seg, -2) for p, t in enumerate(req.prefix_ids)]
        for sample in req.samples:
            rows += [(t, len(req.prefix_ids) + p, seg, prefix_seg) for p, t in enumerate(sample)]
            seg += 1
            last.append(len(rows) - 1)
            labels.append(list(req.label_ids) + [0] * (num_labels - len(req.label_ids)))
    used, pad_r = len(rows), bucket.max_requests - len(reqs)
    rows += [pad_row] * (bucket.max_tokens - len(rows))
    pad_s = bucket.max_samples - len(last)
    cols = list(zip(*rows))
    return {"tokens": list(cols[0]), "positions": list(cols[1]), "seg": list(cols[2]), "ctx": list(cols[3]),
            "request_rows": starts + [used] * pad_r + [bucket.max_tokens], "prefix_rows": prefixes + [0] * pad_r,
            "last": last + [0] * pad_s, "labels": labels + [[0] * num_labels] * pad_s}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 4))
def test_pack_score_equals_its_row_by_row_contract(seed: int, num_requests: int) -> None:
    rng = random.Random(seed)
    reqs = _score_reqs(rng, num_requests, 1000, 4)
    for i, r in enumerate(reqs):  # empty samples too: a sample's last row is then the row before it
        if rng.random() < 0.2:
            reqs[i] = ScoreRequest(samples=r.samples + ((),), label_ids=r.label_ids, prefix_ids=r.prefix_ids)
    r_max = num_requests + rng.randint(0 if num_requests else 1, 2)
    bucket = ScoreBucket(max_tokens=sum(r.num_tokens for r in reqs) + rng.randint(0 if reqs else 1, 9),
                         max_samples=sum(r.num_samples for r in reqs) + rng.randint(0, 3) or 1, max_requests=r_max)
    got = {k: v.tolist() for k, v in pack_score(reqs, bucket, 4).inputs.items()}
    assert got == _pack_score_by_rows(reqs, bucket, 4)
    assert all(v.dtype == torch.int64 for v in pack_score(reqs, bucket, 4).inputs.values())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 4))
def test_pack_beam_equals_its_row_by_row_contract(seed: int, num_requests: int) -> None:
    rng = random.Random(seed)
    width, r_max = rng.randint(1, 6), num_requests + rng.randint(0 if num_requests else 1, 2)
    reqs = [BeamRequest(prompt_ids=_ids(rng, rng.randint(1, 9), 1000), beam_width=rng.randint(1, width), new_tokens=3)
            for _ in range(num_requests)]
    n_max = sum(len(r.prompt_ids) for r in reqs) + rng.randint(0 if num_requests else 1, 4)
    rows = max(width, sum(r.beam_width for r in reqs) + rng.randint(0, 5))
    bucket = BeamBucket(max_requests=r_max, beam_width=width, max_prompt_tokens=n_max, new_tokens=3,
                        max_rows=min(rows, r_max * width))
    got = {k: v.tolist() for k, v in pack_beam(reqs, bucket).inputs.items()}
    prompts = [list(r.prompt_ids) for r in reqs]
    pad_n, pad_r = n_max - sum(map(len, prompts)), r_max - num_requests
    assert got["tokens"] == [t for p in prompts for t in p] + [0] * pad_n
    assert got["positions"] == [i for p in prompts for i in range(len(p))] + [0] * pad_n
    assert got["seg"] == [r for r, p in enumerate(prompts) for _ in p] + [-1] * pad_n
    assert got["beam_width"] == [r.beam_width for r in reqs] + [0] * pad_r
    assert got["beam_seqs"] == [[[0] * 3] * width] * r_max
    # decode rows: each request's own width of rows back to back, (request, rank) each; then padding
    packed = [(r, p) for r, req in enumerate(reqs) for p in range(req.beam_width)]
    pad_rows = bucket.max_rows - len(packed)
    assert got["beam_req"] == [r for r, _ in packed] + [r_max] * pad_rows  # request R: no prompt
    assert got["beam_pos"] == [len(prompts[r]) for r, _ in packed] + [0] * pad_rows  # the prompt's end
    assert got["beam_slot"] == [r * width + p for r, p in packed] + [r_max * width] * pad_rows
    assert got["beam_src"] == [packed.index((r, p)) if (r, p) in packed else bucket.max_rows
                               for r in range(r_max) for p in range(width)]


def test_packing_runs_no_torch_op_that_fans_out_over_threads(monkeypatch) -> None:
    """Packing runs on the event loop for every batch. torch.repeat_interleave on the CPU splits even
    a few thousand rows over every intra-op thread: on the 16-core H200 host each call took ~1.4 ms
    of the loop (3 a W1 batch, half the loop's CPU in a profile). Packing must not call it."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.repeat_interleave on the packing path")

    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    rng = random.Random(3)
    reqs = _score_reqs(rng, 3, 1000, 2)
    bucket = ScoreBucket(max_tokens=512, max_samples=32, max_requests=4)
    assert pack_score(reqs, bucket, 2).inputs["seg"].shape == (512,)
    beams = [BeamRequest(prompt_ids=_ids(rng, 5, 1000), beam_width=4, new_tokens=2) for _ in range(2)]
    assert pack_beam(beams, BeamBucket(max_requests=4, beam_width=4, max_prompt_tokens=16, new_tokens=2, max_rows=10)
                     ).inputs["beam_req"].tolist() == [0] * 4 + [1] * 4 + [4] * 2


def test_pack_score_refuses_what_does_not_fit_its_bucket() -> None:
    bucket = ScoreBucket(max_tokens=16, max_samples=4, max_requests=2)
    one = ScoreRequest(samples=((1,) * 5,), label_ids=(1,))
    with pytest.raises(ValueError, match="batch of 3 requests does not fit score.t16.s4.r2"):
        pack_score([one] * 3, bucket, 1)
    with pytest.raises(ValueError, match="batch of 17 tokens does not fit"):
        pack_score([ScoreRequest(samples=((1,) * 8, (2,) * 9), label_ids=(1,))], bucket, 1)
    with pytest.raises(ValueError, match="batch of 5 samples does not fit"):
        pack_score([ScoreRequest(samples=((1,),) * 5, label_ids=(1,))], bucket, 1)
    table = BucketTable((bucket,), (BeamBucket(1, 1, 8, 1, 1),))
    assert pick_score_bucket(table, [one] * 3) is None  # three requests, two slots
    assert pick_score_bucket(table, [ScoreRequest(samples=((1,) * 17,), label_ids=(1,))]) is None
    assert pick_score_bucket(table, [one, one]) == bucket  # 10 tokens, whatever the longest


def test_default_score_buckets_are_bounded_by_total_tokens(plan_artifact) -> None:
    """The default tiers: total tokens in quarter octaves (a batch pads at most a quarter of its
    rows above 256 tokens), each with a few-samples and a many-samples tier; the smallest bucket
    that holds a batch's total tokens and samples is the one it runs in."""
    lim = plan_artifact.limits
    table = plan_artifact.buckets
    tiers = sorted({b.max_tokens for b in table.score})
    assert tiers == token_tiers(64, max(8192, lim.max_score_tokens))
    assert all(hi <= lo * 1.25 for lo, hi in zip(tiers, tiers[1:]) if lo >= 256)
    assert any(b.holds(1, lim.max_score_tokens, lim.max_samples) for b in table.score)
    # 3 requests of 100 tokens: 300 tokens run in 320 rows, not 3 blocks of 128 (384)
    reqs = [ScoreRequest(samples=((1,) * 50, (2,) * 50), label_ids=(1,))] * 3
    assert pick_score_bucket(table, reqs).max_tokens == 320
    # a 1,100-token request beside a 60-token one: 1,160 tokens in 1,280 rows (was 2 x 2,048)
    reqs = [ScoreRequest(samples=((1,) * 1100,), label_ids=(1,)), ScoreRequest(samples=((1,) * 60,), label_ids=(1,))]
    assert pick_score_bucket(table, reqs).max_tokens == 1280


def _brute_force_pick(table: BucketTable, reqs: list) -> object:
    """The least padded bucket of the kind that holds the batch, by trying every bucket."""
    if isinstance(reqs[0], ScoreRequest):
        fits = [b for b in table.score if b.holds(len(reqs), sum(r.num_tokens for r in reqs),
                                                   sum(r.num_samples for r in reqs))]
        return min(fits, key=lambda b: (b.max_tokens, b.max_samples), default=None)
    fits = [b for b in table.beam if max(r.new_tokens for r in reqs) <= b.new_tokens
            and b.holds(len(reqs), sum(len(r.prompt_ids) for r in reqs), max(r.beam_width for r in reqs),
                        sum(r.beam_width for r in reqs), max(r.new_tokens for r in reqs), ANY_STEPS)]
    return min(fits, key=lambda b: (b.max_rows * b.new_tokens, b.max_rows, b.max_prompt_tokens, b.beam_width,
                                    b.max_requests), default=None)


def test_every_batch_runs_in_the_least_padded_bucket_that_holds_it(plan_artifact) -> None:
    """pick_score_bucket / pick_beam_bucket (buckets.Fill, the one answer the packer, the batcher,
    the cost table and plan_batches share) equal a brute-force search over the whole table."""
    table, lim, rng = plan_artifact.buckets, plan_artifact.limits, random.Random(11)
    for _ in range(300):
        if rng.random() < 0.5:
            reqs = [ScoreRequest(samples=tuple((1,) * rng.randint(1, 160) for _ in range(rng.randint(1, 30))),
                                 label_ids=(1,), prefix_ids=(2,) * rng.choice([0, rng.randint(1, 256)]))
                    for _ in range(rng.randint(1, 12))]
            reqs = [r for r in reqs if r.num_tokens <= lim.max_score_tokens and r.num_samples <= lim.max_samples]
            got = pick_score_bucket(table, reqs) if reqs else None
        else:
            reqs = [BeamRequest(prompt_ids=(1,) * rng.randint(1, lim.max_prompt_tokens),
                                beam_width=rng.randint(1, lim.max_beam_width),
                                new_tokens=rng.randint(1, lim.max_new_tokens))  # a batch's may differ
                    for _ in range(rng.randint(1, 6))]
            got = pick_beam_bucket(table, reqs)
        if reqs:
            assert got == _brute_force_pick(table, reqs)


def test_unpacked_beam_results_keep_their_own_rows_and_equal_the_eager_beams() -> None:
    """unpack_beam hands each request its own copy of its output rows (the runtime may reuse its
    buffers) and makes Python beams only when asked; they equal beams read eagerly."""
    from service.runtime.batch import unpack_beam
    from service.runtime.requests import Beam

    bucket = BeamBucket(new_tokens=3, max_requests=4, max_prompt_tokens=64, beam_width=8, max_rows=20)
    reqs = [BeamRequest(prompt_ids=(1, 2), beam_width=w, new_tokens=3) for w in (8, 2, 5)]
    batch = pack_beam(reqs, bucket)
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, 1000, (4, 8, 3), generator=g)
    scores = -torch.rand(4, 8, generator=g) * 20
    results = unpack_beam(batch, seqs, scores)
    eager = [BeamResult([Beam(ids, lp) for ids, lp in zip(seqs[r, :q.beam_width].tolist(),
                                                          scores[r, :q.beam_width].tolist())])
             for r, q in enumerate(reqs)]
    seqs.zero_()  # the runtime reuses its output buffer for the next batch
    scores.zero_()
    assert results == eager and [len(r.beams) for r in results] == [8, 2, 5]
    assert all(r.rows is not None and r.rows[0].shape == (q.beam_width, 3) for r, q in zip(results, reqs))
    assert results[0] != eager[1] and repr(results[1]).startswith("BeamResult(beams=[Beam(ids=")
    with pytest.raises(ValueError, match="beams or its output rows"):
        BeamResult()
