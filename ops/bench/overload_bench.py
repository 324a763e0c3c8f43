"""Overload of `slmrank serve` (issue 11): its capacity measured, then load offered well past it.

  python -m ops.bench.overload_bench --workload W1 --factor 3 --duration-s 60 --out DIR \
      [--capacity QPS] [--device cuda|cpu] [--model SPEC] [--client-procs 4]

1. `slmrank serve` runs as a subprocess on 127.0.0.1 (as ops/bench/bench_grpc.py runs it).
2. Capacity: --capacity, else ops/bench/bench_grpc.py's closed loop over --levels: the highest QPS of a
   level within the SLO (mean < 20 ms, P99 < 80 ms), else the highest QPS measured.
3. Overload: an open loop, Poisson arrivals at --factor x capacity for --duration-s, spread over
   --client-procs processes (on uvloop, --channels-per-proc connections each, the calls dealt
   round-robin over them); --online-share of the requests are ONLINE with --online-deadline-ms,
   the others NORMAL with --deadline-ms. A refused request is not retried: it is the excess.
4. Every second: the server's RSS (/proc/PID/status), on a GPU its device memory (nvidia-smi),
   and its admission state from /metrics (the calibration, each lane's own error, the fronts'
   ingress delay, the refusals by reason; reported as means, maxima and refusals per 10 s).
5. Every 50 ms, from each client process: a grpc.health.v1 Check (the engine answers it; through
   `--fronts N` it is relayed), and the same Score/BeamSearch to a bare grpc.aio server on uvloop
   that refuses everything at once (`floor_probe`): the latency of a refusal with no work of
   slmrank's, under the same load, reported beside slmrank's refusal latency.
6. Quiet callers (`quiet_loop`, --quiet-callers more processes): each one call at a time, every
   --quiet-interval-ms, a request of the load's to slmrank and the same request to the bare
   server, through ops/bench/h2call.py (HTTP/2 over a blocking socket: no gRPC client threads, no event
   loop). The load's clients are grpc.aio ones, sending hundreds of calls a second each: their
   latencies include their own event loop's queue and grpc.aio's hop from its polling thread to
   the loop. A caller in production is one of many, and is usually C++, Go or Java (no such
   hop). The quiet callers show how fast slmrank refuses (and serves) with the client's share
   taken out; the bare server beside them is the floor of a Python gRPC server's refusal.
7. --client-cpus N: the load's client processes run on the last N CPUs, slmrank (its fronts too),
   the bare server and the quiet callers on the others, as a replica whose callers run elsewhere
   (or in containers with CPU limits) would. Default: every process may run anywhere.
8. Every 10 s each client process prints what it sent and what came back; calls still unanswered
   the longest deadline + 10 s after its last send are cancelled (CLIENT_CANCELLED), and a client
   process that sends nothing back is counted as lost: the run ends and reports whatever happens.

Report (DIR/overload.json, and a table): served QPS as a share of capacity (issue 11: >= 0.9),
ONLINE P50/P99 of the served (< 80 ms), refusal latency P50/P99 (< 1 ms) seen by the load's
clients and by the quiet callers, with the bare server's beside each, status codes, admitted
requests that ended DEADLINE_EXCEEDED (0), the largest retry hint (<= the cap), and RSS / device
memory over the first and the last 10 s (flat).

The client loops (`closed_loop`, `open_loop`) are also what tests/service/test_overload.py runs
against an in-process server on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from ops.bench.bench_grpc import ROOT, Proc, bench_system, scrape, wait_serving, window_delta
from ops.bench.workloads import ID_HIGH, Requests, flops_per_request, parse_workload
from service.serving.proto_gen import load as load_stubs

ONLINE, NORMAL = 1, 2
SLO_ONLINE_P99_MS = 80.0


# ---- client loops ------------------------------------------------------------------------------------

@dataclass
class Outcome:
    sent_s: float  # since the loop began
    latency_s: float
    code: str  # grpc.StatusCode name
    priority: int
    retry_after_ms: int | None = None
    impossible: bool = False  # DEADLINE_EXCEEDED at admission (the deadline could never be met), not late work


# (message, priority, deadline_s or None) for the i-th request
MakeRequest = Callable[[int], tuple[Any, int, float | None]]


async def call_once(call: Any, msg: Any, priority: int, deadline_s: float | None, t0: float,
                    metadata: Sequence[tuple[str, str]] = ()) -> Outcome:
    sent = time.perf_counter()
    try:
        await call(msg, timeout=deadline_s, metadata=tuple(metadata) or None)
        return Outcome(sent - t0, time.perf_counter() - sent, "OK", priority)
    except grpc.aio.AioRpcError as e:
        latency = time.perf_counter() - sent
        retry = next((int(v) for k, v in (e.trailing_metadata() or ()) if k == "retry-after-ms"), None)
        impossible = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "no retry can meet it" in (e.details() or "")
        return Outcome(sent - t0, latency, e.code().name, priority, retry, impossible)


async def closed_loop(call: Any, make: MakeRequest, clients: int, duration_s: float, honor_hints: bool = True,
                      metadata: Sequence[tuple[str, str]] = (), first_index: int = 0) -> list[Outcome]:
    """`clients` tasks, each sending its next request when its last one is answered; a refusal with a
    retry-after-ms hint is followed by that long a pause when honor_hints."""
    out: list[Outcome] = []
    t0 = time.perf_counter()
    end = t0 + duration_s
    counter = [first_index]

    async def client() -> None:
        while time.perf_counter() < end:
            i = counter[0]
            counter[0] += 1
            msg, priority, deadline_s = make(i)
            o = await call_once(call, msg, priority, deadline_s, t0, metadata)
            out.append(o)
            if honor_hints and o.retry_after_ms is not None:
                await asyncio.sleep(min(o.retry_after_ms / 1e3, max(end - time.perf_counter(), 0.0)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def open_loop(call: Any, make: MakeRequest, rate_per_s: float, duration_s: float, seed: int = 1,
                    metadata: Sequence[tuple[str, str]] = (), first_index: int = 0, grace_s: float = 30.0,
                    progress: Callable[[float, list[Outcome], int], None] | None = None,
                    progress_every_s: float = 10.0) -> list[Outcome]:
    """Poisson arrivals at rate_per_s for duration_s, whatever the answers; refusals are not retried.
    Calls still unanswered grace_s after the last send are cancelled and count as CLIENT_CANCELLED
    (a client that cannot keep up, or a server that never answers, ends the run rather than hanging
    it); progress(t_s, outcomes so far, sent so far), when given, is called each progress_every_s of
    the send schedule."""
    rng = random.Random(seed)
    out: list[Outcome] = []
    pending: dict[asyncio.Task, tuple[float, int]] = {}  # the call -> when it was sent, its priority
    t0 = time.perf_counter()
    next_s, i, sent, next_report = 0.0, first_index, 0, progress_every_s

    def finished(task: asyncio.Task) -> None:
        pending.pop(task, None)
        if not task.cancelled():
            out.append(task.result())

    while next_s < duration_s:
        delay = t0 + next_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        msg, priority, deadline_s = make(i)
        task = asyncio.ensure_future(call_once(call, msg, priority, deadline_s, t0, metadata))
        pending[task] = (time.perf_counter() - t0, priority)
        task.add_done_callback(finished)
        i, sent = i + 1, sent + 1
        next_s += rng.expovariate(rate_per_s)
        if progress is not None and next_s >= next_report:
            progress(next_s, out, sent)
            next_report = (next_s // progress_every_s + 1) * progress_every_s
    if pending:
        await asyncio.wait(set(pending), timeout=grace_s)
    waited_s = time.perf_counter() - t0
    for task, (sent_s, priority) in list(pending.items()):  # never answered within the grace
        task.cancel()
        out.append(Outcome(sent_s, waited_s - sent_s, "CLIENT_CANCELLED", priority))
    await asyncio.sleep(0)  # let the cancellations run
    return out


async def _probe(call: Callable[[], Any], counted: grpc.StatusCode, duration_s: float,
                 interval_s: float) -> list[float]:
    """call() every interval_s for duration_s: the latencies of the calls that ended with `counted`
    (a probe lost to the load is not a latency)."""
    out: list[float] = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        t = time.perf_counter()
        try:
            await call()
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            code = e.code()
        if code == counted:
            out.append(time.perf_counter() - t)
        await asyncio.sleep(interval_s)
    return out


async def health_probe(channel: Any, duration_s: float, interval_s: float = 0.05) -> list[float]:
    """grpc.health.v1 Check every interval_s on the channel the load uses: the latency of an RPC the
    engine answers with no work of its own (gRPC and its event loop only; relayed through a front
    with `--fronts N`), under the same load."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    return await _probe(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0), grpc.StatusCode.OK,
                        duration_s, interval_s)


