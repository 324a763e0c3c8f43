"""Normalising a constrained BeamSearch over its catalog's code tokens only (issue 28, point 5: a
code-vocabulary LM head). BeamRequest.normalization "codes": the LM head computes the catalog's
code tokens' rows alone and the beam step runs over those columns; the result equals Hugging Face's
generate(prefix_allowed_tokens_fn=<the trie>) with every logit outside the catalog's codes at -inf
(float32, CPU, tiny random checkpoints), on both runtimes, byte-identical between them. "vocab" (the
default) is unchanged: tests/service/test_catalog_beam.py."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from service.artifact.artifact import build_artifact, load_artifact
from service.runtime.batch import code_columns, kind, pack_beam, pick_bucket
from service.runtime.cpp_runtime import CppRuntime, _footprint
from service.runtime.engine import execute, plan_batches
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, BeamResult, RequestError

from tests.service.test_catalog_beam import (CATALOGS, VOCAB, catalog_items, check_against_hf,  # noqa: F401
                                             constrained, write_catalog)


@contextlib.contextmanager
def code_vocabulary(model, items: dict[str, tuple[int, ...]]):
    """Hugging Face's model with the logits of every token outside the catalog's codes at -inf: its
    log-softmax is then over the codes only."""
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[sorted({t for code in items.values() for t in code})] = True
    head = model.get_output_embeddings()
    handle = head.register_forward_hook(lambda mod, args, out: out.masked_fill(~keep, float("-inf")))
    try:
        yield
    finally:
        handle.remove()


def _req(rng: random.Random, beams: int, catalog: str, normalization: str = "codes", i: int = 0) -> BeamRequest:
    return BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))), beams, CATALOGS[catalog][0],
                       id=f"{normalization}{i}", catalog=catalog, normalization=normalization)


CASES = [(1, "l3"), (4, "few3"), (8, "l2"), (16, "l3"), (24, "l4"), (64, "l2"), (33, "l1"),
         (200, "l3")]  # more beams than the catalog has code tokens (48): columns padded to the width


@pytest.mark.parametrize("beams,catalog", CASES, ids=[f"B{b}-{c}" for b, c in CASES])
def test_codes_normalization_equals_hf_over_the_codes(constrained, catalog_items, beams, catalog):
    m, art, runtime = constrained
    req = _req(random.Random(f"{beams}-{catalog}"), beams, catalog)
    (res,) = execute(art, runtime, [req])
    with code_vocabulary(m.hf, catalog_items[catalog]):
        check_against_hf(m, req, res, catalog_items[catalog])


def test_both_normalizations_side_by_side(constrained, catalog_items):
    """Requests of two catalogs, each normalised both ways, and an unconstrained one, executed together:
    one batch per catalog normalised over its codes, and one for the rest; each answer its oracle's,
    and a step's log-prob over the codes never below the same step's over the vocabulary."""
    m, art, runtime = constrained
    rng = random.Random(7)
    reqs = [_req(rng, 6, "l3", "codes", 0), _req(rng, 6, "l3", "vocab", 1), _req(rng, 5, "l2", "codes", 2),
            BeamRequest((3, 1, 4), 4, 3, id="free"), _req(rng, 6, "l3", "codes", 3)]
    batches = [{kind(reqs[i]) for i in batch} for batch in plan_batches(art, reqs)]
    assert all(len(b) == 1 for b in batches), batches  # a batch normalised over codes holds one catalog's only
    assert {k for b in batches for k in b} == {"beam.n3.codes-l3", "beam.n2.codes-l2", "beam"}
    results = execute(art, runtime, reqs)
    for req, res in zip(reqs, results):
        assert isinstance(res, BeamResult), res
        if not req.catalog:
            assert all(b.item_id is None for b in res.beams)
            continue
        items = catalog_items[req.catalog]
        context = code_vocabulary(m.hf, items) if req.normalization == "codes" else contextlib.nullcontext()
        with context:
            check_against_hf(m, req, res, items)
    # the same prompt both ways: over a subset of the vocabulary, an item's log-prob is higher
    same = BeamRequest(reqs[0].prompt_ids, 6, 3, catalog="l3")
    (vocab,) = execute(art, runtime, [same])
    by_item = {b.item_id: b.logprob for b in vocab.beams}
    assert all(b.logprob > by_item[b.item_id] for b in results[0].beams if b.item_id in by_item)


def test_the_runtimes_agree_byte_for_byte(constrained, catalog_items):
    _, art, runtime = constrained
    rng = random.Random(3)
    reqs = [_req(rng, b, "l3", i=i) for i, b in enumerate((7, 1, 16))]
    batch = pack_beam(reqs, pick_bucket(art.buckets, reqs), art.catalogs)
    assert batch.bucket.key.endswith(".codes-l3") and batch.inputs["beam_codes"].shape[0] % 128 == 0
    cpp = CppRuntime(art)
    try:
        py_out, cpp_out = runtime.run_beam(batch), cpp.run_beam(batch)
    finally:
        cpp.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(py_out, cpp_out))
    codes = set(art.catalogs[[c.name for c in art.catalogs].index("l3")].code_tokens.tolist())
    assert set(py_out[0][:3].flatten().tolist()) <= codes | {0}  # the columns were mapped back to token ids


def test_codes_needs_a_catalog_and_a_known_name(constrained):
    _, art, runtime = constrained
    no_catalog, unknown = execute(art, runtime, [BeamRequest((1, 2), 2, 3, normalization="codes"),
                                                 BeamRequest((1, 2), 2, 3, catalog="l3", normalization="logits")])
    assert isinstance(no_catalog, RequestError) and no_catalog.field == "normalization"
    assert isinstance(unknown, RequestError) and unknown.field == "normalization" and "logits" in str(unknown)


@pytest.mark.parametrize("constrained", ["qwen2_tiny"], indirect=True)  # the interpreter is slow: one checkpoint
def test_fused_path_finds_what_the_aten_path_finds(constrained):
    """kernels="triton" (Triton's interpreter on a CPU): the beam kernels over the code columns (their
    bitmask [rows, C / 32]) find the ATen path's beams, the scores within float rounding."""
    _, art, runtime = constrained
    fused = PythonRuntime(art, kernels="triton")
    rng = random.Random(13)
    reqs = [_req(rng, b, "l3", i=i) for i, b in enumerate((5, 2, 9))]
    batch = pack_beam(reqs, pick_bucket(art.buckets, reqs), art.catalogs)
    (seqs, scores), (f_seqs, f_scores) = runtime.run_beam(batch), fused.run_beam(batch)
    for r, req in enumerate(reqs):
        w = req.beam_width
        assert torch.equal(seqs[r, :w], f_seqs[r, :w]), f"request {r}: beams differ on the fused path"
        assert (scores[r, :w] - f_scores[r, :w]).abs().max() <= 1e-5


