"""The Python artifact runtime: walks the manifest's DAG node by node with plain torch.

The reference for the kernels and the C++ runtime, the debugger's view, and the CPU path. Times
every node on the host: last_timings, the BatchTimings of the last run (as the C++ runtime's;
with runs on several threads, the one that ended last).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from ..artifact.artifact import Artifact
from ..artifact.catalog import Catalog, forest_capacity, trie_forest
from .batch import BeamBatch, ScoreBatch
from ..artifact.dag import Node
from .fused import python_kernels
from ..model.checkpoint import fp8_min_rows
from ..model.layers import LayerWeights, rope_table
from .env import NodeEnv
from .nodes import NODE_FUNCS, Env, NodeContext
from .timings import BatchTimings, NodeTimer

Trace = Callable[[Node, Env], None]


class PythonRuntime:
    name = "python"

    def __init__(self, artifact: Artifact, device: str = "cpu", dtype: torch.dtype | None = None,
                 kernels: str = "aten", catalog_headroom: float = 1.0) -> None:
        """kernels: "aten" (plain torch) or "triton" (the fused kernels; service/runtime/fused.py).
        catalog_headroom: room in the catalogs' forest for replacements (load_catalogs), x what they need."""
        self.artifact = artifact
        self.cfg = artifact.config
        self.device = torch.device(device)
        self.dtype = dtype or artifact.weight_dtype
        weights = artifact.load_weights(self.device, self.dtype)
        self.catalog_capacity = forest_capacity(artifact.catalogs, catalog_headroom)
        # the beam_allowed node's constants
        weights.update(trie_forest(artifact.catalogs, self.device, self.catalog_capacity))
        limits = artifact.limits
        num_positions = max(limits.max_prompt_tokens + limits.max_new_tokens, limits.max_score_tokens)
        cos, sin = rope_table(self.cfg, num_positions, self.device)
        self.kernels = kernels
        floors = fp8_min_rows(weights)
        self.ctx = NodeContext(self.cfg, weights, [LayerWeights(weights, i, floors) for i in range(self.cfg.num_layers)],
                               cos.to(self.dtype), sin.to(self.dtype),
                               python_kernels(kernels, artifact, self.device, self.dtype), floors)
        self.last_timings: BatchTimings | None = None

    def load_catalogs(self, catalogs: Sequence[Catalog]) -> None:
        """Overwrites the catalogs' forest in place with these (the artifact's names, in its order;
        CatalogError when they need more room than catalog_capacity). The caller keeps batches with
        constrained requests away meanwhile (Scheduler.replace_catalog)."""
        self.write_catalog_forest(trie_forest(catalogs, torch.device("cpu"), self.catalog_capacity))

    @torch.no_grad()
    def write_catalog_forest(self, forest: dict[str, torch.Tensor]) -> None:
        """load_catalogs' write: trie_forest(..., capacity=catalog_capacity) on the host, copied in place."""
        for name, value in forest.items():
            self.ctx.weights[name].copy_(value)

    def _inputs(self, inputs: dict[str, torch.Tensor]) -> Env:
        return {k: v.to(self.device) for k, v in inputs.items()}

    def _walk(self, dag: list[Node], env: Env, num_steps: int, trace: Trace | None, timer: NodeTimer) -> None:
        """Runs the nodes of the first num_steps steps; trace(node, env) after each (in no node's time)."""
        for node in dag:
            if node.step >= num_steps:
                continue
            NODE_FUNCS[node.type](self.ctx, node, NodeEnv(env, node))
            timer.lap(node.name)
            if trace is not None:
                trace(node, env)
                timer.skip()

    @torch.inference_mode()
    def run_score(self, batch: ScoreBatch, trace: Trace | None = None) -> torch.Tensor:
        """Returns scores [S, L] float32 on the host (padding rows included)."""
        timer = NodeTimer()  # the inputs' copy is in the first node's time, the outputs' in none
        env = self._inputs(batch.inputs)
        self._walk(self.artifact.score_dag, env, 1, trace, timer)
        scores = env["scores"].cpu()
        self.last_timings = timer.timings()
        return scores

    @torch.inference_mode()
    def run_beam(self, batch: BeamBatch, trace: Trace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns seqs [R, B, n] int64 and cumulative log-probs [R, B] float32, on the host."""
        timer = NodeTimer()
        env = self._inputs(batch.inputs)
        self._walk(self.artifact.beam_dag, env, batch.bucket.new_tokens, trace, timer)
        seqs, scores = env["held_seqs"].cpu(), env["held_scores"].cpu()
        self.last_timings = timer.timings()
        return seqs, scores
