"""The launches one batch dispatches, counted on a CPU, node by node: the ATen ops that make a
CUDA kernel (views, empties and other aliases excluded) and the Triton kernels, through the Python
runtime's fast path (kernels="triton", run by Triton's interpreter; the C++ runtime runs the same
ops node for node, cpp_dag/node_*.cpp).

  python -m ops.bench.launches [--model embedded:qwen2.5-0.5b] [--workload beam,prompt=16,beam=8,new=5]
                               [--requests 1] [--out FILE.json]

Prints the count of every node type in the prefill and in each decode step, then one decode
step's total. Counts do not depend on the shape's sizes, so a small shape keeps the interpreter
quick; they are what the runtime dispatches. A GPU profile (`bench_executor --profile-batches`)
counts a few more: on CUDA some ATen ops launch more than one kernel (torch's top-k by slice size,
a constant pad as a fill and a copy) and cuBLAS adds a split-K reduce at some shapes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_KERNEL = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
             "size", "stride", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_local_scalar_dense"}


def makes_kernel(func: Any) -> bool:
    """An ATen op that launches a kernel on CUDA: not a view or other alias of an input (an in-place
    op writes its input, and launches), not an allocation or a metadata query."""
    if func.overloadpacket.__name__ in NO_KERNEL:
        return False
    returns = func._schema.returns
    return not (returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write)


class Counter(TorchDispatchMode):
    """While entered, counts the kernel-making ATen ops dispatched outside a Triton launch, and the
    Triton launches (Triton's interpreter moves tensors with ATen ops of its own: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self.in_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_triton and makes_kernel(func):
            self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> Counter:
        from triton.runtime.interpreter import InterpretedFunction

        launch = self._launch = InterpretedFunction.run
        counter = self

        def counted(fn, *args, **kwargs):
            counter.triton[fn.fn.__name__] += 1
            counter.in_triton += 1
            try:
                return launch(fn, *args, **kwargs)
            finally:
                counter.in_triton -= 1

        InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._launch
        super().__exit__(*exc)


def count(model: str, workload: str, num_requests: int) -> dict[str, Any]:
    from ops.bench.workloads import parse_workload, runtime_request
    from service.artifact.resolve import resolve_artifact
    from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
    from service.runtime.python_runtime import PythonRuntime

    w = parse_workload(workload)
    art = resolve_artifact(model, quiet=True)
    rt = PythonRuntime(art, kernels="triton")
    g = torch.Generator().manual_seed(0)
    reqs = [runtime_request(w, g) for _ in range(num_requests)]
    counter = Counter()
    nodes: list[dict[str, Any]] = []
    seen = [collections.Counter(), collections.Counter()]

    def trace(node, env) -> None:
        aten, triton = counter.aten.copy(), counter.triton.copy()
        step = int(node.name[4:node.name.index(".")]) if node.name.startswith("step") else 0
        nodes.append({"node": node.name, "type": node.type, "step": step,
                      "aten": dict(aten - seen[0]), "triton": dict(triton - seen[1])})
        seen[0], seen[1] = aten, triton

    if w["kind"] == "beam":
        batch = pack_beam(reqs, pick_beam_bucket(art.buckets, reqs))
        with counter:
            rt.run_beam(batch, trace=trace)
    else:
        batch = pack_score(reqs, pick_score_bucket(art.buckets, reqs), art.label_columns)
        with counter:
            rt.run_score(batch, trace=trace)
    return {"model": model, "workload": workload, "requests": num_requests, "bucket": batch.bucket.key,
            "layers": art.config.num_layers, "nodes": nodes}


def table(result: dict[str, Any]) -> list[str]:
    steps = sorted({n["step"] for n in result["nodes"]})
    per: dict[tuple[str, int], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for n in result["nodes"]:
        cell = per[(n["type"], n["step"])]
        cell[0] += 1
        cell[1] += sum(n["aten"].values())
        cell[2] += sum(n["triton"].values())
    types = list(dict.fromkeys(n["type"] for n in result["nodes"]))
    head = ["step 0 (prefill)"] + [f"step {s}" for s in steps[1:]]
    lines = [f"{result['model']} {result['workload']} x{result['requests']} ({result['bucket']}, "
             f"{result['layers']} layers): launches dispatched, ATen + Triton",
             f"| node type | {' | '.join(head)} |", "|---|" + "---|" * len(steps)]
    for t in types:
        cells = []
        for s in steps:
            nodes, aten, triton = per.get((t, s), (0, 0, 0))
            cells.append(f"{aten} + {triton}" + (f" ({nodes} nodes)" if nodes > 1 else "") if nodes else "")
        lines.append(f"| {t} | {' | '.join(cells)} |")
    totals = [sum(a + tr for (ty, s), (_, a, tr) in per.items() if s == step) for step in steps]
    lines.append(f"| **all** | {' | '.join(str(x) for x in totals)} |")
    if len(steps) > 1:
        lines.append(f"a decode step: {max(totals[1:])} launches (steps {steps[1]}-{steps[-1]}: "
                     f"{', '.join(map(str, totals[1:]))})")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:qwen2.5-0.5b")
    p.add_argument("--workload", default="beam,prompt=16,beam=8,new=5",
                   help="W1..W8 or a custom shape (ops/bench/workloads.py); a small one: the counts do not "
                        "depend on sizes, and the interpreter is slow")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--out", help="also write the per-node counts here (JSON)")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it when a kernel is defined: start afresh with it
        os.execve(sys.executable, [sys.executable, "-m", "ops.bench.launches", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    result = count(args.model, args.workload, args.requests)
    print("\n".join(table(result)))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
