"""The DAG's declarations are the whole data flow: the Python runtime refuses a node's access to a
buffer it does not declare, and a DAG whose inputs nothing provides is refused when it is built or
loaded. (The C++ runtime's load-time checks: tests/cpp_dag/test_executor_behaviour.py.)"""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest
import torch

from service.artifact.artifact import MANIFEST, ArtifactError, load_artifact
from service.artifact.manifest import write_manifest
from service.artifact.dag import BEAM_INPUTS, SCORE_INPUTS, DagError, Node, beam_dag, check_dataflow, score_dag
from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.env import NodeEnv, UndeclaredBuffer
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest


def _node(inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Node:
    return Node("probe", "rms_norm", inputs, outputs)


def test_node_env_admits_only_declared_buffers() -> None:
    env = {"a": torch.ones(1), "b": torch.ones(2), "c": torch.ones(3)}
    view = NodeEnv(env, _node(("a",), ("b",)))
    assert view["a"] is env["a"] and view["b"] is env["b"]  # an output may be read back (in-place update)
    assert "a" in view and set(view) == {"a", "b"} and len(view) == 2
    view["b"] = torch.zeros(2)
    assert env["b"].sum() == 0
    with pytest.raises(UndeclaredBuffer, match=r"node probe \(rms_norm\) reads buffer 'c'"):
        view["c"]
    with pytest.raises(UndeclaredBuffer, match=r"writes buffer 'a'"):
        view["a"] = torch.zeros(1)  # an input only: not writable
    with pytest.raises(UndeclaredBuffer, match=r"looks for buffer 'c'"):
        "c" in view  # noqa: B015 - the membership test itself must refuse
    with pytest.raises(UndeclaredBuffer):
        del view["b"]
    assert set(env) == {"a", "b", "c"}


@pytest.mark.parametrize("kind", ["score", "beam"])
def test_the_built_dags_hold_together(kind: str, qwen2_tiny) -> None:
    cfg = qwen2_tiny.artifact.config
    nodes = score_dag(cfg, 2048) if kind == "score" else beam_dag(cfg, 5)
    check_dataflow(nodes, SCORE_INPUTS if kind == "score" else BEAM_INPUTS,
                   ("scores",) if kind == "score" else ("beam_seqs", "beam_scores"))
    broken = [dataclasses.replace(n, inputs=n.inputs + ("nowhere",)) if n.type == "lm_head" else n for n in nodes]
    with pytest.raises(DagError, match=r"lm_head.*reads \['nowhere'\]"):
        check_dataflow(broken, SCORE_INPUTS if kind == "score" else BEAM_INPUTS, ())
    with pytest.raises(DagError, match="never writes"):
        check_dataflow(nodes[:-1] if kind == "score" else nodes[:1], SCORE_INPUTS if kind == "score" else BEAM_INPUTS,
                       ("scores",) if kind == "score" else ("beam_scores",))


def test_a_manifest_with_a_broken_dag_is_refused_at_load(qwen2_tiny, tmp_path) -> None:
    import shutil

    copy = tmp_path / "art"
    shutil.copytree(qwen2_tiny.artifact.path, copy)
    m = msgpack.unpackb((copy / MANIFEST).read_bytes())
    node = next(d for d in m["dags"]["beam"] if d["type"] == "beam_init")
    node["inputs"] = [n for n in node["inputs"] if n != "logits"] + ["logits_nobody_writes"]
    write_manifest(copy, m)
    with pytest.raises(ArtifactError, match="logits_nobody_writes"):
        load_artifact(copy, verify=False)


@pytest.mark.parametrize("kind, node_type, drop", [
    ("score", "decoder_layer", "positions"),
    ("score", "score_masks", "mask_ctx"),
    ("beam", "beam_state", "suffix_k.0"),
    ("beam", "beam_step", "beam_parents"),
])
def test_the_python_runtime_refuses_an_undeclared_access(qwen2_tiny, kind: str, node_type: str, drop: str) -> None:
    """Take one declaration away from a real DAG: the node's access to that buffer fails, naming both."""
    art = qwen2_tiny.artifact
    rng = random.Random(3)

    def strip(node: Node) -> Node:
        if node.type != node_type:
            return node
        return dataclasses.replace(node, inputs=tuple(n for n in node.inputs if n != drop),
                                   outputs=tuple(n for n in node.outputs if n != drop))

    field = "score_dag" if kind == "score" else "beam_dag"
    broken = dataclasses.replace(art, **{field: [strip(n) for n in getattr(art, field)]})
    runtime = PythonRuntime(broken)
    with pytest.raises(UndeclaredBuffer) as info:
        if kind == "score":
            reqs = [ScoreRequest((tuple(rng.randrange(100) for _ in range(4)),), (1, 2))]
            runtime.run_score(pack_score(reqs, pick_score_bucket(art.buckets, reqs), art.limits.max_labels))
        else:
            reqs = [BeamRequest(tuple(rng.randrange(100) for _ in range(5)), 3, 3)]
            runtime.run_beam(pack_beam(reqs, pick_beam_bucket(art.buckets, reqs)))
    assert node_type in str(info.value) and repr(drop) in str(info.value)