async def floor_probe(channel: Any, method: str, msg: Any, duration_s: float, interval_s: float = 0.05) -> list[float]:
    """The same request, on its own connection, every interval_s to the floor server (below), from
    the same client process under the same load: the latency of a refusal by a bare grpc.aio server
    that does nothing else. No refusal through Python gRPC on this host can be faster; the gap
    between it and slmrank's refusals is what slmrank's refusing costs."""
    call = channel.unary_unary(method, request_serializer=type(msg).SerializeToString)
    return await _probe(lambda: call(msg, timeout=1.0), grpc.StatusCode.UNAVAILABLE, duration_s, interval_s)


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def outcome_of(answer: Any, sent_s: float, priority: int) -> Outcome:
    """An h2call.Answer as an Outcome (call_once's, for a grpc.aio call)."""
    code = _CODE_NAMES.get(answer.status, grpc.StatusCode.UNKNOWN.name)
    retry = answer.trailers.get("retry-after-ms")
    return Outcome(sent_s, answer.latency_s, code, priority, int(retry) if retry and retry.isdigit() else None,
                   code == "DEADLINE_EXCEEDED" and "no retry can meet it" in answer.message)


def quiet_loop(call: Callable[[Any, float | None], Any], floor_call: Callable[[Any, float | None], Any] | None,
               make: MakeRequest, duration_s: float, interval_s: float) -> tuple[list[Outcome], list[float]]:
    """One call at a time, blocking: make(i) to call(msg, deadline_s) (an h2call.Answer back), then
    (when given) the same message to floor_call, then a pause of interval_s; for duration_s.
    Returns call's outcomes and the latencies of floor_call's refusals (UNAVAILABLE)."""
    out: list[Outcome] = []
    floor: list[float] = []
    t0 = time.perf_counter()
    i = 0
    while (sent := time.perf_counter() - t0) < duration_s:
        msg, priority, deadline_s = make(i)
        i += 1
        out.append(outcome_of(call(msg, deadline_s), sent, priority))
        if floor_call is not None:
            answer = floor_call(msg, 1.0)
            if answer.status == grpc.StatusCode.UNAVAILABLE.value[0]:
                floor.append(answer.latency_s)
        time.sleep(interval_s)
    return out, floor


