"""Observability over real gRPC on loopback: a RankerServer (embedded:tiny, Python runtime) on its
own uvloop thread, traced into the OpenTelemetry SDK's in-memory exporter, with its metrics port.

One request yields a span for every stage (receive, decode, tokenize, queue, batch, execute and the
executor's phases, every DAG node the batch ran, d2h, unpack, encode, send), nested under the
request span, each inside its parent, in order, within what the client itself measured. GET
/metrics counts requests by kind and status, latencies and queue depths; GET /trace is the Chrome
trace of the same requests.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.serving.server import RankerServer, ServerConfig
from service.serving.server_thread import ServerThread
from service.observe.trace_report import breakdown
from service.observe.records import WALL_OFFSET_NS

# every request of these tests is kept: rate 1, no budget (the environment's settings do not leak in)
TRACING_ENV = {"SLMRANK_TRACE_SAMPLE_RATE": "1", "SLMRANK_TRACE_MAX_KEPT_PER_S": "0",
               "SLMRANK_TRACE_CHROME_MAX_EVENTS": "20000"}
TOP_LEVEL = ["receive", "decode", "queue", "batch", "execute", "answer", "encode", "send"]  # in this order, disjoint


def http_get(port: int, path: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text exposition -> {(name, {label: value}): value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[m.group(1), labels] = float(m.group(3))
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def eventually(fn: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """fn() once it is truthy. grpc.aio's context.abort sends the status before it raises, so the
    client may see an error a moment before TracingInterceptor has finished that request's trace."""
    end = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < end, "not within the timeout"
        time.sleep(0.01)
    return value


@pytest.fixture(scope="module")
def traced(model):
    exporter = InMemorySpanExporter()
    with pytest.MonkeyPatch.context() as mp:
        for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "SLMRANK_TRACE_SLOW_MS"):
            mp.delenv(key, raising=False)
        for key, value in TRACING_ENV.items():
            mp.setenv(key, value)
        config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=0, trace_port=0)
        srv = ServerThread(RankerServer(config, lambda: model, span_exporter=exporter), wait_ready=True)
    srv.wait_serving()
    srv.exporter = exporter
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(traced):
    return traced  # conftest's client talks to it


def _one_request_spans(srv: ServerThread, send: Callable[[], Any]) -> tuple[Any, list[Any], int, int]:
    """Sends one request; its spans (root, all), and the client's own send/receive times (wall ns)."""
    srv.exporter.clear()
    t0 = time.monotonic_ns() + WALL_OFFSET_NS
    send()
    t1 = time.monotonic_ns() + WALL_OFFSET_NS
    # SimpleSpanProcessor exports each span as it ends, the root last; the trace is recorded on the
    # server loop's next turn after the response bytes went to gRPC, so it may trail the answer
    spans = eventually(lambda: (got := srv.exporter.get_finished_spans()) and any(s.parent is None for s in got)
                       and got)
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1, [s.name for s in spans]
    assert all(s.context.trace_id == roots[0].context.trace_id for s in spans)
    return roots[0], list(spans), t0, t1


def _check_tree(root: Any, spans: list[Any], t0: int, t1: int, dag_nodes: list[str], text: bool) -> dict[str, Any]:
    by_id = {s.context.span_id: s for s in spans}
    names = [s.name for s in spans]
    node_spans = sorted((s for s in spans if "slmrank.node" in s.attributes), key=lambda s: s.start_time)
    stages = {s.name: s for s in spans if s not in node_spans and s is not root}
    assert len(stages) == len(spans) - len(node_spans) - 1, f"a stage twice: {names}"

    # every stage, and exactly the DAG nodes the batch ran, in the artifact's order
    expected = set(TOP_LEVEL) | {"h2d", "d2h", "unpack"} | ({"tokenize"} if text else set())
    assert expected <= set(stages) <= expected | {"executor_queue", "launch"}, sorted(stages)
    assert [s.name for s in node_spans] == dag_nodes

    # nesting: tokenize in decode; the executor's phases and the nodes in execute; the rest in the request
    parent = {s.name: by_id[s.parent.span_id] for s in spans if s.parent is not None}
    for name in TOP_LEVEL:
        assert parent[name] is root, name
    if text:
        assert parent["tokenize"] is stages["decode"]
    for name in ("h2d", "d2h", "unpack", "executor_queue", *(n for n in dag_nodes)):
        if name in parent:
            assert parent[name] is stages["execute"], name

    # consistent times: each span inside its parent, the request inside what the client measured
    for s in spans:
        assert s.start_time <= s.end_time, s.name
        if s.parent is not None:
            p = by_id[s.parent.span_id]
            assert p.start_time <= s.start_time and s.end_time <= p.end_time, (s.name, p.name)
    assert t0 <= root.start_time and root.end_time <= t1
    # the request ends when its response is serialized (recording it comes after, off its path)
    assert root.end_time == stages["send"].end_time
    # the request's stages follow one another and cover most of it: between them is handler glue, and
    # the event loop's other work (a few ms when the machine is busy)
    for a, b in zip(TOP_LEVEL, TOP_LEVEL[1:]):
        assert stages[a].end_time <= stages[b].start_time, (a, b)
    covered = sum(stages[n].end_time - stages[n].start_time for n in TOP_LEVEL)
    assert covered >= 0.5 * (root.end_time - root.start_time)
    # inside execute: executor queue, h2d, nodes one after another, d2h, unpack
    order = [n for n in ("executor_queue", "h2d", "launch") if n in stages] + node_spans + ["d2h", "unpack"]
    order = [stages[s] if isinstance(s, str) else s for s in order]
    for a, b in zip(order, order[1:]):
        assert a.end_time <= b.start_time, (a.name, b.name)
    assert sum(s.end_time - s.start_time for s in node_spans) > 0

    assert root.attributes["slmrank.status"] == "OK" and root.attributes["rpc.grpc.status_code"] == 0
    assert root.attributes["slmrank.batch_size"] >= 1 and root.attributes["slmrank.bucket"]
    return stages


