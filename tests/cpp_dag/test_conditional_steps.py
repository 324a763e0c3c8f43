"""The C++ runtime's BeamSearch families (`slmrank serve --beam-graphs conditional`,
Executor.use_conditional_steps): the buckets that differ only in new tokens share buffers sized for
the DAG's most steps (beam_seqs padded to them; the outputs cut back to the batch's own), and on a
GPU one graph whose decode steps are CUDA IF nodes.

On the CPU (eager, float32) the padded buffers are what can be checked: every batch's answer, bytes
and shapes, equals the same batch run in its bucket's own buffers and on the Python runtime, for
every new-tokens count, mixed in one batch or not, on Qwen2 and Qwen3. The graphs themselves are
checked on the GPU (tests/cpp_dag/test_gpu_runtime.py::test_conditional_steps_on_the_gpu)."""

from __future__ import annotations

import random

import pytest
import torch

from service.runtime.batch import pack_beam, pick_beam_bucket
from service.runtime.requests import BeamRequest

SHAPES = [(5, 3), (17, 2), (9, 7), (1, 1), (30, 4)]  # (prompt tokens, beam width)


@pytest.fixture(scope="module")
def families(qwen2_small, qwen3_small):
    from service.runtime.cpp_runtime import CppRuntime

    rts = {name: CppRuntime(model.artifact, beam_graphs="conditional")
           for name, model in (("qwen2_small", qwen2_small), ("qwen3_small", qwen3_small))}
    yield rts
    for rt in rts.values():
        rt.shutdown()


@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small"])
@pytest.mark.parametrize("new_tokens", [(1,), (2,), (5,), (3, 1, 5, 2, 4), (2, 2, 1)])
def test_a_family_answers_as_its_bucket_and_the_python_runtime(model_name: str, new_tokens: tuple[int, ...],
                                                               families, request: pytest.FixtureRequest,
                                                               helpers) -> None:
    model = request.getfixturevalue(model_name)
    rt = families[model_name]
    assert rt._executor.uses_conditional_steps and not model.cpp._executor.uses_conditional_steps
    rng = random.Random(sum(new_tokens) * 31 + len(new_tokens))
    reqs = [BeamRequest(helpers.rand_ids(rng, p), b, t) for (p, b), t in zip(SHAPES, new_tokens)]
    bucket = pick_beam_bucket(model.artifact.buckets, reqs)
    assert bucket.new_tokens == max(new_tokens)
    batch = pack_beam(reqs, bucket)
    seqs, scores = rt.run_beam(batch)
    ran = [n.name for n in rt.last_timings.nodes]
    for other in (model.cpp, model.python):
        want_seqs, want_scores = other.run_beam(batch)
        assert seqs.shape == want_seqs.shape == (bucket.max_requests, bucket.beam_width, bucket.new_tokens)
        assert torch.equal(seqs, want_seqs.cpu()), f"{other.name}: beams differ"
        assert helpers.same_bytes(scores, want_scores.cpu()), f"{other.name}: scores differ"
    # eager on the CPU: the family walks its steps and runs those the batch has (its conditions
    # read on the host), every node timed on its own: the nodes the bucket's own plan runs
    assert not rt.last_timings.graph and ran == [n.name for n in model.cpp.last_timings.nodes]
    assert len(ran) < len(rt.node_names("beam")) or max(new_tokens) == model.artifact.limits.max_new_tokens


def test_beam_graphs_is_the_cpp_runtimes_setting(qwen2_small) -> None:
    from service.runtime import factory
    from service.runtime.cpp_runtime import CppRuntime

    with pytest.raises(ValueError, match="--beam-graphs conditional"):
        factory.make_runtime("python", qwen2_small.artifact, "cpu", None, beam_graphs="conditional")
    with pytest.raises(ValueError, match="beam_graphs must be one of bucket, conditional"):
        CppRuntime(qwen2_small.artifact, beam_graphs="steps")


def test_a_family_runs_in_buffers_of_the_most_new_tokens(qwen3_small, families, helpers) -> None:
    """What the family shares: a 2-token batch's beam buffers are those of the DAG's most steps
    (the artifact's max_new_tokens): beam_seqs [R, B, most], the suffix K/V with most - 1 slots;
    in its bucket's own buffers, 2 and 1."""
    rt, art = families["qwen3_small"], qwen3_small.artifact
    most = art.limits.max_new_tokens
    assert most > 2
    rng = random.Random(7)
    reqs = [BeamRequest(helpers.rand_ids(rng, p), b, 2) for p, b in SHAPES[:2]]
    batch = pack_beam(reqs, pick_beam_bucket(art.buckets, reqs))
    for runtime, steps in ((rt, most), (qwen3_small.cpp, 2)):
        trace = dict(runtime.trace(batch, ["held_seqs", "suffix_k.0"]))
        seqs = next(bufs["held_seqs"] for node, bufs in trace.items() if "held_seqs" in bufs)
        suffix = next(bufs["suffix_k.0"] for node, bufs in trace.items() if "suffix_k.0" in bufs)
        assert seqs.shape[2] == steps and suffix.shape[1] == steps - 1, (runtime.beam_graphs, seqs.shape, suffix.shape)


def test_model_info_names_the_beam_graphs(qwen2_small, families) -> None:
    from service.serving import proto_gen
    from service.serving.client import info_summary
    from service.serving.model_info import model_info

    pb2 = proto_gen.load().pb2
    for rt, want in ((families["qwen2_small"], "conditional"), (qwen2_small.cpp, "bucket"), (qwen2_small.python, "")):
        info = model_info(pb2, "m", qwen2_small.artifact, rt)
        assert info.beam_graphs == want
        assert (f"beam graphs {want}" in info_summary(info)) == bool(want)


def test_a_batch_of_more_steps_than_the_dag_is_refused_by_name(qwen2_small, families, helpers) -> None:
    """A family pads beam_seqs to the DAG's most steps; a batch packed for more than that (a bucket
    of no artifact) is refused naming both counts, and the executor goes on serving."""
    from service.artifact.buckets import BeamBucket

    rt, art = families["qwen2_small"], qwen2_small.artifact
    most = art.limits.max_new_tokens
    reqs = [BeamRequest(helpers.rand_ids(random.Random(1), 6), 2, 1)]
    good = pick_beam_bucket(art.buckets, reqs)
    too_long = BeamBucket(most + 1, good.max_requests, good.max_prompt_tokens, good.beam_width, good.max_rows)
    with pytest.raises(Exception, match=f"{most + 1} new tokens, the DAG runs at most {most}"):
        rt.run_beam(pack_beam(reqs, too_long))
    seqs, scores = rt.run_beam(pack_beam(reqs, good))
    want_seqs, want_scores = qwen2_small.python.run_beam(pack_beam(reqs, good))
    assert torch.equal(seqs, want_seqs) and helpers.same_bytes(scores, want_scores)
