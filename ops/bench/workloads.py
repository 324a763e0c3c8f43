"""The benchmarks' workloads: the definitions live in the package, service/loadgen/workloads.py
(W1..W6's shapes and models, custom shapes, the variable-shape mixes, the requests of a workload
from a seed as gRPC messages, a request's logical FLOPs), since `slmrank bench` ships in the wheel
and ops/ does not; this module re-exports them for the benches, and adds what only the benches
that drive the executor directly need (bench_executor's requests per batch, the runtime's
requests of a shape).
"""

from __future__ import annotations

from typing import Any

from service.loadgen.workloads import (  # noqa: F401  (re-exported: the benches import them from here)
    ID_HIGH, MIXES, WORKLOADS, Requests, WorkloadError, flops_per_request, message_flops)
from service.loadgen.workloads import parse_workload as _parse_workload
from service.model.flops import beam_flops, score_flops


def parse_workload(text: str) -> dict[str, Any]:
    """service.loadgen.workloads.parse_workload's fixed shapes (W1..W6, custom), its mistake a
    one-line exit of the bench. The mixes vary per request, which these benches' FLOP counts and
    executor batches do not: they are `slmrank bench`'s."""
    try:
        w = _parse_workload(text)
    except WorkloadError as e:
        raise SystemExit(str(e)) from None
    if w["kind"] == "mix":
        raise SystemExit(f"--workload: {text} varies per request: measure it with `slmrank bench --workload {text}`")
    return w


# requests per batch where the executor is driven directly (bench_executor): W6 is one request at
# a time (latency)
EXECUTOR_BATCH = {"W1": 8, "W2": 8, "W3": 4, "W4": 8, "W5": 2, "W6": 1}


def runtime_request(w: dict[str, Any], g: Any) -> Any:
    """One request of the shape as the runtime takes it (a ScoreRequest / BeamRequest), its ids
    uniform in [0, ID_HIGH) from the torch.Generator g (the samples before the prefix); a Score's
    label ids are 1000, 2000, ..."""
    import torch

    from service.runtime.requests import BeamRequest, ScoreRequest

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, ID_HIGH, (n,), generator=g).tolist())

    if w["kind"] == "score":
        samples = tuple(ids(w["len"]) for _ in range(w["samples"]))
        labels = tuple(1000 * (i + 1) for i in range(w["labels"]))
        return ScoreRequest(samples=samples, label_ids=labels, prefix_ids=ids(w["prefix"]) if w["prefix"] else ())
    return BeamRequest(prompt_ids=ids(w["prompt"]), beam_width=w["beam"], new_tokens=w["new"])


def request_flops(cfg: Any, req: Any) -> int:
    """The logical FLOPs of a runtime request (ScoreRequest / BeamRequest), whatever its shape."""
    from service.runtime.requests import ScoreRequest

    if isinstance(req, ScoreRequest):
        return score_flops(cfg, len(req.prefix_ids), [len(s) for s in req.samples])
    return beam_flops(cfg, len(req.prompt_ids), req.beam_width, req.new_tokens)