def test_score_request_spans_every_stage_and_dag_node(traced, client, model):
    labels = model.tokenizer.encode(" yes") + model.tokenizer.encode(" no")
    root, spans, t0, t1 = _one_request_spans(traced, lambda: client.score(
        [" Trail runner 3", " Garden hose, 20 m"], labels, prefix="Query: running shoes. Relevant?", priority="online"))
    assert root.name == "Score" and root.attributes["rpc.method"] == "Score"
    stages = _check_tree(root, spans, t0, t1, [n.name for n in model.artifact.score_dag], text=True)
    assert stages["tokenize"].attributes["slmrank.count"] == 3  # prefix and two samples: one span over them
    assert root.attributes["slmrank.samples"] == 2 and root.attributes["slmrank.priority"] == "ONLINE"


@pytest.mark.parametrize("new_tokens", [2, 5])
def test_beam_request_spans_only_the_decode_steps_it_ran(traced, client, model, new_tokens):
    root, spans, t0, t1 = _one_request_spans(traced, lambda: client.beam(list(range(100, 116)), 3, new_tokens))
    assert root.name == "BeamSearch"
    ran = [n.name for n in model.artifact.beam_dag if n.step < new_tokens]
    assert len(ran) < len(model.artifact.beam_dag) or new_tokens == model.artifact.limits.max_new_tokens
    stages = _check_tree(root, spans, t0, t1, ran, text=False)
    assert "tokenize" not in stages  # ids only: nothing to tokenize
    assert root.attributes["slmrank.beam_width"] == 3 and root.attributes["slmrank.new_tokens"] == new_tokens


