"""The C++ DAG runtime, driven from Python: the C++ executor (cpp_dag) loads the artifact
directory itself (manifest, weights, RoPE tables) and runs every node with no Python and no GIL
between hand-off and results.

Same contract as PythonRuntime (run_score / run_beam, last_timings: the BatchTimings of the last
run), plus asynchronous submission, whose future resolves to (outputs, BatchTimings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from ..artifact.artifact import Artifact
from ..artifact.catalog import Catalog, forest_capacity, trie_forest
from .batch import BeamBatch, ScoreBatch, code_columns, pack_beam, pack_score
from ..artifact.buckets import BeamBucket, CodesBucket, ScoreBucket
from .fused import check_choice, kernels_dir
from .timings import BatchTimings
from ..model.config import ModelConfig
from ..model.progress import Progress
from ..siblings import sibling


def _load_core() -> Any:
    try:
        _core = sibling("cpp_dag._core")
    except ImportError as e:  # the extension is built by `pip install --no-build-isolation -e .`
        raise RuntimeError(f"the C++ runtime is not built ({e}); run ops/test or "
                           "`pip install --no-build-isolation --no-deps -e .`") from e
    return _core


# "bucket": a BeamSearch bucket's graph with its steps unrolled; "conditional": one graph per family of
# buckets that differ only in new tokens, its decode steps CUDA IF nodes (CppRuntime's beam_graphs)
BEAM_GRAPHS = ("bucket", "conditional")


class CppRuntime:
    name = "cpp"

    def __init__(self, artifact: Artifact, device: str = "cpu", dtype: torch.dtype | None = None,
                 use_graphs: bool = True, num_lanes: int = 0, kernels: str = "aten", catalog_headroom: float = 1.0,
                 beam_graphs: str = "bucket") -> None:
        """kernels: "aten" (ATen ops) or "triton" (the fused AOT Triton kernels; CUDA only, service/runtime/fused.py).
        catalog_headroom: room in the catalogs' forest for replacements (load_catalogs), x what they need.
        beam_graphs: "bucket" (a BeamSearch bucket's graph unrolls its n steps) or "conditional" (the
        buckets that differ only in new tokens share one graph whose decode steps are conditional;
        their batches run in buffers sized for the most new tokens on every device: Executor.use_conditional_steps)."""
        core = _load_core()
        self.artifact = artifact
        self.cfg = artifact.config
        self.device = torch.device(device)
        self.dtype = dtype or artifact.weight_dtype
        dtype_name = str(self.dtype).removeprefix("torch.")
        if self.device.type == "cuda":
            torch.cuda.init()  # else torch.cuda.memory_* report 0 for memory the executor allocates
        # verify=False: load_artifact already checked every hash once, at start-up.
        check_choice(kernels)
        if kernels == "triton" and self.device.type != "cuda":
            raise ValueError("kernels='triton': the C++ runtime launches the Triton kernels on CUDA only")
        self.kernels = kernels
        self._core = core
        self.catalog_capacity = forest_capacity(artifact.catalogs, catalog_headroom)
        cap = self.catalog_capacity
        self._executor = core.Executor.from_artifact(str(artifact.path), str(self.device), dtype_name, use_graphs,
                                                     verify=False, num_lanes=num_lanes,
                                                     catalog_capacity=(cap.nodes, cap.edges, cap.window))
        if kernels == "triton":
            self._executor.use_triton_kernels(str(kernels_dir(artifact, self.dtype)))
        if beam_graphs not in BEAM_GRAPHS:
            raise ValueError(f"beam_graphs must be one of {', '.join(BEAM_GRAPHS)}, not {beam_graphs!r}")
        if beam_graphs == "conditional":
            self._executor.use_conditional_steps()
        self.beam_graphs = beam_graphs
        self.last_timings: BatchTimings | None = None

    def load_catalogs(self, catalogs: Sequence[Catalog]) -> None:
        """Overwrites the catalogs' forest in place with these (the artifact's names, in its order;
        CatalogError when they need more room than catalog_capacity). The caller keeps batches with
        constrained requests away meanwhile (Scheduler.replace_catalog); on a GPU this waits for the
        lanes' runs in progress."""
        self.write_catalog_forest(trie_forest(catalogs, torch.device("cpu"), self.catalog_capacity))

    def write_catalog_forest(self, forest: dict[str, torch.Tensor]) -> None:
        """load_catalogs' write: trie_forest(..., capacity=catalog_capacity) on the host, copied in place."""
        self._executor.update_weights(forest)

    @property
    def num_lanes(self) -> int:
        """Batches the executor runs at once (each lane: its own worker thread, stream, graphs)."""
        return self._executor.num_lanes

    @staticmethod
    def _beam_dims(batch: BeamBatch) -> dict[str, int]:
        b = batch.bucket
        return {"num_requests": b.max_requests, "beam_width": b.beam_width, "new_tokens": b.new_tokens}

    def run_score(self, batch: ScoreBatch) -> torch.Tensor:
        (scores,), raw = self._executor.run("score", batch.inputs)
        self.last_timings = BatchTimings.from_executor(raw)
        return scores

    def run_beam(self, batch: BeamBatch) -> tuple[torch.Tensor, torch.Tensor]:
        (seqs, scores), raw = self._executor.run("beam", batch.inputs, **self._beam_dims(batch))
        self.last_timings = BatchTimings.from_executor(raw)
        return seqs, scores

    def control(self, heavy: bool = False) -> Any:
        """A RunControl for one run (run_batch, submit): cancel() stops it before its next node (or
        before it starts); heavy: on the CPU it waits between its nodes while a light run is in progress."""
        return self._core.RunControl(heavy)

    def run_batch(self, batch: ScoreBatch | BeamBatch, control: Any = None) -> tuple[list[torch.Tensor], BatchTimings]:
        """Blocking run on the calling thread: (outputs, BatchTimings). On the CPU, runs from several
        threads go at once, each on its thread's intra-op threads (and CPU priority). A cancelled
        control raises the executor's RunCancelled."""
        if isinstance(batch, ScoreBatch):
            outputs, raw = self._executor.run("score", batch.inputs, control=control)
        else:
            outputs, raw = self._executor.run("beam", batch.inputs, **self._beam_dims(batch), control=control)
        return list(outputs), BatchTimings.from_executor(raw)

    def trace(self, batch: ScoreBatch | BeamBatch, buffers: list[str]) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """Runs one batch node by node, returning host copies of `buffers` after every node."""
        if isinstance(batch, ScoreBatch):
            trace = self._executor.trace("score", batch.inputs, buffers)
        else:
            trace = self._executor.trace("beam", batch.inputs, buffers, **self._beam_dims(batch))
        return [(node, dict(bufs)) for node, bufs in trace]

    def submit(self, batch: ScoreBatch | BeamBatch,
               control: Any = None) -> "asyncio.Future[tuple[list[torch.Tensor], BatchTimings]]":
        """Queues the batch on the executor's worker; the future resolves on the running loop to
        (outputs, BatchTimings). control: a RunControl (control()), to cancel it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result: Any, error: str | None) -> None:  # runs on the executor's thread, with the GIL
            if result is not None:  # the record made here, not on the loop
                try:
                    outputs, raw = result
                    result = (outputs, BatchTimings.from_executor(raw))
                except Exception as e:  # noqa: BLE001 -- else the future would never resolve
                    result, error = None, f"timings: {type(e).__name__}: {e}"
            loop.call_soon_threadsafe(_resolve, fut, result, error)

        if isinstance(batch, ScoreBatch):
            self._executor.submit("score", batch.inputs, done, control=control)
        else:
            self._executor.submit("beam", batch.inputs, done, **self._beam_dims(batch), control=control)
        return fut

    @property
    def uses_graphs(self) -> bool:
        return bool(self._executor.uses_graphs)

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far, every lane's (with beam_graphs "conditional", a family of
        BeamSearch buckets has one a lane)."""
        return int(self._executor.num_graphs)

    def capture_buckets(self) -> list[ScoreBucket | BeamBucket]:
        """Every bucket a batch can take, largest first: the table's Score and BeamSearch buckets,
        and with catalogs each catalog's code-normalised ones (CodesBucket: a graph of their own)."""
        kinds = self.artifact.buckets.kinds
        every = [b for kind in sorted(kinds) for b in kinds[kind]]
        catalogs = {c.name: c for c in self.artifact.catalogs}

        def columns(b: ScoreBucket | BeamBucket) -> int | None:  # a codes bucket's logits: its code columns
            return len(code_columns(catalogs[b.catalog], b.beam_width)) if isinstance(b, CodesBucket) else None

        return sorted(every, key=lambda b: self._footprint(b, columns(b)), reverse=True)

    def _footprint(self, bucket: ScoreBucket | BeamBucket, columns: int | None = None) -> int:
        """_footprint for this runtime's model and kernels: the order capture takes buckets in."""
        return _footprint(bucket, self.cfg, columns, aten=self.kernels == "aten")

    def capture(self, buckets: list[ScoreBucket | BeamBucket] | None = None, quiet: bool = False,
                lanes_at_once: bool = False) -> list[dict[str, Any]]:
        """Captures one CUDA graph per bucket in every lane now (default: capture_buckets()),
        largest first (a no-op without graphs). A CodesBucket's graph takes the artifact's catalog's
        codes (a catalog replaced later with more codes than its padding holds takes a new graph at
        its first batch). lanes_at_once: each lane's worker thread captures the bucket's graph for its
        lane, the lanes at once (the executor's prepare); else this thread, lane after lane.

        Returns a log entry per bucket: key, capture ms (wall time), GPU memory reserved after it.
        """
        if not self.uses_graphs:
            return []
        todo = self.capture_buckets() if buckets is None else sorted(buckets, key=self._footprint, reverse=True)
        label_columns = self.artifact.label_columns
        log = []
        with Progress("capture graphs", len(todo), quiet=quiet) as bar:
            for bucket in todo:
                if isinstance(bucket, ScoreBucket):
                    ms = self._executor.prepare("score", pack_score([], bucket, label_columns).inputs,
                                                lanes_at_once=lanes_at_once)
                else:
                    inputs = pack_beam([], bucket, self.artifact.catalogs).inputs
                    ms = self._executor.prepare("beam", inputs, num_requests=bucket.max_requests,
                                                beam_width=bucket.beam_width, new_tokens=bucket.new_tokens,
                                                lanes_at_once=lanes_at_once)
                reserved = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
                used = _device_used(self.device)
                log.append({"bucket": bucket.key, "capture_ms": ms, "reserved_bytes": reserved, "device_used_bytes": used})
                bar.advance(1, f"{bucket.key} {ms:.0f} ms, {reserved / 2**30:.2f} GiB reserved by torch, "
                               f"{used / 2**30:.2f} GiB used on the device")
        return log

    def node_names(self, kind: str) -> list[str]:
        return list(self._executor.node_names(kind))

    def shutdown(self) -> None:
        self._executor.shutdown()