def _floor_server(cpus: set[int] | None, conn: Any) -> None:
    """A process: a grpc.aio server on uvloop (as a front) that refuses every call at once, as a
    front refuses (UNAVAILABLE, a message, a retry-after-ms trailer); sends its port, then serves
    until terminated."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    class Refuse(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> Any:
            async def refuse(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded (floor): refused; retry after 5 ms",
                                    trailing_metadata=(("retry-after-ms", "5"),))
            return grpc.unary_unary_rpc_method_handler(refuse)

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Refuse(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        conn.send(port)
        await server.wait_for_termination()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(serve())


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop where installed (slmrank serves on it, and a caller in production would use it): the
    client's own overhead is part of every latency measured here."""
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return None


def pct_ms(values_s: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values_s) * 1e3, q)) if len(values_s) else float("nan")


def summarize(outcomes: Sequence[Outcome], window_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.code == "OK"]
    refused = [o for o in outcomes if o.code == "UNAVAILABLE"]
    online_ok = [o.latency_s for o in ok if o.priority == ONLINE]
    hints = [o.retry_after_ms for o in outcomes if o.retry_after_ms is not None]
    return {
        "sent": len(outcomes), "codes": dict(Counter(o.code for o in outcomes)),
        "served_qps": len(ok) / window_s,
        "late_deadline_exceeded": sum(o.code == "DEADLINE_EXCEEDED" and not o.impossible for o in outcomes),
        "impossible": sum(o.impossible for o in outcomes),
        "ok_p50_ms": pct_ms([o.latency_s for o in ok], 50), "ok_p99_ms": pct_ms([o.latency_s for o in ok], 99),
        "online_served": len(online_ok), "online_p50_ms": pct_ms(online_ok, 50), "online_p99_ms": pct_ms(online_ok, 99),
        "refused": len(refused), "refusal_p50_ms": pct_ms([o.latency_s for o in refused], 50),
        "refusal_p99_ms": pct_ms([o.latency_s for o in refused], 99),
        "max_retry_after_ms": max(hints, default=None),
    }


# ---- the H200 run -------------------------------------------------------------------------------------

def _requests(w: dict[str, Any], high: int, seed: int, online_share: float, online_deadline_s: float,
              deadline_s: float) -> tuple[list[Any], MakeRequest]:
    """The workload's requests (a pool of 256, built ahead: building a message costs more than
    sending it) and make(i): the i-th, ONLINE with online_share's probability, else NORMAL."""
    reqs = Requests(w, high, seed=seed)
    pool = [reqs.next() for _ in range(256)]
    rng = random.Random(seed)

    def make(i: int) -> tuple[Any, int, float | None]:
        msg = type(pool[0])()
        msg.CopyFrom(pool[i % len(pool)])
        online = rng.random() < online_share
        msg.priority = ONLINE if online else NORMAL
        return msg, msg.priority, online_deadline_s if online else deadline_s

    return pool, make


def _method(w: dict[str, Any]) -> str:
    return "/slmrank.v1.Ranker/" + ("Score" if w["kind"] == "score" else "BeamSearch")


def _quiet_worker(target: str, floor_target: str | None, w: dict[str, Any], high: int, seed: int, duration_s: float,
                  interval_s: float, online_share: float, online_deadline_s: float, deadline_s: float,
                  cpus: set[int] | None, conn: Any) -> None:
    """A quiet caller's process (quiet_loop, through ops/bench/h2call.py): sends back its outcomes and
    its floor refusals."""
    from ops.bench.h2call import H2Caller

    if cpus:
        os.sched_setaffinity(0, cpus)
    _, make = _requests(w, high, seed, online_share, online_deadline_s, deadline_s)
    method = _method(w)
    callers = []
    for t in (target, floor_target):
        if t:
            host, port = t.rsplit(":", 1)
            callers.append(H2Caller(host, int(port)))
    try:
        calls = [lambda msg, d, c=c: c.call(method, msg.SerializeToString(), timeout_s=d) for c in callers]
        outcomes, floor = quiet_loop(calls[0], calls[1] if floor_target else None, make, duration_s, interval_s)
    finally:
        for c in callers:
            c.close()
    conn.send({"outcomes": [asdict(o) for o in outcomes], "floor": floor})
    conn.close()


