"""Host work on the serving event loop, per request and stage, for a workload's shape.

  python -m ops.bench.bench_host [--workloads W1,W2,W3,W5] [--batch 8] [--queued 64] [--model embedded:tiny] [--busy N]

Every request `slmrank serve` answers passes through one event loop; this times, on this machine's
CPU and without a GPU, the pieces of it that are slmrank's own (gRPC's share, and the loop's total,
are ops/bench/loop_cost.py's): the real codec, scheduler, packing and metrics of the workload's artifact
and tokenizer, on requests of the workload's shape (ops/bench/workloads.py's generator):

  parse      the request message from its bytes (gRPC's deserializer)
  gate       admission's check on the message's shape, before decoding (Codec.shape_of, precheck)
  decode     validation and ids (Codec.score_request / beam_request)
  plan       forming a batch of --batch from --queued waiting requests, and taking it (per request)
  pack       the batch's input buffers (per request)
  unpack     the results of a batch of the bucket's output shapes (per request)
  encode     the response message and its bytes
  observe    the request's metrics (ServerMetrics.observe)
  trace      its span tree, for a request whose trace is kept (sampled or slow; not every request)

Prints µs per request by stage, the sum without `trace`, and the requests per second that sum
alone would allow one loop. --busy N runs N processes that spin on the CPU meanwhile, as a
serving host shares its cores with the rest of the pod and, in the benchmarks, the client
processes: work that fans out over torch's intra-op threads stalls there and not on an idle host
(torch.repeat_interleave in packing took ~1.4 ms a call on the H200 host under load). Runs in
seconds; the embedded models build their artifact (random weights) on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any, Callable

import torch

from ops.bench.workloads import ID_HIGH, WORKLOADS, Requests, parse_workload
from service.artifact.resolve import resolve_artifact
from service.model.tokenizer import load_tokenizer
from service.observe.metrics import ServerMetrics
from service.observe.records import RequestTrace, build_records
from service.runtime.batch import ScoreBatch
from service.sched.admission import Priority, Ticket
from service.sched.batcher import BatcherConfig, Scheduler
from service.sched.cost import request_kind
from service.serving.grpc_codec import Codec

STAGES = ("parse", "gate", "decode", "plan", "pack", "unpack", "encode", "observe")


class _NoRuntime:
    """The scheduler is only asked to plan and pack here: nothing runs."""

    num_lanes = 1

    def run_score(self, batch: Any) -> Any:
        raise RuntimeError("bench_host runs no batch")

    run_beam = run_score


def per_call_us(fn: Callable[[], Any], min_s: float = 0.3) -> float:
    """Median of 5 rounds, each repeating fn for about min_s / 5."""
    fn()
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_s / 5 or n < 3:
        fn()
        n += 1
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(rounds)[2]


def outputs_for(batch: Any) -> list[torch.Tensor]:
    """Host tensors of the shapes the runtime returns for this batch's bucket."""
    g = torch.Generator().manual_seed(0)
    if isinstance(batch, ScoreBatch):
        return [torch.randn(batch.bucket.max_samples, batch.num_labels, generator=g)]
    b = batch.bucket
    seqs = torch.randint(1000, 100_000, (b.max_requests, b.beam_width, b.new_tokens), generator=g)
    return [seqs, torch.randn(b.max_requests, b.beam_width, generator=g)]