def _device_used(device: torch.device) -> int:
    """Bytes in use on the whole device (every process), 0 on the CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _footprint(bucket: ScoreBucket | BeamBucket, cfg: ModelConfig, columns: int | None = None,
               aten: bool = False) -> int:
    """Rough device elements a bucket's intermediates take: capturing the largest first lets every
    later capture reuse the lane pool's blocks. Beam buckets are dominated by their logits rows
    (columns: a codes bucket's, its catalog's padded code tokens; else the vocabulary). aten: the
    ATen beam step (kernels "aten") also gathers every rank's candidates, [R x B, columns], which
    is more than the rows when the widest request's tier is wide: at 1,536 rows, 8 requests x 400
    ranks took 1.8 GiB more than 8 x 256 (H100, 2026-12-07), so the 400-wide bucket goes first."""
    per_token = 4 * cfg.hidden_size + 2 * cfg.intermediate_size
    if isinstance(bucket, ScoreBucket):
        return bucket.max_tokens * per_token + bucket.max_samples * cfg.vocab_size
    ranks = bucket.max_requests * bucket.beam_width if aten else 0
    return (2 * bucket.max_rows + ranks) * (columns or cfg.vocab_size) + bucket.max_prompt_tokens * per_token


def _resolve(fut: asyncio.Future, result: Any, error: str | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(RuntimeError(error))
    else:
        fut.set_result(result)