def test_an_fp8_head_narrows_to_the_codes_alike_in_both_runtimes(constrained, catalog_items, tmp_path):
    """`slmrank build --fp8 mlp,attn,head` with catalogs: the e4m3 head's rows and their scales are
    narrowed to the codes together (a scale left whole would pair rows with other rows' scales), the
    runtimes agree byte for byte, and the codes answers stay valid items."""
    m, plain, _ = constrained
    files = {}
    for name, items in catalog_items.items():
        files[name] = tmp_path / f"{name}.tsv"
        write_catalog(files[name], items)
    art = load_artifact(build_artifact(str(m.ckpt), tmp_path / "art", quiet=True, catalogs=files,
                                       fp8=("mlp", "attn", "head")))
    assert art.load_weights()["lm_head"].dtype == torch.float8_e4m3fn
    rng = random.Random(5)
    reqs = [_req(rng, b, "l3", i=i) for i, b in enumerate((7, 1, 16))]
    batch = pack_beam(reqs, pick_bucket(art.buckets, reqs), art.catalogs)
    cpp = CppRuntime(art)
    try:
        py_out, cpp_out = PythonRuntime(art).run_beam(batch), cpp.run_beam(batch)
    finally:
        cpp.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(py_out, cpp_out))
    got = execute(art, PythonRuntime(art), reqs)
    items = set(catalog_items["l3"].values())
    for res in got:
        assert isinstance(res, BeamResult) and res.beams
        assert all(tuple(b.ids) in items for b in res.beams)
    base = execute(plain, PythonRuntime(plain), reqs)
    assert [[b.logprob for b in r.beams] for r in got] != [[b.logprob for b in r.beams] for r in base]  # e4m3 ran


def test_start_up_capture_takes_the_codes_buckets_too(constrained):
    """CppRuntime.capture_buckets (what `slmrank serve` captures before SERVING): the table's Score and
    BeamSearch buckets, and each catalog's code-normalised ones (every beam bucket of its code length
    again), each once, largest first. (The capture itself is the GPU's: tests/e2e/test_catalog_gpu.py.)"""
    _, art, _ = constrained
    cpp = CppRuntime(art)
    try:
        keys = [b.key for b in cpp.capture_buckets()]
        assert cpp.capture(quiet=True) == []  # no graphs on the CPU
    finally:
        cpp.shutdown()
    plain = {b.key for b in (*art.buckets.score, *art.buckets.beam)}
    codes = {f"{b.key}.codes-{name}" for name, length in art.buckets.codes for b in art.buckets.beam
             if b.new_tokens == length}
    assert codes and len(keys) == len(set(keys)) and set(keys) == plain | codes
    # a codes bucket's logits are its catalog's code columns (at least its beam width), not the
    # vocabulary: a footprint no larger than its plain twin's, and captured after it
    twins = {b.key: b for b in art.buckets.beam}
    catalogs = {c.name: c for c in art.catalogs}
    for kind, buckets in art.buckets.kinds.items():
        for b in (b for b in buckets if ".codes-" in kind):
            twin = twins[b.key.split(".codes-")[0]]
            columns = len(code_columns(catalogs[b.catalog], b.beam_width))
            assert b.beam_width <= columns and columns % 128 == 0
            assert _footprint(b, art.config, columns) <= _footprint(twin, art.config)
            assert keys.index(b.key) > keys.index(twin.key)
