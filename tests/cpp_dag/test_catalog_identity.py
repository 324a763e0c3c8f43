"""Constrained BeamSearch: the C++ runtime's beam_allowed / beam_init / beam_step equal the Python
runtime's byte for byte (CPU, float32): after every node the allowed-token masks, each beam's trie
node, the beam state and the results; requests of several catalogs and unconstrained ones in one
batch, catalogs with fewer items than beams."""

from __future__ import annotations

import random

import pytest
import torch

from service.artifact.artifact import build_artifact, load_artifact
from service.runtime.batch import pack_beam, pick_beam_bucket, unpack_beam
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest

VOCAB = 512
BUFFERS = ["allowed", "beam_trie", "beam_tokens", "beam_scores", "beam_parents", "beam_seqs"]


def _catalog(path, rng: random.Random, length: int, num_items: int, per_level: int) -> None:
    levels = [rng.sample(range(VOCAB), per_level) for _ in range(length)]
    codes = {tuple(rng.choice(level) for level in levels) for _ in range(num_items)}
    path.write_text("".join(f"it{i}\t{' '.join(map(str, c))}\n" for i, c in enumerate(sorted(codes))))


@pytest.fixture(scope="module", params=["qwen2_small", "qwen3_small"])
def runtimes(request, tmp_path_factory):
    model = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp(f"catalog_identity_{request.param}")
    rng = random.Random(request.param)
    files = {}
    for name, spec in {"a3": (3, 200, 12), "b2": (2, 30, 8), "few3": (3, 4, 5), "c1": (1, 9, 9)}.items():
        files[name] = root / f"{name}.tsv"
        _catalog(files[name], rng, *spec)
    art = load_artifact(build_artifact(str(model.ckpt), root / "art", quiet=True, catalogs=files))
    return art, PythonRuntime(art), CppRuntime(art)


def _python_trace(runtime, batch):
    out = []
    runtime.run_beam(batch, trace=lambda node, env: out.append(
        (node.name, {n: env[n].detach().clone() for n in BUFFERS if n in env})))
    return out


CASES = {"three": ([(9, 16, "a3"), (4, 5, ""), (13, 7, "few3"), (2, 3, "a3")], 3),
         "two": ([(5, 30, "b2"), (6, 2, ""), (3, 40, "b2")], 2),
         "one": ([(8, 12, "c1"), (3, 1, "c1"), (5, 4, "")], 1)}


@pytest.mark.parametrize("case", list(CASES))
def test_constrained_beam_is_byte_identical(runtimes, helpers, case):
    art, python, cpp = runtimes
    shapes, new_tokens = CASES[case]
    rng = random.Random(case)
    reqs = [BeamRequest(helpers.rand_ids(rng, n), b, new_tokens, id=str(i), catalog=c)
            for i, (n, b, c) in enumerate(shapes)]
    bucket = pick_beam_bucket(art.buckets, reqs)
    assert bucket is not None
    batch = pack_beam(reqs, bucket, art.catalogs)
    cpp_trace, py_trace = cpp.trace(batch, BUFFERS), _python_trace(python, batch)
    assert [n for n, _ in cpp_trace] == [n for n, _ in py_trace]
    assert sum(n.endswith("beam_allowed") for n, _ in cpp_trace) == new_tokens
    for (node, cbufs), (_, pbufs) in zip(cpp_trace, py_trace):
        assert set(cbufs) == set(pbufs), node
        for name in cbufs:
            assert helpers.same_bytes(cbufs[name], pbufs[name]), \
                f"after {node}: {name}: {helpers.describe_diff(cbufs[name], pbufs[name])}"
    (seqs_c, scores_c), (seqs_p, scores_p) = cpp.run_beam(batch), python.run_beam(batch)
    assert helpers.same_bytes(seqs_c, seqs_p) and helpers.same_bytes(scores_c, scores_p)
    for req, res in zip(reqs, unpack_beam(batch, seqs_c, scores_c)):
        assert all(torch.isfinite(torch.tensor([b.logprob for b in res.beams])))
        assert (req.catalog != "") == all(b.item_id is not None for b in res.beams)