def split_cpus(cpus: Sequence[int], clients: int) -> tuple[set[int], set[int]]:
    """--client-cpus: (the server's CPUs, the load clients' CPUs): the last `clients` of cpus for
    the clients, the rest for the server."""
    ordered = sorted(cpus)
    if not 1 <= clients < len(ordered):
        raise SystemExit(f"--client-cpus {clients}: between 1 and {len(ordered) - 1} (this process may use "
                         f"{len(ordered)} CPUs)")
    return set(ordered[:-clients]), set(ordered[-clients:])


def _worker(target: str, w: dict[str, Any], high: int, seed: int, rate_per_s: float, duration_s: float,
            online_share: float, online_deadline_s: float, deadline_s: float, channels: int, floor_target: str | None,
            cpus: set[int] | None, conn: Any) -> None:
    """One client process: its share of the open loop; sends back its outcomes."""
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def main() -> list[Any]:  # outcomes, health probes[, floor probes]
        stubs = load_stubs()
        pool, make = _requests(w, high, seed, online_share, online_deadline_s, deadline_s)

        def progress(t_s: float, outcomes: list[Outcome], sent: int) -> None:  # a run cut short still shows this
            codes = Counter(o.code for o in outcomes)
            print(f"  client {seed}: {t_s:.0f} s, sent {sent}, answered {len(outcomes)} {dict(codes)}", flush=True)

        # channels connections of its own (a local subchannel pool each: gRPC would otherwise share one
        # connection among a process's channels to the same target), the calls dealt round-robin:
        # a fleet of callers holds many connections, and SO_REUSEPORT spreads connections, not calls,
        # over `serve --fronts N`
        chans = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(channels)]
        try:
            await asyncio.gather(*(ch.channel_ready() for ch in chans))
            stubs_ = [stubs.pb2_grpc.RankerStub(ch) for ch in chans]
            methods = [s.Score if w["kind"] == "score" else s.BeamSearch for s in stubs_]
            turn = itertools.count()

            def call(msg: Any, **kw: Any) -> Any:
                return methods[next(turn) % len(methods)](msg, **kw)

            grace_s = max(online_deadline_s, deadline_s) + 10.0
            probes: list[Any] = [health_probe(chans[0], duration_s)]
            if floor_target:
                floor = grpc.aio.insecure_channel(floor_target, options=[("grpc.use_local_subchannel_pool", 1)])
                chans.append(floor)
                await floor.channel_ready()
                probes.append(floor_probe(floor, _method(w), pool[0], duration_s))
            return await asyncio.gather(open_loop(call, make, rate_per_s, duration_s, seed=seed, grace_s=grace_s,
                                                  progress=progress), *probes)
        finally:
            await asyncio.gather(*(ch.close() for ch in chans))

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        outcomes, probes, *floor = runner.run(main())
    conn.send({"outcomes": [asdict(o) for o in outcomes], "probes": probes, "floor": floor[0] if floor else []})
    conn.close()


class Sampler:
    """The server's RSS and device memory, once a second, on a thread; with metrics_url, also its
    admission state (calibration, the fronts' ingress delay, queue depths, refusals by reason so far)."""

    GAUGES = {"slmrank_admission_calibration": "calibration", "slmrank_front_ingress_delay_seconds": "ingress_s",
              "slmrank_admission_parallelism": "parallelism"}

    def __init__(self, pid: int, gpu: bool, metrics_url: str | None = None) -> None:
        self.pid, self.gpu, self.metrics_url = pid, gpu, metrics_url
        self.rows: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            row = {"t_s": round(time.perf_counter() - self._t0, 2), "rss_mb": self._rss_mb()}
            if self.gpu:
                row["gpu_mb"] = self._gpu_mb()
            if self.metrics_url:
                row.update(self._admission())
            self.rows.append(row)

    def _admission(self) -> dict[str, Any]:
        try:
            m = scrape(self.metrics_url)
        except OSError:
            return {}
        row: dict[str, Any] = {key: m[(series, "")] for series, key in self.GAUGES.items() if (series, "") in m}
        for (series, labels), v in m.items():
            if series == "slmrank_queue_depth" and (lane := re.search(r'lane="([^"]+)"', labels)):
                row[f"queued_{lane.group(1)}"] = v
            elif series == "slmrank_admission_lane_error" and (lane := re.search(r'priority="([^"]+)"', labels)):
                row.setdefault("lane_error", {})[lane.group(1)] = v
            elif series == "slmrank_refused_total" and v and (reason := re.search(r'reason="([^"]+)"', labels)):
                row.setdefault("refused", {})[reason.group(1)] = v
        return row

    def _rss_mb(self) -> float:
        """The server's RSS, with its front processes' (serve --fronts N: its children)."""
        total, pids = float("nan"), [self.pid]
        try:
            pids += [int(c) for c in Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()]
        except OSError:
            pass
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total = (0.0 if total != total else total) + int(line.split()[1]) / 1024
            except OSError:
                pass
        return total

    def _gpu_mb(self) -> float:
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return float("nan")
        for line in out.splitlines():
            pid, _, mb = line.partition(",")
            if pid.strip() == str(self.pid):
                return float(mb)
        return float("nan")

    def stop(self) -> list[dict[str, float]]:
        self._stop.set()
        self.thread.join(5)
        return self.rows