def test_refused_request_is_traced_with_its_status(traced, client):
    traced.exporter.clear()
    with pytest.raises(grpc.RpcError) as err:
        client.beam([1, 2, 3], 0, 2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (root,) = eventually(lambda: [s for s in traced.exporter.get_finished_spans() if s.parent is None])
    assert root.attributes["slmrank.status"] == "INVALID_ARGUMENT" and root.attributes["rpc.grpc.status_code"] == 3
    assert {s.name for s in traced.exporter.get_finished_spans()} == {"BeamSearch", "receive", "decode"}


def test_metrics_count_requests_by_kind_and_status(traced, client):
    port = traced.server.metrics_server.port
    status, ctype, text = http_get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain; version=0.0.4")
    before = parse_metrics(text)
    for i in range(3):
        client.score([[1, 2, 3 + i]], [5, 6], priority="normal")
    client.beam([1, 2, 3], 2, 1, priority="background")
    for bad in ([], [-1]):  # no label ids; a label id outside the vocabulary
        with pytest.raises(grpc.RpcError) as err:
            client.score([[1, 2]], bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError):
        client.beam([1], 2, 99)

    def finished(samples: dict) -> float:
        return sum(v for (name, _), v in samples.items() if name == "slmrank_requests_total")

    after = eventually(lambda: (m := parse_metrics(http_get(port, "/metrics")[2]))
                       and finished(m) - finished(before) == 7 and m)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("slmrank_requests_total", kind="Score", code="OK") == 3
    assert delta("slmrank_requests_total", kind="Score", code="INVALID_ARGUMENT") == 2
    assert delta("slmrank_requests_total", kind="BeamSearch", code="OK") == 1
    assert delta("slmrank_requests_total", kind="BeamSearch", code="INVALID_ARGUMENT") == 1
    # latency histograms: every finished request; the +Inf bucket equals the count
    # by lane: the invalid requests set no priority, which is NORMAL's (PRIORITY_UNSPECIFIED)
    assert delta("slmrank_request_latency_seconds_count", kind="Score", priority="NORMAL") == 5
    assert delta("slmrank_request_latency_seconds_bucket", kind="Score", priority="NORMAL", le="+Inf") == 5
    assert delta("slmrank_request_latency_seconds_count", kind="BeamSearch", priority="BACKGROUND") == 1
    assert delta("slmrank_request_latency_seconds_count", kind="BeamSearch", priority="NORMAL") == 1
    assert delta("slmrank_request_latency_seconds_sum", kind="Score", priority="NORMAL") > 0
    for stage in ("receive", "decode", "queue", "batch", "execute", "encode", "send"):  # only executed ones queue
        assert delta("slmrank_request_stage_seconds_count", kind="Score", stage=stage) == (
            5 if stage in ("receive", "decode") else 3), stage
    # scheduler gauges and counters: queue depth per lane (idle now), batches, admissions
    for lane in ("ONLINE", "NORMAL", "BACKGROUND"):
        assert ("slmrank_queue_depth", frozenset({("lane", lane)})) in after
        assert metric(after, "slmrank_queue_depth", lane=lane) == 0
    assert metric(after, "slmrank_batches_inflight") == 0
    assert delta("slmrank_admitted_total", priority="NORMAL") == 3
    assert delta("slmrank_admitted_total", priority="BACKGROUND") == 1
    assert delta("slmrank_batch_size_count") == 4 and delta("slmrank_batches_total", outcome="ok") == 4
    assert any(name == "slmrank_bucket_occupancy" and v > 0 for (name, _), v in after.items())
    assert metric(after, "slmrank_batch_service_seconds") > 0
    assert delta("slmrank_node_seconds_total", category="layers", clock="host") > 0
    stats = traced.on_loop(traced.server.stats)
    assert stats["statuses"]["Score.INVALID_ARGUMENT"] >= 2 and stats["tracing"]["kept"] >= 7

    with pytest.raises(urllib.error.HTTPError) as err404:
        http_get(port, "/nothing-here")
    assert err404.value.code == 404


def test_latency_of_an_online_request_is_in_the_online_series(traced, client):
    port = traced.server.metrics_server.port
    count = "slmrank_request_latency_seconds_count"
    before = parse_metrics(http_get(port, "/metrics")[2])
    client.score([[1, 2, 3]], [5, 6], priority="online")
    with pytest.raises(grpc.RpcError) as err:  # invalid, yet sent in the ONLINE lane: counted there
        client.score([[1, 2]], [], priority="online")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = eventually(lambda: (m := parse_metrics(http_get(port, "/metrics")[2]))
                       and metric(m, count, kind="Score", priority="ONLINE") - metric(before, count, kind="Score",
                                                                                       priority="ONLINE") == 2 and m)
    for lane in ("NORMAL", "BACKGROUND", "none"):
        assert metric(after, count, kind="Score", priority=lane) == metric(before, count, kind="Score", priority=lane)
    client.model_info()  # no lane: "none"
    eventually(lambda: metric(parse_metrics(http_get(port, "/metrics")[2]), count, kind="ModelInfo", priority="none")
               >= 1)


def test_chrome_trace_endpoint_has_the_requests(traced, client):
    client.score(["a text sample"], [1, 2], prefix="prefix text")
    trace_server, metrics_server = traced.server.trace_server, traced.server.metrics_server
    status, ctype, body = http_get(trace_server.port, "/trace")
    assert status == 200 and ctype == "application/json"
    # /trace has a port of its own, on the loopback; the scrape port serves /metrics alone, and back
    assert trace_server.host == "127.0.0.1" and trace_server.port != metrics_server.port
    for port, path in ((metrics_server.port, "/trace"), (trace_server.port, "/metrics")):
        with pytest.raises(urllib.error.HTTPError) as err404:
            http_get(port, path)
        assert err404.value.code == 404, (port, path)
    events = json.loads(body)["traceEvents"]
    kinds = breakdown(events)
    assert kinds["Score"].statuses["OK"] >= 1
    stages = set(kinds["Score"].stages)
    assert {"receive", "decode", "tokenize", "queue", "batch", "execute", "h2d", "d2h", "unpack", "encode",
            "send", "DAG nodes"} <= stages, stages
    assert {"layers", "lm_head", "embed"} <= set(kinds["Score"].nodes)
