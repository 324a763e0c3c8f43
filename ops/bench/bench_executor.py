"""Executor-only benchmark and correctness check (no RPC), for the GPU machine.

  python -m ops.bench.bench_executor --out DIR [--quick]

1. identity: the same request set through the Python runtime, the C++ runtime node by node
   ("eager") and the C++ runtime from captured CUDA graphs: output lines must be equal byte for byte;
2. graph replay vs eager: per-node device time of one batch in both modes;
3. throughput of W1/W2/W3 (BENCHMARKS.md) and of the mixes (score-mix, beam-mix, mixed: requests
   drawn as `slmrank bench` draws them, batched as plan_batches groups them, up to MIX_BATCH a
   batch), batches submitted directly, for cpp-graph, cpp-eager and python, beside Hugging Face
   transformers one request at a time and the strong peer, with effective MFU on the logical FLOPs
   of exactly the requests run;
4. lanes: async submit with 1 lane / 1 batch in flight vs 2 lanes / 2 in flight;
5. a soak: 10,000 consecutive mixed requests through the executor, host RSS and GPU memory.
A catalog workload (W7, W8) runs on the artifact built with its catalog (ops.bench.workloads.
catalog_artifact, cached), without peers (they have no catalog: W7u / W8u are the runs beside it).
Writes DIR/bench.json and DIR/log.txt; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ops.bench.hf_peer import HFModel
from ops.bench.workloads import (EXECUTOR_BATCH, ID_HIGH, MIX_BATCH, MIX_MODEL, MIXES, WORKLOADS, catalog_artifact,
                                 mix_requests, request_flops, runtime_request)
from service.artifact.artifact import build_artifact, load_artifact
from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.engine import execute, plan_batches
from service.model.checkpoint import hf_config_kwargs, hf_state_dict
from service.model.fp8_policy import parse_fp8_policy
from service.runtime.jsonl import format_result
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest, ScoreRequest
from service.runtime.timings import BatchTimings

PEAK_BF16 = 989e12
LOG: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def ids(g: torch.Generator, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, ID_HIGH, (n,), generator=g).tolist())


def workload(name: str, g: torch.Generator):
    """One request of W1..W8 (ops/bench/workloads.py), its ids from g."""
    if name not in WORKLOADS:
        raise ValueError(name)
    return runtime_request(WORKLOADS[name], g)


# (model, requests per batch) of each workload (ops/bench/workloads.py); W6 is one request at a time;
# a mix's batches hold up to MIX_BATCH requests; a catalog workload's model is "SPEC+CATALOG" (art_dir)
WORKLOAD_MODELS = {**{name: (w["model"].removeprefix("embedded:") + (f"+{w['catalog']}" if w.get("catalog") else ""),
                             EXECUTOR_BATCH[name])
                      for name, w in WORKLOADS.items()},
                   **{name: (MIX_MODEL.removeprefix("embedded:"), MIX_BATCH) for name in MIXES}}
MIX_POOL = 512  # a mix's requests, drawn once (seed 7, as slmrank bench's pool), then cycled in batches


@dataclass(frozen=True)
class Timed:
    """A batch ready to run: its requests, the packed batch, and their logical FLOPs."""
    requests: list
    kind: str
    batch: Any
    flops: int


def art_dir(spec: str) -> Path:
    """The artifact of WORKLOAD_MODELS' model: embedded:SPEC built into /tmp/art-SPEC, or for
    "SPEC+CATALOG" embedded:SPEC with the catalog (catalog_artifact: built once, cached)."""
    model, _, catalog = spec.partition("+")
    if catalog:
        return catalog_artifact(f"embedded:{model}", catalog)
    return build_artifact(f"embedded:{model}", f"/tmp/art-{model}", quiet=True)


def fp8_artifact(spec: str, policy: str):
    """embedded:SPEC built with `--fp8` POLICY ('+' between parts, each with an optional :ROWS floor,
    e.g. mlp:2048+attn:2048), into /tmp/art-SPEC-fp8-POLICY: the same weights and buckets as
    art_dir's, the policy's linear layers in e4m3. "auto": `--fp8 auto`, timed on this GPU."""
    auto = policy == "auto"
    parts, floors = parse_fp8_policy("none" if auto else policy.replace("+", ","), "--fp8")
    out = f"/tmp/art-{spec}-fp8-{policy.replace(':', '_')}"
    return load_artifact(build_artifact(f"embedded:{spec}", out, quiet=True, fp8=parts, fp8_min_rows=floors,
                                        fp8_auto=auto))


def timed(art, reqs) -> Timed:
    return Timed(reqs, *make_batch(art, reqs), sum(request_flops(art.config, r) for r in reqs))


def fixed_batches(art, name: str, per_batch: int, g) -> list[Timed]:
    """Four batches of per_batch requests of a fixed shape, each request different."""
    return [timed(art, [workload(name, g) for _ in range(per_batch)]) for _ in range(4)]


def mix_batches(art, name: str, max_requests: int, num_requests: int = MIX_POOL) -> list[Timed]:
    """A mix's requests (mix_requests (ops/bench/workloads.py), within the artifact's limits) in the
    batches the engine forms (plan_batches: consecutive requests of one kind while a bucket holds
    them), at most max_requests a batch."""
    reqs = mix_requests(name, art.config, art.limits, num_requests)
    return [timed(art, [reqs[i] for i in idx]) for idx in plan_batches(art, reqs, max_requests)]


def workload_batches(art, name: str, per_batch: int, g) -> list[Timed]:
    return mix_batches(art, name, per_batch) if name in MIXES else fixed_batches(art, name, per_batch, g)


def make_batch(art, reqs):
    if isinstance(reqs[0], ScoreRequest):
        return "score", pack_score(reqs, pick_score_bucket(art.buckets, reqs), art.limits.max_labels)
    return "beam", pack_beam(reqs, pick_beam_bucket(art.buckets, reqs), art.catalogs)


def run_batch(rt, kind, batch):
    return rt.run_score(batch) if kind == "score" else rt.run_beam(batch)


def time_runtime(rt, batches: list[Timed], seconds: float) -> dict:
    """time_batches on a runtime, with the buckets the batches ran in."""
    out = time_batches(lambda b: run_batch(rt, b.kind, b.batch), batches, seconds,
                       lambda: getattr(rt, "last_timings", None))
    buckets = sorted({b.batch.bucket.key for b in batches})
    return out | {"bucket": buckets[0] if len(buckets) == 1 else f"{len(buckets)} buckets"}


def time_batches(run, batches: list[Timed], seconds: float, timings=lambda: None) -> dict:
    """Every batch once (warm-up, graph capture), then the batches in turn for `seconds`: requests
    and logical FLOPs per second of exactly the batches run (effective MFU: no padding counted)."""
    for b in batches:
        run(b)
    sync()
    n, num_requests, flops, t0 = 0, 0, 0, time.perf_counter()
    times, phases = [], []
    while time.perf_counter() - t0 < seconds or n == 0:
        b = batches[n % len(batches)]
        s = time.perf_counter()
        run(b)
        times.append((time.perf_counter() - s) * 1e3)
        if (p := host_phases(timings(), times[-1])) is not None:
            phases.append(p)
        n, num_requests, flops = n + 1, num_requests + len(b.requests), flops + b.flops
    elapsed = time.perf_counter() - t0
    times.sort()
    out = {"batches": n, "requests": num_requests, "flops": flops, "req_per_s": num_requests / elapsed,
           "eff_mfu_bf16": flops / elapsed / PEAK_BF16, "batch_ms_p50": times[len(times) // 2],
           "batch_ms_max": times[-1], "requests_per_batch": round(num_requests / n, 2)}
    if phases:  # medians, ms: where a batch's wall time goes besides the graph's own device time
        out["phases_ms_p50"] = {k: round(statistics.median(p[k] for p in phases), 3) for k in phases[0]}
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_phases(timings: BatchTimings | None, wall_ms: float) -> dict[str, float] | None:
    """A C++ runtime batch's wall time by phase (its executor's own clock, ns), in ms: staging the
    inputs and enqueueing the copies (stage), the graph launch call (launch), waiting for the device
    and the copies back (device_wait), what followed in the executor (finish: output clones, node
    times), and the Python side around the call (python: wall - the executor's start to done)."""
    if timings is None or not timings.graph:
        return None
    t = timings
    return {"stage": (t.h2d_end_ns - t.start_ns) / 1e6, "launch": (t.launch_ns - t.h2d_end_ns) / 1e6,
            "device_wait": (t.d2h_end_ns - t.launch_ns) / 1e6, "finish": (t.done_ns - t.d2h_end_ns) / 1e6,
            "python": wall_ms - (t.done_ns - t.start_ns) / 1e6}


def time_submit(rt, art, name, per_batch, seconds, g, inflight: int) -> dict:
    """Like time_runtime, but `inflight` batches kept submitted through the async API (the lanes)."""
    import asyncio

    batches = [make_batch(art, [workload(name, g) for _ in range(per_batch)]) for _ in range(4)]

    async def go() -> tuple[int, float]:
        for _, b in batches:
            await rt.submit(b)
        n, t0 = 0, time.perf_counter()

        async def worker(k: int) -> None:
            nonlocal n
            i = k
            while time.perf_counter() - t0 < seconds:
                await rt.submit(batches[i % len(batches)][1])
                n += 1
                i += inflight
        await asyncio.gather(*(worker(k) for k in range(inflight)))
        return n, time.perf_counter() - t0

    n, elapsed = asyncio.run(go())
    return {"batches": n, "req_per_s": n * per_batch / elapsed, "requests_per_batch": per_batch,
            "in_flight": inflight, "bucket": batches[0][1].bucket.key}


def lanes(arts, seconds, g) -> dict:
    """Executor throughput with 1 lane / 1 batch in flight vs 2 lanes / 2 in flight (cpp graphs)."""
    rows = {}
    for name, art, per_batch in (("W1", arts["qwen3-0.6b"], 8), ("W2", arts["qwen2.5-0.5b"], 8)):
        for num_lanes in (1, 2):
            rt = CppRuntime(art, device="cuda", use_graphs=True, num_lanes=num_lanes)
            r = time_submit(rt, art, name, per_batch, seconds, g, inflight=num_lanes)
            rows[f"{name}/lanes{num_lanes}/x{per_batch}"] = r
            log(f"{name} cpp_graph lanes={num_lanes} in flight={num_lanes} x{per_batch}: {r['req_per_s']:.1f} req/s")
            rt.shutdown()
            del rt
            torch.cuda.empty_cache()
    return rows


def hf_peer(ckpt_dir: str, name: str, n: int, g) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.bfloat16).cuda().eval()
    reqs = [workload(name, g) for _ in range(n + 1)]

    def one(req):
        with torch.no_grad():
            if isinstance(req, ScoreRequest):
                x = torch.tensor([list(s) for s in req.samples], device="cuda")
                logits = model(x).logits[:, -1].float()
                return torch.log_softmax(logits, -1)[:, list(req.label_ids)].cpu()
            x = torch.tensor([list(req.prompt_ids)], device="cuda")
            return model.generate(x, num_beams=req.beam_width, num_return_sequences=req.beam_width,
                                  max_new_tokens=req.new_tokens, min_new_tokens=req.new_tokens, do_sample=False,
                                  length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0).cpu()

    one(reqs[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for r in reqs[1:]:
        one(r)
    elapsed = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return {"req_per_s": n / elapsed, "ms_per_req": elapsed / n * 1e3}


def hf_strong_peer(ckpt_dir: str, name: str, per_batch: int, seconds: float, g) -> dict:
    """What a capable user builds without slmrank (BENCHMARKS.md): whole requests concatenated into
    one batched forward, the LM head only at the positions whose logits are used, under
    torch.compile (default mode); for BeamSearch, batched `generate` over several requests (equal
    prompt lengths here, so no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.bfloat16).cuda().eval()
    batches = [[workload(name, g) for _ in range(per_batch)] for _ in range(3)]
    if isinstance(batches[0][0], ScoreRequest):
        body, head = model.model, model.lm_head

        def score(x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # x [S, L] -> [S, labels]
            h = body(input_ids=x).last_hidden_state[:, -1]
            return torch.log_softmax(head(h).float(), -1).gather(1, labels)

        fn = torch.compile(score)
        inputs = [(torch.tensor([list(r.prefix_ids) + list(s) for r in reqs for s in r.samples], device="cuda"),
                   torch.tensor([list(r.label_ids) for r in reqs for _ in r.samples], device="cuda"))
                  for reqs in batches]

        def one(i: int) -> None:
            fn(*inputs[i % len(inputs)])
    else:
        prompts = [torch.tensor([list(r.prompt_ids) for r in reqs], device="cuda") for reqs in batches]
        req = batches[0][0]

        def one(i: int) -> None:
            model.generate(prompts[i % len(prompts)], num_beams=req.beam_width, num_return_sequences=req.beam_width,
                           max_new_tokens=req.new_tokens, min_new_tokens=req.new_tokens, do_sample=False,
                           length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(3):  # compile + warm-up
            one(i)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        times, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < seconds or len(times) < 3:
            s = time.perf_counter()
            one(len(times))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - s) * 1e3)
    del model
    torch.cuda.empty_cache()
    times.sort()
    p50 = times[len(times) // 2]
    return {"req_per_s": per_batch * 1e3 / p50, "batch_ms_p50": p50, "requests_per_batch": per_batch,
            "warmup_s": round(compile_s, 1), "compiled": isinstance(batches[0][0], ScoreRequest)}


def hf_strong_peer_mix(ckpt_dir: str, batches: list[Timed], seconds: float, device: str = "cuda",
                       compile: bool = True) -> dict:
    """The strong peer on a mix (ops/bench/hf_peer.py's HFModel, as the gRPC peer runs it), on the
    batches slmrank runs: a Score batch in one forward padded as a user would for varied shapes
    (padding "mix": powers of two), a BeamSearch batch in one `generate` per beam width (generate
    takes one num_beams). Every batch once before the window: every shape the window runs compiles
    there. Requests and logical FLOPs per second of exactly the requests run, as time_runtime's."""
    model = HFModel(ckpt_dir, device, compile, padding="mix")
    t0 = time.perf_counter()
    shapes = peer_shapes(model, batches)
    warmup_s = time.perf_counter() - t0
    r = time_batches(lambda b: peer_run(model, b.requests), batches, seconds)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return r | {"warmup_s": round(warmup_s, 1), "score_shapes": len(shapes), "compiled": compile}


def peer_run(model: HFModel, reqs: list) -> list:
    """One of slmrank's batches through the strong peer: its answers, in order."""
    if isinstance(reqs[0], ScoreRequest):
        return model.score_many([(list(r.prefix_ids), [list(s) for s in r.samples], list(r.label_ids)) for r in reqs])
    by_width: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        by_width.setdefault(r.beam_width, []).append(i)
    out: list = [None] * len(reqs)
    for width, idx in by_width.items():
        answers = model.beam_many([list(reqs[i].prompt_ids) for i in idx], width, reqs[idx[0]].new_tokens)
        for i, a in zip(idx, answers):
            out[i] = a
    return out


def peer_shapes(model: HFModel, batches: list[Timed]) -> set[tuple[int, int]]:
    """Runs every batch once through the peer (warm-up): the padded Score shapes [rows, width] they ran at."""
    shapes: set[tuple[int, int]] = set()
    forward = model._last_logprobs

    def recording(x, mask, last):
        shapes.add(tuple(x.shape))
        return forward(x, mask, last)

    model._last_logprobs = recording
    try:
        for b in batches:
            peer_run(model, b.requests)
    finally:
        model._last_logprobs = forward
    return shapes


def save_hf_checkpoint(art, out: str) -> str:
    """Writes the artifact's weights as an HF checkpoint so the peer runs on the very same weights."""
    if (Path(out) / "config.json").exists():  # written earlier in this run for another workload
        return out
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(art.config.arch, **hf_config_kwargs(art.config)),
                                             dtype=torch.bfloat16)
    sd = hf_state_dict(art.config, art.load_weights("cpu"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.save_pretrained(out)
    return out


def identity_check(art, g, kernels: str = "aten") -> dict:
    reqs = [ScoreRequest(samples=(ids(g, 5), ids(g, 9)), label_ids=(3, 9, 100), prefix_ids=ids(g, 11)),
            ScoreRequest(samples=tuple(ids(g, 7) for _ in range(15)), label_ids=(5,)),
            ScoreRequest(samples=(ids(g, 4),), label_ids=(1, 2)),
            *[BeamRequest(prompt_ids=ids(g, 20 + 7 * b), beam_width=b, new_tokens=t)
              for b, t in [(1, 1), (4, 5), (16, 3), (70, 5), (100, 2), (3, 5)]],
            BeamRequest(prompt_ids=ids(g, 100), beam_width=7, new_tokens=9)]  # an error line
    # kernels="triton": the fused kernels, the same three runtimes compared among themselves
    runtimes = {"python": PythonRuntime(art, device="cuda", kernels=kernels),
                "cpp_eager": CppRuntime(art, device="cuda", use_graphs=False, kernels=kernels),
                "cpp_graph": CppRuntime(art, device="cuda", use_graphs=True, kernels=kernels)}
    outs = {}
    for name, rt in runtimes.items():
        outs[name] = [format_result(i, r) for i, r in enumerate(execute(art, rt, reqs))]
    same = {name: outs[name] == outs["python"] for name in outs}
    for name in outs:
        if not same[name]:
            diff = [i for i, (a, b) in enumerate(zip(outs[name], outs["python"])) if a != b]
            log(f"identity: {name} differs from python on lines {diff}: {outs[name][diff[0]][:200]} vs "
                f"{outs['python'][diff[0]][:200]}")
    return {"equal_to_python": same, "lines": len(reqs)}


def node_breakdown(art, g) -> dict:
    out = {}
    kind, batch = make_batch(art, [workload("W2", g) for _ in range(4)])
    for name, graphs in (("eager", False), ("graph", True)):
        rt = CppRuntime(art, device="cuda", use_graphs=graphs)
        for _ in range(3):
            run_batch(rt, kind, batch)
        walls = []
        for _ in range(10):
            s = time.perf_counter()
            run_batch(rt, kind, batch)
            walls.append((time.perf_counter() - s) * 1e3)
        nodes = rt.last_timings.nodes
        out[name] = {"wall_ms_p50": sorted(walls)[5], "device_ms_sum": sum(n.device_ms for n in nodes),
                     "top_nodes": sorted(([n.name, round(n.device_ms, 4)] for n in nodes), key=lambda x: -x[1])[:8],
                     "bucket": batch.bucket.key}
        rt.shutdown()
    return out


def category(node: str) -> str:
    if node.startswith("step"):
        node = node.split(".", 1)[1]
        prefix = "decode "
    else:
        prefix = ""
    kind = node.split(".")[0]
    return prefix + ("layers" if kind == "layer" else kind)


def breakdown(arts, g, wanted: list[str], kernels: str) -> dict:
    """Device ms by node category, one graph replay of a batch of each workload (a mix: its first batch)."""
    out = {}
    for name in wanted:
        spec, per_batch = WORKLOAD_MODELS[name]
        art = arts[spec]
        rt = CppRuntime(art, device="cuda", use_graphs=True, kernels=kernels)
        first = mix_batches(art, name, per_batch)[0] if name in MIXES else None
        kind, batch = ((first.kind, first.batch) if first
                       else make_batch(art, [workload(name, g) for _ in range(per_batch)]))
        for _ in range(3):
            run_batch(rt, kind, batch)
        cats: dict[str, float] = {}
        for n in rt.last_timings.nodes:
            cats[category(n.name)] = cats.get(category(n.name), 0.0) + n.device_ms
        out[f"{name}/x{per_batch}/{kernels}"] = {"total": round(sum(cats.values()), 3),
                                                 **{k: round(v, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}}
        rt.shutdown()
    return out


def kernel_profile(arts, g, wanted: list[tuple[str, int]], kernels: str, device: str = "cuda") -> dict:
    """One batch's kernels: the batch run eagerly by the C++ runtime under torch.profiler (CUPTI sees
    ATen's launches and the AOT Triton cubins' alike), beside the same batch replayed from its
    graph. kernel_ms is the sum of the kernels' own device time; graph_ms the graph's device time
    (its nodes' spans, gaps included); the difference is launch and dependency latency between
    kernels, which only fewer kernels remove; each kernel's share says which are worth fusing.
    On the CPU (CI) the rows are ATen ops and their self CPU time, and there is no graph."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    out = {}
    for name, per_batch in wanted:
        art = arts[WORKLOAD_MODELS[name][0]]
        kind, batch = make_batch(art, [workload(name, g) for _ in range(per_batch)])
        rt = CppRuntime(art, device=device, use_graphs=on_gpu, kernels=kernels)
        walls = []
        for i in range(23 if on_gpu else 4):
            s = time.perf_counter()
            run_batch(rt, kind, batch)
            if i >= 3:  # after capture and warm-up
                walls.append((time.perf_counter() - s) * 1e3)
        graph_ms = sum(n.device_ms if on_gpu else n.host_ms for n in rt.last_timings.nodes)  # host ms on the CPU
        phases = host_phases(rt.last_timings, walls[-1])
        rt.shutdown()
        rt = CppRuntime(art, device=device, use_graphs=False, kernels=kernels)
        for _ in range(2):
            run_batch(rt, kind, batch)
        sync()
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            run_batch(rt, kind, batch)
            sync()
        rt.shutdown()
        rows = []
        for ev in prof.key_averages():
            us = (getattr(ev, "self_device_time_total", 0) or getattr(ev, "self_cuda_time_total", 0) if on_gpu
                  else ev.self_cpu_time_total)
            if us > 0 and (on_gpu or ev.key.startswith("aten::")):
                rows.append((ev.key[:70], ev.count, us / 1e3))
        rows.sort(key=lambda r: -r[2])
        kernel_ms = sum(r[2] for r in rows)
        out[f"{name}/x{per_batch}/{kernels}"] = {
            "bucket": batch.bucket.key, "launches": sum(r[1] for r in rows), "kernel_ms": round(kernel_ms, 3),
            "graph_ms": round(graph_ms, 3), "wall_ms_p50": round(statistics.median(walls), 3),
            "phases_ms": {k: round(v, 3) for k, v in (phases or {}).items()},
            "top": [[k, n, round(ms, 3), round(ms / kernel_ms, 3)] for k, n, ms in rows[:16]]}
    return out


def soak(art, num_requests: int, g) -> dict:
    """num_requests consecutive mixed requests (small Score, short and wide BeamSearch), 8 to a
    batch; host RSS and GPU memory sampled after warm-up and then every 1,000 requests."""
    rt = CppRuntime(art, device="cuda", use_graphs=True)
    kinds = [lambda: ScoreRequest(samples=tuple(ids(g, 16) for _ in range(15)), label_ids=(11, 12)),
             lambda: BeamRequest(prompt_ids=ids(g, 32), beam_width=16, new_tokens=3),
             lambda: BeamRequest(prompt_ids=ids(g, 64), beam_width=64, new_tokens=5)]
    per_batch, warmup = 8, 48
    samples: list[dict] = []
    done, i = 0, 0
    t0 = time.perf_counter()
    while done < num_requests + warmup:
        kind, batch = make_batch(art, [kinds[i % len(kinds)]() for _ in range(per_batch)])
        run_batch(rt, kind, batch)
        done += per_batch
        i += 1
        if done == warmup or (done > warmup and (done - warmup) % 1000 == 0):
            samples.append({"requests": done - warmup, "rss_mib": round(rss_mib(), 1),
                            "gpu_alloc_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                            "gpu_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
                            "seconds": round(time.perf_counter() - t0, 1)})
            log(f"soak {samples[-1]}")
    rt.shutdown()
    return {"requests": done - warmup, "seconds": round(time.perf_counter() - t0, 1), "samples": samples}


def save(out: Path, result: dict) -> None:
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "log.txt").write_text("\n".join(LOG))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--soak", type=int, default=10000)
    p.add_argument("--workloads", default="W1,W2,W3",
                   help="throughput: comma list of W1..W6, score-mix, beam-mix, mixed (a mix: up to 8 requests a "
                        "batch, beside 1 at a time)")
    p.add_argument("--runtimes", default="cpp_graph,cpp_graph_triton,cpp_eager,python",
                   help="throughput: comma list of cpp_graph, cpp_graph_triton, cpp_eager, python")
    p.add_argument("--breakdown-kernels", default="aten,triton", help="node breakdown: comma list of aten,triton")
    p.add_argument("--profile-batches", default="",
                   help="kernel profile of one batch each, e.g. W2:1,W2:8,W3:1 (W:requests; fused kernels)")
    p.add_argument("--fp8", default="",
                   help="throughput of cpp_graph_triton on FP8 builds too: policies separated by '/', parts by '+', "
                        "each with an optional :ROWS floor, or auto (e.g. mlp/mlp+attn+head/mlp:2048+attn:2048/auto: "
                        "`slmrank build --fp8 mlp:2048,attn:2048`); rows NAME/fp8-POLICY/xN")
    p.add_argument("--skip", default="",
                   help="comma list of: identity,triton,soak,nodes,breakdown,lanes,throughput,hf,strong")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0)}
    arts = {}
    wanted = args.workloads.split(",")
    profiled = [(w, int(n)) for w, n in (item.split(":") for item in filter(None, args.profile_batches.split(",")))]
    specs = {"qwen2.5-0.5b", "qwen3-0.6b"} | {WORKLOAD_MODELS[w][0] for w in wanted + [w for w, _ in profiled]}
    for spec in sorted(specs):
        t = time.perf_counter()
        arts[spec] = load_artifact(art_dir(spec))
        log(f"built embedded:{spec} in {time.perf_counter() - t:.1f} s")
    m05 = arts["qwen2.5-0.5b"]

    if "identity" not in skip:
        result["identity"] = identity_check(m05, g)
        save(out, result)
        log(f"identity (M05 bf16 cuda): {result['identity']}")
        if "triton" not in skip:
            result["identity_triton"] = identity_check(m05, g, kernels="triton")
            save(out, result)
            log(f"identity with the Triton kernels (M05 bf16 cuda): {result['identity_triton']}")
    if "soak" not in skip:
        result["soak"] = soak(m05, args.soak, g)
        save(out, result)
        first, last = result["soak"]["samples"][0], result["soak"]["samples"][-1]
        log(f"soak: {result['soak']['requests']} requests in {result['soak']['seconds']} s; after warm-up "
            f"RSS {first['rss_mib']} MiB, GPU {first['gpu_alloc_mib']}/{first['gpu_reserved_mib']} MiB; at the end "
            f"RSS {last['rss_mib']} MiB, GPU {last['gpu_alloc_mib']}/{last['gpu_reserved_mib']} MiB")
    if "nodes" not in skip:
        result["nodes"] = node_breakdown(m05, g)
        save(out, result)
        log(f"graph vs eager (W2 x4): {json.dumps(result['nodes'])}")
    if "breakdown" not in skip:
        result["breakdown"] = {}
        for kernels in args.breakdown_kernels.split(","):
            result["breakdown"].update(breakdown(arts, g, wanted, kernels))
        save(out, result)
        log(f"device ms by node category, one batch from its graph: {json.dumps(result['breakdown'])}")
    if profiled:
        result["kernel_profile"] = kernel_profile(arts, g, profiled, "triton")
        save(out, result)
        for key, r in result["kernel_profile"].items():
            log(f"kernels {key} ({r['bucket']}): {r['launches']} launches, kernels {r['kernel_ms']} ms, "
                f"graph {r['graph_ms']} ms, wall p50 {r['wall_ms_p50']} ms, phases {r['phases_ms']}")
            for k, n, ms, share in r["top"]:
                log(f"    {ms:8.3f} ms {share:6.1%} {n:5d}x  {k}")
    if "lanes" not in skip:
        result["lanes"] = lanes(arts, args.seconds, g)
        save(out, result)
    if "throughput" not in skip:
        rows = {}
        runtimes = args.runtimes.split(",")
        for name in wanted:
            spec, per_batch = WORKLOAD_MODELS[name]
            art = arts[spec]
            cfg = art.config
            for rt_name, make in (("cpp_graph", lambda a: CppRuntime(a, device="cuda", use_graphs=True)),
                                  ("cpp_graph_triton", lambda a: CppRuntime(a, device="cuda", use_graphs=True,
                                                                            kernels="triton")),
                                  ("cpp_eager", lambda a: CppRuntime(a, device="cuda", use_graphs=False)),
                                  ("python", lambda a: PythonRuntime(a, device="cuda"))):
                if rt_name not in runtimes:
                    continue
                rt = make(art)
                for bs in sorted({1, per_batch}):  # a mix: at most bs requests a batch
                    r = time_runtime(rt, workload_batches(art, name, bs, g), args.seconds)
                    rows[f"{name}/{rt_name}/x{bs}"] = r
                    log(f"{name} {rt_name} x{bs}: {r['req_per_s']:.1f} req/s, {r['requests_per_batch']} requests a "
                        f"batch, batch p50 {r['batch_ms_p50']:.2f} ms, MFU {r['eff_mfu_bf16']:.1%} ({r['bucket']})")
                if hasattr(rt, "shutdown"):
                    rt.shutdown()
                del rt
                torch.cuda.empty_cache()
            for policy in filter(None, args.fp8.split("/")) if "+" not in spec else ():  # no catalog builds
                rt = CppRuntime(fp8_artifact(spec, policy), device="cuda", use_graphs=True, kernels="triton")
                for bs in sorted({1, per_batch}):
                    r = time_runtime(rt, workload_batches(art, name, bs, g), args.seconds)
                    rows[f"{name}/fp8-{policy}/x{bs}"] = r
                    log(f"{name} fp8-{policy} x{bs}: {r['req_per_s']:.1f} req/s, batch p50 {r['batch_ms_p50']:.2f} ms, "
                        f"MFU {r['eff_mfu_bf16']:.1%} ({r['bucket']})")
                rt.shutdown()
                del rt
                torch.cuda.empty_cache()
            if WORKLOADS.get(name, {}).get("catalog"):  # the peers have no catalog: W7u / W8u are the comparison
                result["throughput"] = rows
                save(out, result)
                continue
            ckpt = save_hf_checkpoint(art, f"/tmp/hf-{spec}") if not {"hf", "strong"} <= skip else None
            if "strong" not in skip and name in MIXES:
                r = hf_strong_peer_mix(ckpt, mix_batches(art, name, per_batch), args.seconds)
                rows[f"{name}/hf_strong/x{per_batch}"] = r
                log(f"{name} hf_strong x{per_batch}: {r['req_per_s']:.1f} req/s, {r['requests_per_batch']} requests "
                    f"a batch, MFU {r['eff_mfu_bf16']:.1%} ({r['score_shapes']} padded Score shapes compiled in "
                    f"the warm-up, {r['warmup_s']} s)")
                save(out, result | {"throughput": rows})
            elif "strong" not in skip:
                r = hf_strong_peer(ckpt, name, per_batch, args.seconds, g)
                r["eff_mfu_bf16"] = r["req_per_s"] * request_flops(cfg, workload(name, g)) / PEAK_BF16
                rows[f"{name}/hf_strong/x{per_batch}"] = r
                log(f"{name} hf_strong x{per_batch}: {r['req_per_s']:.1f} req/s, batch p50 {r['batch_ms_p50']:.2f} ms, "
                    f"MFU {r['eff_mfu_bf16']:.1%} (compiled: {r['compiled']}, warm-up {r['warmup_s']} s)")
                save(out, result | {"throughput": rows})
            if "hf" not in skip and name not in MIXES:  # the naive peer on the mixes: bench_grpc --peer
                r = hf_peer(ckpt, name, 10 if name != "W1" else 40, g)
                r["eff_mfu_bf16"] = r["req_per_s"] * request_flops(cfg, workload(name, g)) / PEAK_BF16
                rows[f"{name}/hf/x1"] = r
                log(f"{name} hf x1: {r['req_per_s']:.1f} req/s, {r['ms_per_req']:.1f} ms/req, MFU {r['eff_mfu_bf16']:.1%}")
            result["throughput"] = rows
            save(out, result)
        result["throughput"] = rows
    save(out, result)
    print("\n== summary ==")
    if "identity" in result:
        print("identity:", result["identity"]["equal_to_python"])
    if "identity_triton" in result:
        print("identity (triton kernels):", result["identity_triton"]["equal_to_python"])
    for k, v in {**result.get("lanes", {}), **result.get("throughput", {})}.items():
        ms = f"batch p50 {v['batch_ms_p50']:7.2f} ms" if "batch_ms_p50" in v else ""
        ph = "  " + " ".join(f"{p} {x:.3f}" for p, x in v["phases_ms_p50"].items()) if "phases_ms_p50" in v else ""
        print(f"{k:28s} {v['req_per_s']:8.1f} req/s  MFU {v.get('eff_mfu_bf16', float('nan')):6.1%}  {ms}{ph}")
    if "nodes" in result:
        for k, v in result["nodes"].items():
            print(f"nodes {k}: wall p50 {v['wall_ms_p50']:.2f} ms, device sum {v['device_ms_sum']:.2f} ms")
    for name, cats in result.get("breakdown", {}).items():
        print(f"breakdown {name}: {cats}")
    if "soak" in result:
        for row in result["soak"]["samples"]:
            print("soak", row)


if __name__ == "__main__":
    main()