def admission_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sampled admission state over the run: calibration, each lane's own error and the fronts'
    ingress delay (mean, max), and the refusals by reason in each 10 s of it (where a run turned
    more cautious shows)."""
    cal = [r["calibration"] for r in rows if "calibration" in r]
    if not cal:
        return None
    ing = [r["ingress_s"] * 1e3 for r in rows if "ingress_s" in r]
    periods: dict[int, Counter] = {}
    before: dict[str, float] | None = None
    for r in rows:
        if "calibration" not in r:  # the scrape failed
            continue
        now = r.get("refused", {})
        if before is not None:
            grew = periods.setdefault(int(r["t_s"] // 10), Counter())
            for reason, v in now.items():
                if v > before.get(reason, 0.0):
                    grew[reason] += int(v - before.get(reason, 0.0))
        before = now
    lanes = sorted({lane for r in rows for lane in r.get("lane_error", {})})
    lane_error = {lane: float(np.mean([r["lane_error"][lane] for r in rows if lane in r.get("lane_error", {})]))
                  for lane in lanes}
    return {"calibration_mean": float(np.mean(cal)), "calibration_max": max(cal), "lane_error_mean": lane_error,
            "ingress_ms_mean": float(np.mean(ing)) if ing else None, "ingress_ms_max": max(ing) if ing else None,
            "refused_per_10s": [{"from_s": 10 * k, "refused": dict(c)} for k, c in sorted(periods.items())]}


def flatness(rows: list[dict[str, float]], key: str, edge_s: float = 10.0) -> dict[str, float] | None:
    values = [(r["t_s"], r[key]) for r in rows if key in r and r[key] == r[key]]
    if len(values) < 2:
        return None
    end = values[-1][0]
    first = [v for t, v in values if t <= values[0][0] + edge_s]
    last = [v for t, v in values if t >= end - edge_s]
    return {"first_mb": float(np.mean(first)), "last_mb": float(np.mean(last)),
            "max_mb": max(v for _, v in values), "growth_mb": float(np.mean(last) - np.mean(first))}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from service.artifact.resolve import resolve_artifact

    w = parse_workload(args.workload)
    model = args.model or w.get("model") or "embedded:tiny"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    artifact = resolve_artifact(model, quiet=True)
    high = min(ID_HIGH, artifact.config.vocab_size)
    runtime = args.runtime or ("cpp" if args.device == "cuda" else "python")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "workload": w, "model": model,
        "server_root": args.server_root,
        "device": args.device, "runtime": runtime, "dtype": dtype, "factor": args.factor,
        "duration_s": args.duration_s, "online_share": args.online_share, "client_procs": args.client_procs,
        "channels_per_proc": args.channels_per_proc,
        "deadlines_ms": {"ONLINE": args.online_deadline_ms, "NORMAL": args.deadline_ms},
        "logical_flops_per_request": flops_per_request(artifact.config, w)}
    server_cpus, client_cpus = (split_cpus(os.sched_getaffinity(0), args.client_cpus) if args.client_cpus
                                else (None, None))
    result["cpus"] = ({"server": sorted(server_cpus), "clients": sorted(client_cpus)} if server_cpus
                      else {"all": len(os.sched_getaffinity(0))})
    server = Proc("slmrank", [
        sys.executable, "-m", "service.cli", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--runtime", runtime, "--device", args.device, "--dtype", dtype, "--grace-s", "10",
        "--kernels", args.kernels, *args.serve_args.split()], out / "slmrank_server.log", args.start_timeout_s,
        Path(args.server_root), cpus=server_cpus)
    try:
        await wait_serving(server.target, args.start_timeout_s)
        if args.capacity:
            result["capacity"] = {"qps": args.capacity, "given": True}
        else:
            args.seed, args.stop_above_ms, args.rpc_timeout_s = 7, 2000.0, 60.0
            system = await bench_system("slmrank", server.target, w, high, args, 0, server.metrics_url)
            cap = system["capacity"] or {"qps": system["max_qps"], "within_slo": False}
            result["capacity"] = cap
            result["capacity_levels"] = system["levels"]
        rate = args.factor * result["capacity"]["qps"]
        print(f"capacity {result['capacity']['qps']:.1f} req/s; offering {rate:.1f} req/s for {args.duration_s:.0f} s "
              f"from {args.client_procs} processes", flush=True)
        sampler = Sampler(server.proc.pid, args.device == "cuda", server.metrics_url)
        scraped = await asyncio.to_thread(scrape, server.metrics_url) if server.metrics_url else None
        t_clients = time.perf_counter()
        ctx = mp.get_context("spawn")
        pipes, procs = [], []
        floor_target, floor_proc = None, None
        if args.floor:  # the bare refusal's latency beside the load (floor_probe)
            parent, child = ctx.Pipe(duplex=False)
            floor_proc = ctx.Process(target=_floor_server, args=(server_cpus, child), daemon=True)
            floor_proc.start()
            if await asyncio.to_thread(parent.poll, 30.0):
                floor_target = f"127.0.0.1:{parent.recv()}"
        for k in range(args.client_procs):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(server.target, w, high, 100 + k, rate / args.client_procs,
                                                  args.duration_s, args.online_share, args.online_deadline_ms / 1e3,
                                                  args.deadline_ms / 1e3, args.channels_per_proc, floor_target,
                                                  client_cpus, child))
            p.start()
            pipes.append(parent)
            procs.append(p)
        quiet = []
        for k in range(args.quiet_callers):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_quiet_worker, args=(server.target, floor_target, w, high, 900 + k,
                                                        args.duration_s, args.quiet_interval_ms / 1e3,
                                                        args.online_share, args.online_deadline_ms / 1e3,
                                                        args.deadline_ms / 1e3, server_cpus, child))
            p.start()
            quiet.append(parent)
            procs.append(p)
        # each worker ends by itself (its unanswered calls cancelled after a grace): this bounds a
        # worker that died or hung without answering, so the rest of the run is still reported
        end = time.monotonic() + args.duration_s + max(args.online_deadline_ms, args.deadline_ms) / 1e3 + 120.0
        sent, lost = [], 0
        for parent in pipes:
            try:
                if not await asyncio.to_thread(parent.poll, max(end - time.monotonic(), 0.0)):
                    raise EOFError
                sent.append(parent.recv())
            except (EOFError, OSError):
                lost += 1
        quiet_sent, quiet_lost = ({"outcomes": [], "floor": []} if quiet else None), 0
        for parent in quiet:
            try:
                if not await asyncio.to_thread(parent.poll, max(end - time.monotonic(), 0.0)):
                    raise EOFError
                part = parent.recv()
                quiet_sent["outcomes"] += part["outcomes"]
                quiet_sent["floor"] += part["floor"]
            except (EOFError, OSError):
                quiet_lost += 1
        outcomes = [Outcome(**o) for part in sent for o in part["outcomes"]]
        probes = [t for part in sent for t in part["probes"]]
        floor = [t for part in sent for t in part["floor"]]
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if floor_proc is not None:
            floor_proc.terminate()
            floor_proc.join(10)
        if scraped is not None:
            result["server"] = server_view(scraped, await asyncio.to_thread(scrape, server.metrics_url),
                                           time.perf_counter() - t_clients,
                                           len(outcomes) + len((quiet_sent or {}).get("outcomes", ())))
        result["memory"] = {"samples": sampler.stop()}
        result["memory"]["rss"] = flatness(result["memory"]["samples"], "rss_mb")
        result["memory"]["gpu"] = flatness(result["memory"]["samples"], "gpu_mb")
        result["admission"] = admission_summary(result["memory"]["samples"])
        s = summarize(outcomes, args.duration_s)
        s["offered_qps"] = len(outcomes) / args.duration_s
        s["served_share_of_capacity"] = s["served_qps"] / result["capacity"]["qps"]
        s.update(health_probes=len(probes), probe_p50_ms=pct_ms(probes, 50), probe_p99_ms=pct_ms(probes, 99),
                 floor_probes=len(floor), floor_p50_ms=pct_ms(floor, 50), floor_p99_ms=pct_ms(floor, 99),
                 client_procs_lost=lost)
        if quiet_sent is not None:
            q = [Outcome(**o) for o in quiet_sent["outcomes"]]
            refused = [o.latency_s for o in q if o.code == "UNAVAILABLE"]
            served = [o.latency_s for o in q if o.code == "OK"]
            s["quiet"] = {"callers": args.quiet_callers, "lost": quiet_lost, "interval_ms": args.quiet_interval_ms,
                          "sent": len(q), "codes": dict(Counter(o.code for o in q)),
                          "refused": len(refused), "refusal_p50_ms": pct_ms(refused, 50),
                          "refusal_p99_ms": pct_ms(refused, 99), "refusal_max_ms": pct_ms(refused, 100),
                          "served": len(served), "ok_p50_ms": pct_ms(served, 50), "ok_p99_ms": pct_ms(served, 99),
                          "floor_probes": len(quiet_sent["floor"]), "floor_p50_ms": pct_ms(quiet_sent["floor"], 50),
                          "floor_p99_ms": pct_ms(quiet_sent["floor"], 99)}
        result["overload"] = s
    finally:
        result["server_exit_code"] = server.stop()
    (out / "overload.json").write_text(json.dumps(result, indent=1))
    return result


def server_view(before: dict, after: dict, window_s: float, sent: int) -> dict[str, Any]:
    """What the server saw of the overload window (its /metrics before and after): the RPCs it
    finished by status code, how many of those sent it never finished (they waited in gRPC's queue
    past their deadline, or were cut off by the client first), and its event loop's busy share."""
    d = window_delta(before, after)
    codes: dict[str, int] = {}
    for (series, labels), v in d.items():
        if series == "slmrank_requests_total" and v and (m := re.search(r'code="([^"]+)"', labels)):
            codes[m.group(1)] = codes.get(m.group(1), 0) + int(v)
    loop_s = d.get(("slmrank_event_loop_cpu_seconds_total", ""))
    # the admitted requests that ended DEADLINE_EXCEEDED, by why: expired in the queue (never run),
    # cancelled (the caller's deadline cut the RPC while it was queued), or run and answered late
    admitted_late = {reason: int(d.get(("slmrank_dropped_total", f'reason="{reason}"'), 0))
                     for reason in ("expired", "cancelled")}
    admitted_late.update({f"{reason}_in_flight": int(d.get(("slmrank_dropped_in_flight_total", f'reason="{reason}"'), 0))
                          for reason in ("expired", "cancelled")})
    admitted_late["answered_late"] = int(d.get(("slmrank_answered_late_total", ""), 0))
    # serve --fronts N: what the fronts refused never reached the engine's RPC counts
    refused = {m.group(1): int(v) for (series, labels), v in d.items()
               if series == "slmrank_refused_total" and v and (m := re.search(r'reason="([^"]+)"', labels))}
    front_refused = sum(v for reason, v in refused.items() if reason.startswith("front_"))
    return {"codes": codes, "finished": sum(codes.values()), "refused_by_reason": refused,
            "front_refused": front_refused,
            "never_finished": sent - sum(codes.values()) - front_refused, "admitted_late": admitted_late,
            "loop_busy": round(loop_s / window_s, 3) if loop_s is not None else None}