async def measure(name: str, model: str | None, batch_size: int, queued: int) -> dict[str, float]:
    w = parse_workload(name)
    artifact = resolve_artifact(model or w["model"], quiet=True)
    tokenizer = load_tokenizer(artifact.tokenizer_dir)
    codec = Codec(artifact, tokenizer)
    pb2 = codec.pb2
    kind = w["kind"]
    msg_type = pb2.ScoreRequest if kind == "score" else pb2.BeamSearchRequest
    gen = Requests(w, min(ID_HIGH, tokenizer.vocab_size))
    msgs = [gen.next() for _ in range(max(batch_size, queued) + 1)]
    raw = msgs[0].SerializeToString()
    decode = codec.score_request if kind == "score" else codec.beam_request
    reqs = [decode(m)[0] for m in msgs]
    sched = Scheduler(artifact, _NoRuntime(), batcher=BatcherConfig(validate_requests=False))
    loop = asyncio.get_running_loop()
    out: dict[str, float] = {}
    out["parse"] = per_call_us(lambda: msg_type.FromString(raw))
    out["gate"] = per_call_us(lambda: sched.precheck(*codec.shape_of(kind, msgs[0]), None, "client"))
    out["decode"] = per_call_us(lambda: decode(msgs[0]))

    def ticket(r: Any) -> Ticket:
        return Ticket(r, request_kind(r), Priority.NORMAL, None, future=loop.create_future(), client="client",
                      cost=sched._cost(r))

    waiting = [ticket(r) for r in reqs[:queued]]
    for t in waiting:
        sched.admission.admit(t)

    def plan_and_take() -> None:
        plan = sched._plan(time.monotonic())
        sched.admission.take(plan.tickets)
        sched.admission.finished(plan.tickets)
        for r in [t.payload for t in plan.tickets]:  # the queue back at its depth
            sched.admission.admit(ticket(r))

    plan = sched._plan(time.monotonic())
    n = len(plan.tickets)
    out["plan"] = per_call_us(plan_and_take) / n
    batch_reqs = [t.payload for t in plan.tickets]
    batch = sched._pack(batch_reqs, plan.bucket)
    out["pack"] = per_call_us(lambda: sched._pack(batch_reqs, plan.bucket)) / n
    outputs = outputs_for(batch)
    out["unpack"] = per_call_us(lambda: sched._unpack(batch, outputs)) / n
    results = sched._unpack(batch, outputs)
    respond = codec.score_response if kind == "score" else codec.beam_response
    out["encode"] = per_call_us(lambda: _wire(respond(results[0])))
    done = _completed(sched, plan.tickets, batch, results)
    trace = RequestTrace(kind)
    trace.add_stage("decode", trace.start_ns, trace.start_ns + 50_000)
    trace.completed(done)
    trace.end_ns, trace.status = time.monotonic_ns(), "OK"
    metrics = ServerMetrics()
    out["observe"] = per_call_us(lambda: metrics.observe(trace))
    out["trace"] = per_call_us(lambda: build_records(trace))
    out["batch"] = n
    out["bucket"] = batch.bucket.key  # type: ignore[assignment]
    return out


def _completed(sched: Scheduler, tickets: list[Ticket], batch: Any, results: list[Any]) -> Any:
    """A Completed as the scheduler hands it over, with a node list of the artifact's DAG length."""
    from service.observe.records import Completed, RequestTimings
    from service.runtime.timings import BatchTimings, NodeTiming

    now = time.monotonic()
    now_ns = time.monotonic_ns()
    nodes = tuple(NodeTiming(f"layer.{i}", 0.1, 0.05) for i in range(sched.artifact.config.num_layers))
    timings = BatchTimings(submit_ns=now_ns, start_ns=now_ns, h2d_end_ns=now_ns, launch_ns=now_ns,
                           d2h_end_ns=now_ns + 1_000_000, done_ns=now_ns + 1_000_000, graph=True, nodes=nodes)
    return Completed(results[0], RequestTimings(Priority.NORMAL, now - 0.002, now - 0.001, now, now + 0.001, 1,
                                                len(tickets), 0, batch.bucket.key, timings))


def _wire(response: Any) -> bytes:
    """The bytes gRPC sends: a message is serialized, wire bytes (BeamSearch) go as they are."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(10_000):
            pass


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """n processes spinning on the CPU for the duration of the block."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(0.5 if n else 0.0)  # running before the first timing
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="W1,W2,W3,W5", help=f"comma list of {', '.join(WORKLOADS)} or custom")
    p.add_argument("--batch", type=int, default=8, help="requests per batch (the plan may form fewer: its bucket)")
    p.add_argument("--queued", type=int, default=64, help="requests waiting when a batch is formed")
    p.add_argument("--model", default=None, help="artifact spec for every workload (default: the workload's own)")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="N processes spinning on the CPU while it measures (a shared host)")
    args = p.parse_args()
    if args.queued < args.batch:
        raise SystemExit("--queued must be >= --batch")
    rows = []
    for name in args.workloads.split(","):
        with busy_processes(args.busy):
            r = asyncio.run(measure(name.strip(), args.model, args.batch, args.queued))
        rows.append((name.strip(), r))
        print(f"[bench_host] {name}: batch of {r['batch']:.0f} in {r['bucket']}", flush=True)
    print(f"\nhost work on the event loop, µs per request (torch threads {torch.get_num_threads()}, "
          f"{args.queued} queued, {args.busy} busy processes beside it)")
    head = f"{'workload':10s}" + "".join(f"{s:>9s}" for s in STAGES) + f"{'sum':>9s}{'req/s':>9s}{'trace':>9s}"
    print(head)
    for name, r in rows:
        total = sum(r[s] for s in STAGES)
        print(f"{name:10s}" + "".join(f"{r[s]:9.1f}" for s in STAGES) + f"{total:9.1f}{1e6 / total:9.0f}"
              f"{r['trace']:9.1f}")


if __name__ == "__main__":
    main()
