"""Traces: one request yields a span for every stage and every DAG node, nested, with consistent
times; tail-based sampling; the Chrome trace file and `slmrank trace`; the grpc.aio wiring; and a
real Scheduler run on embedded:tiny traced from its own Completed.timings."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from service.sched.admission import Priority
from service.observe.chrome_trace import ChromeTraceWriter
from service.cli import main as cli_main
from service.observe.metrics import ServerMetrics
from service.observe.trace_report import breakdown, load_events
from service.observe.records import WALL_OFFSET_NS, Completed, RequestTimings, RequestTrace, build_records, current_trace
from service.observe.tracing import OTLP_PACKAGES, RequestTracer, TracingConfig, otlp_exporter
from service.runtime.timings import BatchTimings, NodeTiming
from service.serving.interceptor import TracingInterceptor

MS = 1_000_000
NODES = [("masks", 0.01, 0.02), ("embed", 0.01, 0.05), ("layer.0", 0.01, 1.0), ("layer.1", 0.01, 1.0),
         ("final_norm", 0.01, 0.03), ("lm_head", 0.01, 0.5)]
STAGES = {"receive", "decode", "tokenize", "queue", "batch", "execute", "executor_queue", "h2d", "d2h", "unpack",
          "encode", "send"}


def synthetic(base: int, graph: bool = True, batch_id: int = 7, batch_index: int = 0, scale: float = 1.0,
              kind: str = "Score") -> RequestTrace:
    """A request of about 6.7 ms * scale, its times laid out by hand (ms from base)."""

    def at(ms: float) -> int:
        return base + round(ms * scale * MS)

    tr = RequestTrace(kind, at(0))
    tr.add_stage("receive", at(0), at(0.1))
    tr.add_stage("decode", at(0.1), at(1.0))
    tr.add_stage("tokenize", at(0.2), at(0.3))  # two text segments: one merged span
    tr.add_stage("tokenize", at(0.4), at(0.5))
    nodes = [(n, h * scale, d * scale) for n, h, d in NODES]
    if not graph:
        nodes = [(n, d, -1.0) for n, _, d in nodes]  # eager on the CPU: host times only
    ex = BatchTimings(submit_ns=at(3.0), start_ns=at(3.1), h2d_end_ns=at(3.2),
                      launch_ns=at(3.3) if graph else at(3.2), d2h_end_ns=at(6.0), done_ns=at(6.05), graph=graph,
                      nodes=tuple(NodeTiming(*n) for n in nodes))
    tr.completed(Completed(None, RequestTimings(Priority.ONLINE, at(1.1) / 1e9, at(2.0) / 1e9, at(2.9) / 1e9,
                                                at(6.2) / 1e9, batch_id, 3, batch_index, "score.t64.s64", ex)))
    tr.set(samples=2, tokens=40)
    tr.add_stage("encode", at(6.3), at(6.5))
    tr.add_stage("send", at(6.5), at(6.6))
    tr.end_ns = at(6.7)
    return tr


def keep_all(exporter: InMemorySpanExporter | None = None, **kw: Any) -> RequestTracer:
    config = TracingConfig(sample_rate=1.0, max_kept_per_s=0, **kw)
    return RequestTracer(config, exporter=exporter or InMemorySpanExporter())


def span_tree(exporter: InMemorySpanExporter) -> tuple[Any, dict[int, Any], dict[str, list[Any]]]:
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1
    return roots[0], by_id, by_name


# ---- spans -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_one_span_per_stage_and_node_nested_and_consistent(graph: bool) -> None:
    exporter = InMemorySpanExporter()
    base = time.monotonic_ns()
    assert keep_all(exporter).finish(synthetic(base, graph=graph), "OK")
    root, by_id, by_name = span_tree(exporter)

    expected = {"Score"} | STAGES | {n for n, _, _ in NODES} | ({"launch"} if graph else set())
    assert set(by_name) == expected and all(len(v) == 1 for v in by_name.values())
    one = {name: spans[0] for name, spans in by_name.items()}
    assert root.name == "Score" and root.start_time == base + WALL_OFFSET_NS
    assert root.end_time - root.start_time == round(6.7 * MS)
    assert root.attributes["slmrank.batch_id"] == 7 and root.attributes["slmrank.bucket"] == "score.t64.s64"
    assert root.attributes["slmrank.priority"] == "ONLINE" and root.attributes["slmrank.samples"] == 2
    assert root.attributes["rpc.grpc.status_code"] == 0 and root.attributes["slmrank.sampled"] == "rate"

    parent_of = {s.name: by_id[s.parent.span_id].name for s in exporter.get_finished_spans() if s.parent}
    assert parent_of["tokenize"] == "decode"
    for name in ("receive", "decode", "queue", "batch", "execute", "encode", "send"):
        assert parent_of[name] == "Score"
    for name in ("executor_queue", "h2d", "d2h", "unpack", *(n for n, _, _ in NODES)):
        assert parent_of[name] == "execute"
    for s in exporter.get_finished_spans():
        assert s.context.trace_id == root.context.trace_id
        assert s.start_time <= s.end_time
        if s.parent:
            p = by_id[s.parent.span_id]
            assert p.start_time <= s.start_time and s.end_time <= p.end_time, s.name
    assert one["tokenize"].attributes["slmrank.count"] == 2
    assert one["tokenize"].attributes["slmrank.busy_ms"] == pytest.approx(0.2)

    # execute's children run one after the other: queue, h2d, (launch), nodes..., d2h, unpack
    order = ["executor_queue", "h2d", *(["launch"] if graph else []), *(n for n, _, _ in NODES), "d2h", "unpack"]
    for a, b in zip(order, order[1:]):
        assert one[a].end_time <= one[b].start_time + 1, (a, b)
    for name, host_ms, device_ms in NODES:
        s = one[name]
        assert s.attributes["slmrank.node"] == name
        assert s.end_time - s.start_time == round(device_ms * MS)  # the graph's device time, or the eager host time
        assert s.attributes["slmrank.device_ms"] == (device_ms if graph else -1.0)
    node_ns = sum(one[n].end_time - one[n].start_time for n, _, _ in NODES)
    execute_ns = one["execute"].end_time - one["execute"].start_time
    assert node_ns == round(sum(d for _, _, d in NODES) * MS)
    assert 0.75 * execute_ns < node_ns <= execute_ns  # the nodes are most of execute here
    if graph:
        assert one["masks"].start_time == one["execute"].start_time + round(0.4 * MS)  # at the launch


def test_records_stay_inside_parents_when_clocks_disagree() -> None:
    """Device times longer than launch -> D2H (the graph began before replay() returned): the
    nodes start earlier, never before H2D ends, and still end inside execute."""
    base = time.monotonic_ns()
    tr = synthetic(base)
    ex = tr.timings.executor
    ex = dataclasses.replace(ex, nodes=tuple(n._replace(device_ms=n.device_ms * 3) for n in ex.nodes))
    tr.timings = dataclasses.replace(tr.timings, executor=ex)
    records = build_records(tr)
    for r in records[1:]:
        p = records[r.parent]
        assert p.start_ns <= r.start_ns <= r.end_ns <= p.end_ns
    first = next(r for r in records if r.name == "masks")
    assert first.start_ns == ex.h2d_end_ns


@pytest.mark.parametrize("code, span_status", [
    # OpenTelemetry's gRPC conventions: a server span is ERROR for the server's failures only
    ("INVALID_ARGUMENT", StatusCode.UNSET), ("NOT_FOUND", StatusCode.UNSET), ("CANCELLED", StatusCode.UNSET),
    ("INTERNAL", StatusCode.ERROR), ("UNAVAILABLE", StatusCode.ERROR), ("DEADLINE_EXCEEDED", StatusCode.ERROR),
    ("UNKNOWN", StatusCode.ERROR), ("UNIMPLEMENTED", StatusCode.ERROR), ("DATA_LOSS", StatusCode.ERROR),
])
def test_error_status_and_no_execution(code: str, span_status: StatusCode) -> None:
    exporter = InMemorySpanExporter()
    tr = RequestTrace("BeamSearch")
    with tr.stage("receive"):
        pass
    with pytest.raises(ValueError), tr.stage("decode"):
        raise ValueError("bad field")
    assert keep_all(exporter).finish(tr, code)
    root, _, by_name = span_tree(exporter)
    assert set(by_name) == {"BeamSearch", "receive", "decode"}
    assert root.status.status_code == span_status
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode[code].value[0]


def test_caller_trace_context_is_continued() -> None:
    exporter = InMemorySpanExporter()
    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    tr = RequestTrace("Score", traceparent=f"00-{trace_id}-{span_id}-01")
    keep_all(exporter).finish(tr)
    (root,) = exporter.get_finished_spans()
    assert format(root.context.trace_id, "032x") == trace_id
    assert format(root.parent.span_id, "016x") == span_id


# ---- sampling ------------------------------------------------------------------------------------

def test_tail_sampling_fast_dropped_slow_kept() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TracingConfig(sample_rate=0.0, slow_ms=20.0, max_kept_per_s=0), exporter=exporter)
    base = time.monotonic_ns()
    assert not tracer.finish(synthetic(base), "OK")  # 6.7 ms
    assert exporter.get_finished_spans() == ()
    assert tracer.chrome is not None and tracer.chrome.num_events == 0
    assert tracer.finish(synthetic(base, scale=4.0), "OK")  # 26.8 ms
    root, _, _ = span_tree(exporter)
    assert root.attributes["slmrank.sampled"] == "slow"
    assert (tracer.num_finished, tracer.num_kept) == (2, 1)


def test_sample_rate_keeps_about_that_share() -> None:
    tracer = RequestTracer(TracingConfig(sample_rate=0.25, seed=3))
    fast = synthetic(time.monotonic_ns())
    kept = sum(tracer.sample(fast) == "rate" for _ in range(4000))
    assert 900 <= kept <= 1100


def test_kept_traces_stay_within_their_budget() -> None:
    """Under overload every request is slow: the budget bounds what tracing costs the loop."""
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TracingConfig(sample_rate=1.0, max_kept_per_s=5), exporter=exporter)
    base = time.monotonic_ns()
    kept = sum(tracer.finish(synthetic(base, scale=4.0)) for _ in range(40))
    assert kept == 5 and tracer.num_over_budget == 35
    assert len([s for s in exporter.get_finished_spans() if s.parent is None]) == 5


def test_nothing_built_without_an_exporter_or_chrome() -> None:
    tracer = RequestTracer(TracingConfig(sample_rate=1.0, chrome_max_events=0))
    assert tracer.chrome is None and not tracer.finish(synthetic(time.monotonic_ns()))


# ---- OTLP configuration --------------------------------------------------------------------------

def test_config_from_env() -> None:
    c = TracingConfig.from_env({"SLMRANK_TRACE_SAMPLE_RATE": "0.5", "SLMRANK_TRACE_SLOW_MS": "5",
                                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert (c.sample_rate, c.slow_ms, c.otlp_protocol) == (0.5, 5.0, "http/protobuf")
    assert c.otlp_endpoint == "http://collector:4318/v1/traces"
    assert TracingConfig.from_env({}).otlp_endpoint is None
    assert TracingConfig.from_env({}, sample_rate=1.0).sample_rate == 1.0
    with pytest.raises(ValueError, match="SLMRANK_TRACE_SLOW_MS"):
        TracingConfig.from_env({"SLMRANK_TRACE_SLOW_MS": "fast"})
    with pytest.raises(ValueError, match="sample_rate"):
        TracingConfig(sample_rate=2.0)


def test_otlp_without_its_package_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    module, package = OTLP_PACKAGES["grpc"]
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail, installed or not
    with pytest.raises(RuntimeError, match=package):
        otlp_exporter("http://localhost:4317")
    with pytest.raises(RuntimeError, match="pip install"):
        RequestTracer(TracingConfig(otlp_endpoint="http://localhost:4317"))


# ---- Chrome trace and `slmrank trace` --------------------------------------------------------------

def assert_rows_nest(events: list[dict[str, Any]]) -> None:
    """Within one (pid, tid), any two complete events are disjoint or one holds the other."""
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        rows.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in rows.values():
        stack: list[float] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= e["ts"] + 1e-6:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-6, e
            stack.append(e["ts"] + e["dur"])


def test_chrome_trace_is_valid_and_consistent(tmp_path: Path) -> None:
    tracer = keep_all()
    base = time.monotonic_ns()
    tracer.finish(synthetic(base, batch_index=0))
    tracer.finish(synthetic(base + MS // 2, batch_index=1))  # same batch, overlapping in time
    tracer.finish(synthetic(base + 20 * MS, batch_id=8, graph=False))
    path = tmp_path / "trace.json"
    assert tracer.chrome is not None
    num = tracer.chrome.write(path)
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert num == len(events) > 0
    assert data["otherData"]["requests"] == 3 and data["displayTimeUnit"] == "ms"
    names = {(e["pid"], e["args"]["name"]) for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {(1, "requests"), (2, "executor (host)"), (3, "GPU (device time)")}
    for e in events:
        assert e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] in (1, 2, 3) and e["tid"] >= 1
    assert_rows_nest(events)
    roots = [e for e in events if e["cat"] == "request"]
    assert len(roots) == 3 and len({(e["pid"], e["tid"]) for e in roots[:2]}) == 2  # overlapping: two rows
    assert [e["dur"] for e in roots] == pytest.approx([6700.0] * 3)
    # each batch is drawn once per lane: batch 7 (graph) on the executor and the GPU, batch 8 (eager) on the executor
    batches = sorted((e["pid"], e["args"]["batch_id"]) for e in events if e["cat"] == "batch")
    assert batches == [(2, 7), (2, 8), (3, 7)]
    gpu_nodes = [e["name"] for e in events if e["pid"] == 3 and e["cat"] == "node"]
    assert gpu_nodes == [n for n, _, _ in NODES]


def test_chrome_trace_is_bounded() -> None:
    writer = ChromeTraceWriter(max_events=100)
    base = time.monotonic_ns()
    writer.add(build_records(synthetic(base, batch_id=99)))
    assert writer.num_dropped_groups == 0  # one request fits
    for i in range(20):
        writer.add(build_records(synthetic(base + (i + 1) * 10 * MS, batch_id=i)))
    assert writer.num_events <= 100 and writer.num_dropped_groups > 0
    data = writer.to_json()
    assert data["otherData"]["requests"] + data["otherData"]["requests_dropped"] == 21
    kept = {e["args"]["request"] for e in data["traceEvents"] if e.get("cat") == "request"}
    assert kept and max(kept) == 20  # the newest are kept


def test_chrome_trace_renders_each_group_once_and_the_same_json() -> None:
    """/trace renders on its listener's thread, handing the GIL to the event loop between chunks; a
    refresh renders only the requests kept since the last one (each group keeps its row and its
    text), and the text is the one-piece rendering's whatever the chunk size."""
    writer = ChromeTraceWriter(max_events=10_000)
    base = time.monotonic_ns()
    for i in range(12):  # overlapping requests: several rows per process
        writer.add(build_records(synthetic(base + i * 3 * MS, batch_id=i // 2, batch_index=i % 2, scale=1 + i / 7)))
    snap = writer.snapshot()
    pauses = [0]
    text = snap.dumps(pause=lambda: pauses.__setitem__(0, pauses[0] + 1), chunk=1)
    data = json.loads(text)
    n_groups = len(snap.groups)
    assert pauses[0] == n_groups  # chunk=1: a pause after every group rendered
    assert text == json.dumps(snap.to_json(), separators=(",", ":"))
    assert max(e["tid"] for e in data["traceEvents"] if e["pid"] == 1) >= 2  # overlapping requests: rows
    pauses[0] = 0
    assert writer.snapshot().dumps(pause=lambda: pauses.__setitem__(0, pauses[0] + 1), chunk=1) == text
    assert pauses[0] == 0  # nothing new: nothing rendered again
    writer.add(build_records(synthetic(base + 40 * MS, batch_id=99)))
    again = writer.snapshot().dumps(pause=lambda: pauses.__setitem__(0, pauses[0] + 1), chunk=1)
    assert 1 <= pauses[0] <= 3 and len(again) > len(text)  # the new request's groups only
    assert json.loads(again)["traceEvents"][-1]["ts"] >= 0
    empty = ChromeTraceWriter().snapshot()
    assert empty.dumps(pause=lambda: None) == json.dumps(empty.to_json(), separators=(",", ":"))


def test_trace_command_prints_where_the_time_went(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracer = keep_all()
    base = time.monotonic_ns()
    for i in range(10):
        tracer.finish(synthetic(base + i * 10 * MS, batch_id=i, scale=1 + i / 10))
    path = tmp_path / "trace.json"
    assert tracer.chrome is not None
    tracer.chrome.write(path)
    assert cli_main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.strip()}
    assert out.startswith("Score: 10 requests (OK 10)")
    for stage in ("receive", "decode", "tokenize", "queue", "batch", "execute", "h2d", "d2h", "encode", "send",
                  "layers", "lm_head"):
        assert stage in lines, stage
    n, mean, p50, p99, share = lines["queue"][1:]
    assert int(n) == 10 and float(p50) <= float(p99)
    assert float(mean) == pytest.approx(0.9 * 1.45, abs=1e-3)  # 0.9 ms at scales 1.0 .. 1.9
    assert float(share.rstrip("%")) == pytest.approx(0.9 / 6.7 * 100, abs=0.1)
    assert float(lines["layers"][2]) == pytest.approx(2.0 * 1.45, abs=1e-3)
    assert "where the time went: layers 30%" in out
    kinds = breakdown(load_events(path))
    assert sum(kinds["Score"].share(s.values_ms) for name, s in kinds["Score"].stages.items()
               if s.parent == "Score") == pytest.approx(1.0)  # top-level stages + unaccounted = end to end


# ---- grpc.aio wiring -------------------------------------------------------------------------------

def _fake_done(start_ns: int, end_ns: int) -> Completed:
    mid = (start_ns + end_ns) // 2
    ex = BatchTimings.host(mid, mid, end_ns, (NodeTiming("embed", (end_ns - mid) / 2e6, -1.0),
                                              NodeTiming("lm_head", (end_ns - mid) / 2e6, -1.0)))
    return Completed(None, RequestTimings(Priority.NORMAL, start_ns / 1e9, start_ns / 1e9, mid / 1e9, end_ns / 1e9,
                                          1, 1, 0, "score.t64.s64", ex))


async def _serve_and_call(tracer: RequestTracer, metrics: ServerMetrics, inner_parses: bool) -> list[grpc.StatusCode]:
    async def score(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        trace = current_trace()  # what a Ranker handler does
        if inner_parses:  # raw bytes in: the handler (the server's status interceptor) parses them
            with trace.stage("receive"):
                request = bytes(request)
        with trace.stage("decode"):
            if request == b"bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "samples: too many")
        start = time.monotonic_ns()
        await asyncio.sleep(0.002)
        trace.completed(_fake_done(start, time.monotonic_ns()))
        with trace.stage("encode"):
            return request.upper()

    server = grpc.aio.server(interceptors=[TracingInterceptor(tracer, metrics)])
    handler = grpc.unary_unary_rpc_method_handler(score, request_deserializer=None if inner_parses else bytes,
                                                  response_serializer=bytes)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("slmrank.v1.Ranker", {"Score": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/slmrank.v1.Ranker/Score")
            for body in (b"ok", b"bad", b"ok"):
                try:
                    assert await call(body, timeout=10) == body.upper()
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
    finally:
        await server.stop(0)
    return codes


@pytest.mark.parametrize("inner_parses", [False, True], ids=["grpc-parses", "handler-parses"])
def test_interceptor_traces_rpcs_with_their_status(inner_parses: bool) -> None:
    exporter = InMemorySpanExporter()
    tracer, metrics = keep_all(exporter), ServerMetrics()
    codes = asyncio.run(_serve_and_call(tracer, metrics, inner_parses))
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK]
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert [r.attributes["slmrank.status"] for r in roots] == ["OK", "INVALID_ARGUMENT", "OK"]
    ok = roots[0].context.trace_id
    assert {s.name for s in spans if s.context.trace_id == ok} == {
        "Score", "receive", "decode", "queue", "batch", "execute", "h2d", "embed", "lm_head", "d2h", "unpack",
        "encode", "send"}
    assert {s.name for s in spans if s.context.trace_id == roots[1].context.trace_id} == {"Score", "receive", "decode"}
    assert all("slmrank.count" not in s.attributes for s in spans if s.name == "receive")  # recorded once
    count = lambda code: metrics.registry.get_sample_value("slmrank_requests_total", {"kind": "Score", "code": code})  # noqa: E731
    assert count("OK") == 2 and count("INVALID_ARGUMENT") == 1


# ---- a real scheduler ----------------------------------------------------------------------------

def test_real_scheduler_request_traced_from_its_timings(embedded_tiny, embedded_tiny_runtime) -> None:
    from service.sched.batcher import Scheduler
    from service.runtime.requests import BeamRequest, ScoreRequest

    art = embedded_tiny[1]

    async def run() -> list[tuple[RequestTrace, Completed]]:
        sched = Scheduler(art, embedded_tiny_runtime)
        await sched.start()
        out = []
        try:
            for kind, req in (("Score", ScoreRequest(samples=((5, 6, 7), (8, 9)), label_ids=(1, 2), prefix_ids=(3, 4))),
                              ("BeamSearch", BeamRequest(prompt_ids=(5, 6, 7), beam_width=2, new_tokens=2))):
                trace = RequestTrace(kind)
                with trace.stage("decode"):
                    trace.set_request(req, Priority.ONLINE)
                done = await sched.submit(req, Priority.ONLINE)
                trace.completed(done)
                with trace.stage("encode"):
                    pass
                out.append((trace, done))
        finally:
            await sched.close()
        return out

    exporter = InMemorySpanExporter()
    tracer = keep_all(exporter)
    for trace, done in asyncio.run(run()):
        exporter.clear()
        assert tracer.finish(trace, "OK")
        executed = [n.name for n in done.timings.executor.nodes]
        if trace.kind == "Score":
            assert executed == [n.name for n in art.score_dag]
        else:
            assert "step1.beam_step" in executed and "step2.embed" not in executed  # new_tokens=2: steps 0, 1
        root, by_id, by_name = span_tree(exporter)
        node_spans = sorted((s for s in exporter.get_finished_spans() if "slmrank.node" in s.attributes),
                            key=lambda s: s.start_time)
        assert [s.name for s in node_spans] == executed
        execute = by_name["execute"][0]
        assert all(by_id[s.parent.span_id] is execute for s in node_spans)
        for a, b in zip(node_spans, node_spans[1:]):
            assert a.end_time <= b.start_time
        for s in exporter.get_finished_spans():
            if s.parent:
                p = by_id[s.parent.span_id]
                assert p.start_time <= s.start_time <= s.end_time <= p.end_time, s.name
        node_ns = sum(s.end_time - s.start_time for s in node_spans)
        assert node_ns <= execute.end_time - execute.start_time
        for name in ("decode", "queue", "batch", "execute", "h2d", "d2h", "unpack", "encode"):
            assert name in by_name, name
        assert root.attributes["slmrank.batch_size"] == 1 and root.attributes["slmrank.priority"] == "ONLINE"
        assert root.attributes["slmrank.bucket"] == done.timings.bucket