def print_report(result: dict[str, Any]) -> None:
    s, cap = result["overload"], result["capacity"]
    print(f"\n== {result['workload']['name']} overload at {result['factor']}x capacity ({cap['qps']:.1f} req/s), "
          f"{result['duration_s']:.0f} s ==")
    print(f"offered {s['offered_qps']:.1f} req/s; served {s['served_qps']:.1f} req/s = "
          f"{s['served_share_of_capacity']:.1%} of capacity (target >= 90%)")
    print(f"ONLINE served {s['online_served']}: p50 {s['online_p50_ms']:.1f} ms, p99 {s['online_p99_ms']:.1f} ms "
          f"(target < {SLO_ONLINE_P99_MS:.0f} ms)")
    print(f"refused {s['refused']}: p50 {s['refusal_p50_ms']:.3f} ms, p99 {s['refusal_p99_ms']:.3f} ms "
          f"(target < 1 ms); largest retry hint {s['max_retry_after_ms']} ms")
    if s.get("health_probes"):
        print(f"health checks beside the load (gRPC and the event loop alone) {s['health_probes']}: "
              f"p50 {s['probe_p50_ms']:.3f} ms, p99 {s['probe_p99_ms']:.3f} ms")
    if s.get("floor_probes"):
        print(f"a bare grpc.aio server's refusal beside the load (the floor) {s['floor_probes']}: "
              f"p50 {s['floor_p50_ms']:.3f} ms, p99 {s['floor_p99_ms']:.3f} ms")
    if q := s.get("quiet"):
        if q["lost"]:
            print(f"quiet callers lost (no outcomes back): {q['lost']} of {q['callers']}")
        if q["sent"]:
            print(f"{q['callers']} quiet callers (HTTP/2 by hand, one call at a time each, every {q['interval_ms']:g} ms) "
                  f"sent {q['sent']} {q['codes']}: "
                  f"refusals p50 {q['refusal_p50_ms']:.3f} ms, p99 {q['refusal_p99_ms']:.3f} ms, max "
                  f"{q['refusal_max_ms']:.3f} ms; served p50 {q['ok_p50_ms']:.2f} ms, p99 {q['ok_p99_ms']:.2f} ms; "
                  f"the bare server's refusals p50 {q['floor_p50_ms']:.3f} ms, p99 {q['floor_p99_ms']:.3f} ms")
    if c := result.get("cpus", {}).get("clients"):
        print(f"CPUs: load clients on {c[0]}-{c[-1]}, the rest on {result['cpus']['server']}")
    if s.get("client_procs_lost"):
        print(f"client processes lost (no outcomes back): {s['client_procs_lost']} of {result['client_procs']}")
    print(f"codes {s['codes']}; admitted but late (DEADLINE_EXCEEDED): {s['late_deadline_exceeded']} (target 0); "
          f"deadlines no request could meet: {s['impossible']}")
    if sv := result.get("server"):
        if sv.get("front_refused"):
            print(f"server: its front processes refused {sv['front_refused']} themselves")
        print(f"server: finished {sv['finished']} of the {s['sent']} sent {sv['codes']}, never finished "
              f"{sv['never_finished']} (they waited in gRPC's queue); event loop busy {sv['loop_busy']} "
              f"(CPU seconds a second; near 1: the loop is the limit)")
        late = sv["admitted_late"]
        print(f"server: admitted, then expired {late['expired']} ({late.get('expired_in_flight', 0)} of them in a "
              f"running batch), cancelled {late['cancelled']} ({late.get('cancelled_in_flight', 0)} in a running batch), "
              f"run and answered late {late['answered_late']} (target 0)")
    if a := result.get("admission"):
        ing = "" if a["ingress_ms_max"] is None else (f"; the fronts' ingress delay mean {a['ingress_ms_mean']:.2f} ms, "
                                                     f"max {a['ingress_ms_max']:.1f} ms")
        lanes = ", ".join(f"{lane} {v:.2f}" for lane, v in a["lane_error_mean"].items())
        print(f"admission: calibration mean {a['calibration_mean']:.2f}, max {a['calibration_max']:.2f} "
              f"(each lane's own error, mean: {lanes or 'none'}){ing}")
        if sv := result.get("server"):
            print(f"server: refused by reason {sv.get('refused_by_reason')}")
    if (sv := result.get("server")) and (by := sv.get("refused_by_reason")):
        engine = sum(v for reason, v in by.items() if not reason.startswith("front_"))
        # a refusal by the engine waits behind its event loop (the backlog the fronts shed at): where
        # these are more than 1% of the refusals, the refusals' P99 is theirs
        print(f"server: the engine itself refused {engine} of {sum(by.values())} "
              f"({100 * engine / max(sum(by.values()), 1):.2f}%; above 1% the refusals' P99 is the engine's)")
    for key in ("rss", "gpu"):
        f = result["memory"][key]
        if f:
            print(f"{key.upper()}: first 10 s {f['first_mb']:.0f} MB, last 10 s {f['last_mb']:.0f} MB "
                  f"(growth {f['growth_mb']:+.0f} MB, max {f['max_mb']:.0f} MB)")
    print(f"server exit code {result['server_exit_code']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", required=True, help="W1..W6, or a custom one (ops/bench/workloads.py)")
    p.add_argument("--factor", type=float, default=3.0, help="offered load, in multiples of the capacity")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--capacity", type=float, default=0.0, help="req/s; default: measured first")
    p.add_argument("--levels", default="1,2,4,8,16,32,64", help="closed-loop levels for the capacity")
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--measure-s", type=float, default=5.0)
    p.add_argument("--online-share", type=float, default=0.2)
    p.add_argument("--online-deadline-ms", type=float, default=80.0)
    p.add_argument("--deadline-ms", type=float, default=1000.0, help="NORMAL requests' deadline")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--channels-per-proc", type=int, default=4,
                   help="connections per client process, the calls dealt round-robin over them")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="no bare-refusal probe (floor_probe) beside the load")
    p.add_argument("--quiet-callers", type=int, default=2, help="quiet callers (quiet_loop); 0: none")
    p.add_argument("--quiet-interval-ms", type=float, default=20.0, help="a quiet caller's pause between its calls")
    p.add_argument("--client-cpus", type=int, default=0,
                   help="run the load's client processes on the last N CPUs, everything else on the rest "
                        "(default 0: no pinning)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/overload_bench"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default=None)
    p.add_argument("--runtime", default=None, choices=["python", "cpp"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--kernels", default="aten", choices=["aten", "triton"])
    p.add_argument("--server-root", default=str(ROOT),
                   help="the source tree slmrank's server runs from (default: this one); an A/B run measures "
                        "another version of the server with the same load (ops/device/overload AB_ROUNDS)")
    p.add_argument("--serve-args", default="",
                   help="more `slmrank serve` flags, e.g. '--admission-max-queue-online 64'")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if (args.factor <= 0 or args.duration_s <= 0 or args.client_procs < 1 or args.channels_per_proc < 1
            or not 0 <= args.online_share <= 1 or args.quiet_interval_ms < 0 or args.client_cpus < 0
            or args.quiet_callers < 0):
        raise SystemExit("--factor > 0, --duration-s > 0, --client-procs >= 1, --channels-per-proc >= 1, "
                         "0 <= --online-share <= 1, --quiet-interval-ms >= 0, --client-cpus >= 0, --quiet-callers >= 0")
    result = asyncio.run(run(args))
    print_report(result)
    return result


if __name__ == "__main__":
    main()
