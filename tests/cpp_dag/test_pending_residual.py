"""A layer's MLP output is left pending (buffer mlp_out) and added by the next layer's first norm
or the final norm, in one kernel with it on the fused path. Both runtimes do what the DAG declares:
a DAG without mlp_out (each layer adding its MLP output itself, as before the fold) gives the
same bytes as the artifact's, in the Python runtime and in the C++ executor (CPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from service.artifact.dag import Node
from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest


def _without_pending(dag: list[Node]) -> list[Node]:
    def strip(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if n != "mlp_out")

    return [dataclasses.replace(n, inputs=strip(n.inputs), outputs=strip(n.outputs)) for n in dag]


@pytest.mark.parametrize("model_name", ["qwen2_small", "qwen3_small"])
def test_a_dag_without_the_pending_buffer_gives_the_same_bytes(model_name: str, request: pytest.FixtureRequest,
                                                               helpers, tmp_path) -> None:
    art = request.getfixturevalue(model_name).artifact
    layers = [n for n in art.score_dag if n.type == "decoder_layer"]
    assert "mlp_out" not in layers[0].inputs and all("mlp_out" in n.inputs for n in layers[1:])
    assert all("mlp_out" in n.outputs for n in layers)
    assert next(n for n in art.score_dag if n.name == "final_norm").inputs == ("x", "mlp_out")
    old = dataclasses.replace(art, score_dag=_without_pending(art.score_dag), beam_dag=_without_pending(art.beam_dag))

    rng = random.Random(4)
    score = [ScoreRequest(tuple(helpers.rand_ids(rng, n) for n in (3, 6)), helpers.rand_ids(rng, 3),
                          helpers.rand_ids(rng, 5))]
    beam = [BeamRequest(helpers.rand_ids(rng, 7), 4, 3), BeamRequest(helpers.rand_ids(rng, 3), 2, 3)]
    score_batch = pack_score(score, pick_score_bucket(art.buckets, score), art.limits.max_labels)
    beam_batch = pack_beam(beam, pick_beam_bucket(art.buckets, beam))
    dims = {"num_requests": beam_batch.bucket.max_requests, "beam_width": beam_batch.bucket.beam_width,
            "new_tokens": beam_batch.bucket.new_tokens}

    want_score = PythonRuntime(art).run_score(score_batch)
    want_beam = PythonRuntime(art).run_beam(beam_batch)
    got = {"python": (PythonRuntime(old).run_score(score_batch), PythonRuntime(old).run_beam(beam_batch))}
    for name, (s_dag, b_dag) in {"cpp": (art.score_dag, art.beam_dag),
                                 "cpp_without": (old.score_dag, old.beam_dag)}.items():
        ex = helpers.executor_with_dags(art, tmp_path, [n.to_dict() for n in s_dag], [n.to_dict() for n in b_dag])
        (scores,), _ = ex.run("score", score_batch.inputs)
        beams, _ = ex.run("beam", beam_batch.inputs, **dims)
        got[name] = (scores, tuple(beams))
    for name, (scores, beams) in got.items():
        assert helpers.same_bytes(scores, want_score), name
        assert all(helpers.same_bytes(a, b) for a, b in zip(beams, want_beam)), name
