"""Catalog-constrained BeamSearch (issue 28): only catalog items come back, exactly as Hugging Face's
generate(num_beams=B, prefix_allowed_tokens_fn=<the same trie>) finds them (float32, CPU, tiny
random checkpoints: conftest.py), with fewer beams when the catalog has fewer items than B."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from service.artifact.artifact import build_artifact, load_artifact
from service.runtime.batch import pack_beam, pick_beam_bucket
from service.runtime.engine import execute, plan_batches
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, BeamResult, RequestError
from service.siblings import sibling

allowed_bitmask = sibling("kernels.beam_topk").allowed_bitmask

TOL = 1e-4
VOCAB = 512
# name -> (code length, items, distinct code tokens per level)
CATALOGS = {"l1": (1, 5, 40), "l2": (2, 40, 12), "l3": (3, 300, 16), "l4": (4, 20, 6), "few3": (3, 3, 9)}


def random_catalog(rng: random.Random, length: int, num_items: int, per_level: int) -> dict[str, tuple[int, ...]]:
    levels = [rng.sample(range(VOCAB), per_level) for _ in range(length)]
    codes: set[tuple[int, ...]] = set()
    while len(codes) < num_items:
        codes.add(tuple(rng.choice(level) for level in levels))
    return {f"item-{i}": code for i, code in enumerate(sorted(codes, key=lambda _: rng.random()))}


def write_catalog(path, items: dict[str, tuple[int, ...]]) -> None:
    path.write_text("".join(f"{k}\t{' '.join(map(str, v))}\n" for k, v in items.items()))


@pytest.fixture(scope="module")
def catalog_items() -> dict[str, dict[str, tuple[int, ...]]]:
    rng = random.Random(28)
    return {name: random_catalog(rng, *spec) for name, spec in CATALOGS.items()}


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def constrained(request, tmp_path_factory, catalog_items):
    """(TinyModel, its artifact with every catalog, a Python runtime over it)."""
    m = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp(f"catalogs_{request.param}")
    files = {}
    for name, items in catalog_items.items():
        files[name] = root / f"{name}.tsv"
        write_catalog(files[name], items)
    art = load_artifact(build_artifact(str(m.ckpt), root / "art", quiet=True, catalogs=files))
    return m, art, PythonRuntime(art)


def allowed_fn(prompt_len: int, items: dict[str, tuple[int, ...]]):
    """The same trie as Hugging Face's prefix_allowed_tokens_fn; a dead beam (-inf, an invalid
    prefix) may take any token (its candidates stay -inf), as an empty list is an error there."""
    nexts: dict[tuple[int, ...], set[int]] = {}
    for code in items.values():
        for i in range(len(code)):
            nexts.setdefault(code[:i], set()).add(code[i])
    every = list(range(VOCAB))
    return lambda batch_id, ids: sorted(nexts.get(tuple(ids[prompt_len:].tolist()), every))


@torch.no_grad()
def hf_constrained(model, prompt: list[int], beams: int, new_tokens: int, items) -> list[tuple[list[int], float]]:
    gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=beams, num_return_sequences=beams, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, length_penalty=0.0, early_stopping=False,
                         eos_token_id=None, pad_token_id=0, output_scores=True, output_logits=True,
                         return_dict_in_generate=True, prefix_allowed_tokens_fn=allowed_fn(len(prompt), items))
    seqs = gen.sequences[:, len(prompt):].tolist()
    if beams > 1:
        scores = gen.sequences_scores.float().tolist()
    else:  # greedy: its scores are the masked logits; the log-prob is of the full vocabulary's softmax
        scores = [sum(torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(gen.logits, seqs[0]))]
    # fewer valid sequences than beams: HF fills the rest: -inf beams, unfinished ones (pad -1 where no
    # candidate was left), and copies of live beams descended from its initial beams 1..B-1, whose
    # score starts at -1e9 rather than -inf; only items above that are compared
    codes = set(items.values())
    return [(s, sc) for s, sc in zip(seqs, scores) if sc > -1e8 and tuple(s) in codes]


def check_against_hf(m, req: BeamRequest, res, items) -> None:
    assert isinstance(res, BeamResult), res
    want = hf_constrained(m.hf, list(req.prompt_ids), req.beam_width, req.new_tokens, items)
    got = res.beams
    assert len(got) == min(req.beam_width, len(items))
    assert [b.ids for b in got] == [ids for ids, _ in want], f"B={req.beam_width} {req.catalog}: beams differ from HF"
    diff = max(abs(b.logprob - s) for b, (_, s) in zip(got, want))
    assert diff <= TOL, f"B={req.beam_width} {req.catalog}: log-probs differ from HF by {diff}"
    by_code = {code: k for k, code in items.items()}
    assert [b.item_id for b in got] == [by_code[tuple(b.ids)] for b in got]


CASES = [(1, "l3"), (2, "l1"), (4, "few3"), (8, "l2"), (16, "l3"), (24, "l4"), (64, "l2"), (64, "few3"), (33, "l1")]


@pytest.mark.parametrize("beams,catalog", CASES, ids=[f"B{b}-{c}" for b, c in CASES])
def test_constrained_beams_equal_hf_prefix_allowed_tokens(constrained, catalog_items, beams, catalog):
    m, art, runtime = constrained
    rng = random.Random(f"{beams}-{catalog}")
    req = BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))), beams,
                      CATALOGS[catalog][0], catalog=catalog)
    (res,) = execute(art, runtime, [req])
    check_against_hf(m, req, res, catalog_items[catalog])


def test_mixed_batch_of_catalogs_and_unconstrained(constrained, catalog_items, hf_ref):
    m, art, runtime = constrained
    rng = random.Random(5)
    reqs = [BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(n)), b, 3, id=f"r{i}", catalog=c)
            for i, (n, b, c) in enumerate([(7, 16, "l3"), (3, 5, ""), (11, 6, "few3"), (2, 9, "l3")])]
    assert len(plan_batches(art, reqs)) == 1, "the requests were meant to share one batch"
    for req, res in zip(reqs, execute(art, runtime, reqs)):
        if req.catalog:
            check_against_hf(m, req, res, catalog_items[req.catalog])
        else:
            want_ids, want_scores = hf_ref.beam(m.hf, list(req.prompt_ids), req.beam_width, req.new_tokens)
            assert [b.ids for b in res.beams] == want_ids and all(b.item_id is None for b in res.beams)
            assert max(abs(b.logprob - s) for b, s in zip(res.beams, want_scores)) <= TOL


def test_every_returned_beam_is_an_item(constrained, catalog_items):
    """Validity over many random constrained requests, batched as they come."""
    _, art, runtime = constrained
    rng = random.Random(99)
    names = list(CATALOGS)
    reqs = []
    for i in range(60):
        name = rng.choice(names)
        reqs.append(BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))),
                                rng.randint(1, 40), CATALOGS[name][0], id=str(i), catalog=name))
    for req, res in zip(reqs, execute(art, runtime, reqs)):
        items = catalog_items[req.catalog]
        assert isinstance(res, BeamResult), res
        assert len(res.beams) == min(req.beam_width, len(items))
        for beam in res.beams:
            assert items[beam.item_id] == tuple(beam.ids)
        scores = [b.logprob for b in res.beams]
        assert scores == sorted(scores, reverse=True) and all(np.isfinite(scores))


def test_bad_catalog_requests_name_the_field(constrained):
    _, art, runtime = constrained
    unknown, wrong_length = execute(art, runtime, [BeamRequest((1, 2), 2, 3, catalog="nope"),
                                                   BeamRequest((1, 2), 2, 2, catalog="l3")])
    assert isinstance(unknown, RequestError) and unknown.field == "catalog" and "nope" in str(unknown)
    assert isinstance(wrong_length, RequestError) and wrong_length.field == "new_tokens"
    assert "3 tokens" in str(wrong_length)


@pytest.mark.parametrize("constrained", ["qwen2_tiny"], indirect=True)  # the interpreter is slow: one checkpoint
def test_fused_path_masks_as_the_aten_path(constrained, catalog_items):
    """kernels="triton" (the Triton interpreter on a CPU): beam_allowed's int32 bitmask is the ATen
    path's bool mask, packed (kernels/beam_topk.py allowed_bitmask), and beam_candidates under it
    finds the same items."""
    _, art, runtime = constrained
    fused = PythonRuntime(art, kernels="triton")
    rng = random.Random(11)
    reqs = [BeamRequest(tuple(rng.randrange(VOCAB) for _ in range(n)), b, 3, id=f"r{i}", catalog=c)
            for i, (n, b, c) in enumerate([(6, 4, "l3"), (4, 2, ""), (9, 5, "few3")])]
    batch = pack_beam(reqs, pick_beam_bucket(art.buckets, reqs), art.catalogs)
    masks: dict[str, list[torch.Tensor]] = {"aten": [], "fused": []}
    for name, rt in (("aten", runtime), ("fused", fused)):
        rt.run_beam(batch, trace=lambda node, env, name=name: masks[name].append(env["allowed"].clone())
                    if node.type == "beam_allowed" else None)
    assert len(masks["aten"]) == len(masks["fused"]) == 3
    for bools, bits in zip(masks["aten"], masks["fused"]):
        assert torch.equal(allowed_bitmask(bools), bits)
    for req, got, want in zip(reqs, execute(art, fused, reqs), execute(art, runtime, reqs)):
        assert [(b.ids, b.item_id) for b in got.beams] == [(b.ids, b.item_id) for b in want.beams], req.id
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got.beams, want.beams)) <= TOL
