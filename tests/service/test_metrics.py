"""Prometheus metrics: the text exposition parses and shows what was observed (requests by kind
and code, latency and stage histograms, node time, a real Scheduler's queue, batch and bucket
numbers, the process, build and model identity), and /metrics answers over HTTP from its own
thread: while the event loop is blocked, for bad requests without a traceback, bounded."""

from __future__ import annotations

import asyncio
import json
import math
import re
import struct
import threading
import time
import urllib.request
from typing import Any

import pytest

from service.sched.admission import Priority
from service.observe.chrome_trace import ChromeTraceWriter
from service.observe.metrics import LANES, LATENCY_BUCKETS_S, MetricsServer, ServerMetrics, render, scheduler_families
from service.runtime.requests import BindError
from service.observe.records import Completed, RequestTimings, RequestTrace, build_records
from service.runtime.timings import BatchTimings, NodeTiming

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
ALLOWED_SAMPLES = {"process_cpu_seconds_total"}  # prometheus_client's own family names


def parse(text: str) -> dict[str, dict[str, Any]]:
    """A strict reader of the text format: every sample under its family's HELP and TYPE, names and
    labels well formed, values floats, histogram buckets cumulative and ending in +Inf = _count."""
    families: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in families, f"{name} twice"
            current = families[name] = {"help": line.split(" ", 3)[3], "type": None, "samples": []}
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert current is families[name] and kind in SUFFIXES
            current["type"] = kind
        else:
            m = SAMPLE.match(line)
            assert m and current is not None, line
            name, labels, value = m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))
            family = next(f for f in families if current is families[f])
            assert name in {family + s for s in SUFFIXES[current["type"]]}, line
            current["samples"].append((name, labels, value))
    for name, f in families.items():
        if f["type"] == "histogram":
            series: dict[tuple, list[tuple[float, float]]] = {}
            for n, labels, v in f["samples"]:
                key = tuple(sorted((k, x) for k, x in labels.items() if k != "le"))
                if n.endswith("_bucket"):
                    series.setdefault(key, []).append((float(labels["le"]), v))
            for key, buckets in series.items():
                assert [b for b, _ in buckets] == sorted(b for b, _ in buckets) and buckets[-1][0] == math.inf
                assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), name
                count = value_of(families, f"{name}_count", dict(key))
                assert buckets[-1][1] == count
    return families


def value_of(families: dict[str, dict[str, Any]], sample: str, labels: dict[str, str] | None = None) -> float:
    labels = labels or {}
    for f in families.values():
        for name, ls, v in f["samples"]:
            if name == sample and {k: x for k, x in ls.items() if k != "le" or "le" in labels} == labels:
                return v
    raise KeyError((sample, labels))


def finished(kind: str, status: str, latency_ms: float, stages: dict[str, float] | None = None,
             priority: str | None = None) -> RequestTrace:
    start = time.monotonic_ns()
    tr = RequestTrace(kind, start)
    if priority is not None:
        tr.attrs["priority"] = priority  # as the server's handler sets it
    at = start
    for name, ms in (stages or {}).items():
        tr.add_stage(name, at, at + round(ms * 1e6))
        at += round(ms * 1e6)
    tr.end_ns, tr.status = start + round(latency_ms * 1e6), status
    return tr


def test_exposition_shows_known_observations() -> None:
    m = ServerMetrics()
    for ms in (0.5, 1.0, 4.0, 4.0, 150.0):  # 1.0 lies on a bound: counted in le="0.001"
        m.observe(finished("Score", "OK", ms, {"decode": 0.2, "encode": 0.05}))
    m.observe(finished("Score", "INVALID_ARGUMENT", 0.3, {"decode": 0.1}))
    m.observe(finished("BeamSearch", "OK", 30.0))
    fam = parse(m.exposition())

    assert fam["slmrank_requests_total"]["type"] == "counter"
    assert value_of(fam, "slmrank_requests_total", {"kind": "Score", "code": "OK"}) == 5
    assert value_of(fam, "slmrank_requests_total", {"kind": "Score", "code": "INVALID_ARGUMENT"}) == 1
    assert value_of(fam, "slmrank_requests_total", {"kind": "BeamSearch", "code": "OK"}) == 1
    lat = "slmrank_request_latency_seconds"
    score, beam = {"kind": "Score", "priority": "none"}, {"kind": "BeamSearch", "priority": "none"}  # no lane set
    assert value_of(fam, f"{lat}_count", score) == 6
    assert value_of(fam, f"{lat}_sum", score) == pytest.approx((0.5 + 1 + 4 + 4 + 150 + 0.3) / 1e3)
    assert value_of(fam, f"{lat}_bucket", {**score, "le": "0.001"}) == 3
    assert value_of(fam, f"{lat}_bucket", {**score, "le": "0.005"}) == 5
    assert value_of(fam, f"{lat}_bucket", {**score, "le": "0.1"}) == 5
    assert value_of(fam, f"{lat}_bucket", {**score, "le": "0.2"}) == 6
    assert value_of(fam, f"{lat}_bucket", {**beam, "le": "0.03"}) == 1
    assert value_of(fam, f"{lat}_bucket", {**beam, "le": "0.02"}) == 0
    assert {float(ls["le"]) for n, ls, _ in fam[lat]["samples"] if n.endswith("_bucket")} == {*LATENCY_BUCKETS_S,
                                                                                            math.inf}
    stage = "slmrank_request_stage_seconds"
    assert value_of(fam, f"{stage}_count", {"kind": "Score", "stage": "decode"}) == 6
    assert value_of(fam, f"{stage}_sum", {"kind": "Score", "stage": "encode"}) == pytest.approx(5 * 0.05e-3)


def test_latency_is_kept_per_lane_and_the_lanes_are_a_fixed_set() -> None:
    m = ServerMetrics()
    m.observe(finished("Score", "OK", 2.0, priority="ONLINE"))
    m.observe(finished("Score", "OK", 90.0, priority="BACKGROUND"))
    m.observe(finished("Score", "OK", 4.0, priority="ONLINE"))
    m.observe(finished("Score", "UNAVAILABLE", 0.1, priority="made-up"))  # not a lane: no series of its own
    fam = parse(m.exposition())
    lat = "slmrank_request_latency_seconds"
    assert value_of(fam, f"{lat}_count", {"kind": "Score", "priority": "ONLINE"}) == 2
    assert value_of(fam, f"{lat}_bucket", {"kind": "Score", "priority": "ONLINE", "le": "0.005"}) == 2
    assert value_of(fam, f"{lat}_bucket", {"kind": "Score", "priority": "BACKGROUND", "le": "0.075"}) == 0
    assert value_of(fam, f"{lat}_count", {"kind": "Score", "priority": "none"}) == 1
    assert {ls["priority"] for _, ls, _ in fam[lat]["samples"]} == {"ONLINE", "BACKGROUND", "none"}
    assert LANES == {p.name for p in Priority}  # the label's values are the scheduler's lanes


NODES = [("embed", 0.01, 0.05), ("layer.0", 0.01, 1.0), ("layer.1", 0.01, 1.0), ("step1.lm_head", 0.01, 0.5)]


def executed(batch_id: int, batch_index: int, graph: bool) -> RequestTrace:
    """A 1 ms request whose batch ran NODES (device times in graph mode, host times eager)."""
    start = time.monotonic_ns()
    nodes = NODES if graph else [(n, d, -1.0) for n, _, d in NODES]
    ex = BatchTimings(submit_ns=start, start_ns=start, h2d_end_ns=start, launch_ns=start,
                      d2h_end_ns=start + 3_000_000, done_ns=start + 3_000_000, graph=graph,
                      nodes=tuple(NodeTiming(*n) for n in nodes))
    timings = RequestTimings(Priority.NORMAL, start / 1e9, start / 1e9, start / 1e9, (start + 3_000_000) / 1e9,
                             batch_id, 2, batch_index, "score.t64.s64", ex)
    tr = RequestTrace("Score", start)
    tr.completed(Completed(None, timings))
    tr.end_ns = start + 4_000_000
    return tr


def test_node_time_by_category_once_per_batch() -> None:
    m = ServerMetrics()
    m.observe(executed(7, 0, graph=True))
    m.observe(executed(7, 1, graph=True))  # the same batch: its nodes are not counted again
    m.observe(executed(8, 0, graph=False))
    fam = parse(m.exposition())
    node = "slmrank_node_seconds_total"
    assert value_of(fam, node, {"category": "layers", "clock": "device"}) == pytest.approx(2.0e-3)
    assert value_of(fam, node, {"category": "layers", "clock": "host"}) == pytest.approx(2.0e-3)  # the eager batch
    assert value_of(fam, node, {"category": "decode lm_head", "clock": "device"}) == pytest.approx(0.5e-3)
    assert value_of(fam, "slmrank_node_batches_total", {"mode": "graph"}) == 1
    assert value_of(fam, "slmrank_node_batches_total", {"mode": "eager"}) == 1
    assert value_of(fam, "slmrank_request_stage_seconds_count", {"kind": "Score", "stage": "queue"}) == 3


def test_label_values_are_escaped() -> None:
    m = ServerMetrics()
    m.observe(finished('we"ird\\kind\n', "OK", 1.0))
    fam = parse(m.exposition())
    assert value_of(fam, "slmrank_requests_total", {"kind": 'we\\"ird\\\\kind\\n', "code": "OK"}) == 1


def test_process_build_and_model_identity() -> None:
    from service.serving.proto_gen import load as load_stubs

    m = ServerMetrics()
    pb2 = load_stubs().pb2
    m.set_model(pb2.ModelInfoResponse(model="embedded:tiny", artifact_sha256="ab" * 32, arch="qwen2", runtime="cpp",
                                      device="cpu", compute_dtype="float32", kernels="aten",
                                      beam_graphs="conditional"))
    fam = parse(m.exposition())
    assert value_of(fam, "process_resident_memory_bytes") > 0
    assert value_of(fam, "process_start_time_seconds") > 0
    (_, build, _), = fam["slmrank_build_info"]["samples"]
    assert build["torch"] and build["python"] and build["extension"] in ("cpu", "cuda", "none")
    assert value_of(fam, "slmrank_model_info", {"model": "embedded:tiny", "artifact_sha256": "ab" * 32,
                                                "arch": "qwen2", "runtime": "cpp", "device": "cpu",
                                                "dtype": "float32", "kernels": "aten",
                                                "beam_graphs": "conditional"}) == 1


async def _run_scheduler(art: Any, runtime: Any) -> dict[str, Any]:
    from service.sched.batcher import Scheduler
    from service.runtime.requests import ScoreRequest

    sched = Scheduler(art, runtime)
    await sched.start()
    try:
        reqs = [ScoreRequest(samples=((5, 6, 7),) * (i + 1), label_ids=(1, 2)) for i in range(3)]
        await asyncio.gather(*(sched.submit(r, Priority.ONLINE if i else Priority.BACKGROUND)
                               for i, r in enumerate(reqs)))
        return sched.stats()
    finally:
        await sched.close()


def test_scheduler_numbers(embedded_tiny, embedded_tiny_runtime) -> None:
    stats = asyncio.run(_run_scheduler(embedded_tiny[1], embedded_tiny_runtime))
    m = ServerMetrics(stats_source=lambda: stats)
    fam = parse(m.exposition())
    for lane in ("ONLINE", "NORMAL", "BACKGROUND"):
        assert value_of(fam, "slmrank_queue_depth", {"lane": lane}) == 0
    assert value_of(fam, "slmrank_admitted_total", {"priority": "ONLINE"}) == 2
    assert value_of(fam, "slmrank_admitted_total", {"priority": "BACKGROUND"}) == 1
    for reason in ("queue_full", "deadline", "draining"):
        assert value_of(fam, "slmrank_refused_total", {"reason": reason}) == 0
    for reason in ("expired", "cancelled", "drained"):
        assert value_of(fam, "slmrank_dropped_total", {"reason": reason}) == 0
    assert value_of(fam, "slmrank_answered_late_total") == stats["answered_late"] == 0  # no deadlines given
    batches = stats["batches"]
    assert batches >= 1 and value_of(fam, "slmrank_batches_total", {"outcome": "ok"}) == batches
    assert value_of(fam, "slmrank_batch_size_count") == batches
    assert value_of(fam, "slmrank_batch_size_sum") == 3  # whole requests
    for key, b in stats["buckets"].items():
        occupancy = value_of(fam, "slmrank_bucket_occupancy", {"bucket": key})
        assert occupancy == pytest.approx(b["occupancy_mean"]) and 0 < occupancy <= 1
    assert value_of(fam, "slmrank_batch_service_seconds") > 0


def test_scheduler_families_count_refusals() -> None:
    stats = {"queue_depth": {"ONLINE": 3, "NORMAL": 0, "BACKGROUND": 7}, "inflight": 2,
             "admitted_by_priority": {"ONLINE": 10, "NORMAL": 0, "BACKGROUND": 7},
             "refused": {"queue_full": 4, "deadline": 2, "draining": 0}, "expired": 1, "cancelled": 5, "drained": 0,
             "expired_in_flight": 0, "cancelled_in_flight": 2, "answered_late": 3, "batches": 5, "batches_failed": 1, "batch_sizes": {1: 2, 3: 2, 64: 1},
             "heavy_batches": {"ratio": 2}, "buckets": {"score.t64.s64": {"batches": 5, "occupancy_mean": 0.25}}}
    text = render(scheduler_families(stats))
    fam = parse(text)
    assert value_of(fam, "slmrank_queue_depth", {"lane": "BACKGROUND"}) == 7
    assert value_of(fam, "slmrank_refused_total", {"reason": "deadline"}) == 2
    assert value_of(fam, "slmrank_dropped_total", {"reason": "expired"}) == 1
    assert value_of(fam, "slmrank_dropped_total", {"reason": "cancelled"}) == 5
    assert value_of(fam, "slmrank_dropped_in_flight_total", {"reason": "cancelled"}) == 2
    assert value_of(fam, "slmrank_dropped_in_flight_total", {"reason": "expired"}) == 0
    assert value_of(fam, "slmrank_answered_late_total") == 3
    assert value_of(fam, "slmrank_batches_total", {"outcome": "failed"}) == 1
    assert value_of(fam, "slmrank_heavy_batches_total", {"why": "ratio"}) == 2
    assert value_of(fam, "slmrank_heavy_batches_total", {"why": "time"}) == 0
    assert value_of(fam, "slmrank_batch_size_bucket", {"le": "2"}) == 2
    assert value_of(fam, "slmrank_batch_size_bucket", {"le": "4"}) == 4
    assert value_of(fam, "slmrank_batch_size_bucket", {"le": "32"}) == 4
    assert value_of(fam, "slmrank_batch_size_bucket", {"le": "64"}) == 5
    assert value_of(fam, "slmrank_batch_size_sum") == 2 + 6 + 64


def test_admission_state_gauges() -> None:
    """What an operator needs to see why a replica refuses: admission's calibration and
    parallelism, the work queued per lane, and (with fronts) how far the engine's loop is behind."""
    stats = {"queue_depth": {"ONLINE": 1, "NORMAL": 4, "BACKGROUND": 0}, "inflight": 1,
             "admitted_by_priority": {"ONLINE": 1, "NORMAL": 4, "BACKGROUND": 0}, "refused": {},
             "expired": 0, "cancelled": 0, "drained": 0, "answered_late": 0, "batches": 0, "batches_failed": 0,
             "batch_sizes": {}, "buckets": {},
             "queue_work_s": {"ONLINE": 0.004, "NORMAL": 0.25, "BACKGROUND": 0.0},
             "model": {"tau_s": 0.01, "rho_by_priority": {"ONLINE": 0.5}, "calibration": 1.37, "parallelism": 2.0,
                       "error_by_priority": {"ONLINE": 1.05, "NORMAL": 1.37, "BACKGROUND": 1.0}},
             "front_ingress_s": 0.0031}
    fam = parse(render(scheduler_families(stats)))
    assert value_of(fam, "slmrank_admission_calibration") == 1.37
    assert value_of(fam, "slmrank_admission_parallelism") == 2.0
    assert value_of(fam, "slmrank_admission_lane_error", {"priority": "ONLINE"}) == 1.05
    assert value_of(fam, "slmrank_admission_lane_error", {"priority": "NORMAL"}) == 1.37
    assert value_of(fam, "slmrank_queue_work_seconds", {"lane": "NORMAL"}) == 0.25
    assert value_of(fam, "slmrank_front_ingress_delay_seconds") == 0.0031
    del stats["front_ingress_s"]  # no fronts: no such gauge
    assert "slmrank_front_ingress_delay_seconds" not in render(scheduler_families(stats))


async def _get(port: int, path: str, method: str = "GET") -> tuple[str, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, body = raw.split(b"\r\n\r\n", 1)
    status, *headers = head.decode().split("\r\n")
    return status, {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in headers)}, body


def test_metrics_endpoint_answers() -> None:
    async def run() -> None:
        m = ServerMetrics()
        m.observe(finished("Score", "OK", 2.0))
        chrome = ChromeTraceWriter()
        chrome.add(build_records(executed(1, 0, graph=True)))
        server = MetricsServer(m, "127.0.0.1", 0, chrome=chrome)
        port = server.start()
        try:
            status, headers, body = await _get(port, "/metrics")
            assert status == "HTTP/1.1 200 OK" and headers["content-type"].startswith("text/plain; version=0.0.4")
            assert int(headers["content-length"]) == len(body)
            fam = parse(body.decode())
            assert value_of(fam, "slmrank_requests_total", {"kind": "Score", "code": "OK"}) == 1
            status, headers, body = await _get(port, "/trace")
            assert status.endswith("200 OK") and json.loads(body)["otherData"]["requests"] == 1
            assert (await _get(port, "/nope"))[0].endswith("404 Not Found")
            assert (await _get(port, "/metrics", "POST"))[0].endswith("405 Method Not Allowed")
        finally:
            server.close()

    asyncio.run(run())


def test_a_trace_only_server_serves_no_metrics_and_a_metrics_server_no_trace() -> None:
    """The server's two HTTP listeners: /trace on a port of its own (serve_metrics=False), the scrape
    port without a Chrome writer; each answers 404 for the other's path, naming its own."""
    async def run() -> None:
        m = ServerMetrics()
        chrome = ChromeTraceWriter()
        chrome.add(build_records(executed(1, 0, graph=True)))
        trace = MetricsServer(m, "127.0.0.1", 0, chrome=chrome, serve_metrics=False)
        scrape = MetricsServer(m, "127.0.0.1", 0)
        trace_port, scrape_port = trace.start(), scrape.start()
        try:
            status, _, body = await _get(trace_port, "/trace")
            assert status.endswith("200 OK") and json.loads(body)["otherData"]["requests"] == 1
            status, _, body = await _get(trace_port, "/metrics")
            assert status.endswith("404 Not Found") and body == b"not found: try /trace\n"
            status, _, body = await _get(scrape_port, "/trace")
            assert status.endswith("404 Not Found") and body == b"not found: try /metrics\n"
        finally:
            trace.close()
            scrape.close()

    asyncio.run(run())
    with pytest.raises(ValueError, match="Chrome writer"):
        MetricsServer(ServerMetrics(), "127.0.0.1", 0, serve_metrics=False)


def test_scrape_does_not_wait_for_a_blocked_event_loop() -> None:
    """The HTTP thread answers while the loop is busy; the scheduler's numbers are read on the
    loop, so they are the last ones seen until the loop is free again."""
    import urllib.request

    async def run() -> None:
        calls = []
        m = ServerMetrics(stats_source=lambda: calls.append(1) or {**REFUSALS, "inflight": len(calls)})
        server = MetricsServer(m, "127.0.0.1", 0)
        port = server.start()
        try:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            assert value_of(parse(text.decode()), "slmrank_batches_inflight") == 1
            t0 = time.monotonic()
            blocked = [None]

            def scrape() -> None:
                blocked[0] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()

            import threading
            thread = threading.Thread(target=scrape)
            thread.start()
            time.sleep(3.0)  # blocks the loop for longer than a scrape waits for it
            thread.join(30)
            assert blocked[0] is not None and time.monotonic() - t0 < 10
            fam = parse(blocked[0].decode())
            assert value_of(fam, "slmrank_batches_inflight") == 1  # the older numbers
            assert value_of(fam, "process_resident_memory_bytes") > 0
        finally:
            server.close()

    asyncio.run(run())


def test_malformed_requests_get_an_error_without_traceback(caplog: pytest.LogCaptureFixture,
                                                      capfd: pytest.CaptureFixture) -> None:
    import socket

    m = ServerMetrics()
    server = MetricsServer(m, "127.0.0.1", 0, timeout_s=1.0)
    port = server.start()
    try:
        for raw in (b"garbage\r\n\r\n", b"GET /metrics HTTP/9.9\r\n\r\n", b"\xff\xfe\x00\r\n\r\n",
                    b"GET " + b"/x" * 40000 + b" HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(raw)
                answer = sock.recv(65536)
            # (a one-word request line is HTTP/0.9 to the standard library: an error page without a status line)
            assert re.search(rb"^HTTP/1\.[01] [45]\d\d |Error code: [45]\d\d", answer), answer[:80]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # says nothing: timed out
            time.sleep(1.5)
        status, _, _ = asyncio.run(_get(port, "/metrics"))  # still answering
        assert status.endswith("200 OK")
    finally:
        server.close()
    assert "Traceback" not in capfd.readouterr().err + caplog.text


def _trickle(port: int, sent_two: threading.Event, every_s: float = 0.3, for_s: float = 30.0) -> float | None:
    """A client that sends a request line, then one header line every `every_s`, never the blank
    line that ends the headers; returns how long the server let it go on (None: for_s, not cut off)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        sock.settimeout(every_s)
        lines = 0
        while time.monotonic() - t0 < for_s:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                lines += 1
                if lines == 2:
                    sent_two.set()
                if not sock.recv(65536):  # the server closed it
                    return time.monotonic() - t0
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
        return None


def test_a_client_that_trickles_header_lines_blocks_no_scrape() -> None:
    """Issue 32: one client sending a header line every 0.3 s (each within the old per-read socket
    timeout) made every scrape wait behind it. Now connections are served side by side, and a
    request has timeout_s in all to arrive: the trickler is cut off, and a scrape during it answers."""
    import threading

    server = MetricsServer(ServerMetrics(), "127.0.0.1", 0, timeout_s=2.0)
    port = server.start()
    try:
        sent_two = threading.Event()
        cut_after: list[float | None] = []
        trickler = threading.Thread(target=lambda: cut_after.append(_trickle(port, sent_two)), daemon=True)
        trickler.start()
        assert sent_two.wait(10), "the trickling client did not get going"
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"slmrank_build_info" in r.read()
        assert time.monotonic() - t0 < 10
        trickler.join(40)
        assert cut_after and cut_after[0] is not None, "the trickling client was never cut off"
        assert 1.5 <= cut_after[0] < 12, cut_after  # its 2 s for the whole request, on a loaded host
    finally:
        server.close()


def test_the_http_clients_at_once_are_bounded_and_a_refused_one_is_answered_at_once() -> None:
    """max_clients connections that say nothing hold every slot: one more gets a 503 and is closed
    at once (never a hang); once they are cut off (timeout_s), scrapes answer again."""
    import socket

    server = MetricsServer(ServerMetrics(), "127.0.0.1", 0, timeout_s=1.0, max_clients=2)
    port = server.start()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # the third
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:80]  # (accepted in order: both slots are taken)
        for sock in silent:  # cut off after timeout_s, with nothing sent
            assert sock.recv(1) == b""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
        with pytest.raises(ValueError, match="max_clients"):
            MetricsServer(ServerMetrics(), "127.0.0.1", 0, max_clients=0)
    finally:
        for sock in silent:
            sock.close()
        server.close()


def test_a_taken_metrics_port_is_a_bind_error() -> None:
    first = MetricsServer(ServerMetrics(), "127.0.0.1", 0)
    port = first.start()
    try:
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port} \\(metrics\\)"):
            MetricsServer(ServerMetrics(), "127.0.0.1", port).start()
    finally:
        first.close()


REFUSALS = {"queue_depth": {"ONLINE": 0, "NORMAL": 0, "BACKGROUND": 0}, "inflight": 0,
            "admitted_by_priority": {"ONLINE": 0, "NORMAL": 0, "BACKGROUND": 0},
            "refused": {"queue_full": 0, "deadline": 0, "draining": 0}, "expired": 0, "cancelled": 0, "drained": 0,
            "answered_late": 0,
            "batches": 0, "batches_failed": 0, "batch_sizes": {}, "buckets": {}}


def test_a_client_that_leaves_before_the_answer_leaves_no_traceback(capfd) -> None:
    """A poller killed mid-answer (a 3 MB /trace): the HTTP thread logs at most a debug line."""
    import socket

    chrome = ChromeTraceWriter(max_events=200_000)
    for i in range(3000):
        chrome.add(build_records(executed(i, 0, graph=True)))
    server = MetricsServer(ServerMetrics(), "127.0.0.1", 0, chrome=chrome)
    port = server.start()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
                s.sendall(b"GET /trace HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(1)  # the answer has started
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200  # still serving
    finally:
        server.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err, err


def test_trace_renders_again_only_when_its_cost_fits_the_share_of_time_it_may_take() -> None:
    """GET /trace renders at most every trace_refresh_s, and no more often than keeps its rendering
    CPU under trace_max_share of the time; in between, polls get the cached body with its Age."""
    def get(port: int) -> tuple[int, int]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/trace", timeout=30) as r:
            return json.loads(r.read())["otherData"]["requests"], int(r.headers["Age"])

    for share, rerenders in ((1.0, True), (1e-6, False)):
        chrome = ChromeTraceWriter(max_events=200_000)
        for i in range(300):
            chrome.add(build_records(executed(i, 0, graph=True)))
        server = MetricsServer(ServerMetrics(), "127.0.0.1", 0, chrome=chrome, trace_refresh_s=0.0,
                               trace_max_share=share)
        port = server.start()
        try:
            assert get(port) == (300, 0)
            for i in range(300, 600):
                chrome.add(build_records(executed(i, 0, graph=True)))
            t0 = time.monotonic()
            time.sleep(1.0)  # more than rendering 300 requests costs (~0.1 s): with share 1.0 it renders again
            requests, age = get(port)
            # with share 1e-6 the next rendering waits (cost / 1e-6) s: more than a day for any cost
            assert requests == (600 if rerenders else 300), (share, requests)
            assert age == 0 if rerenders else 1 <= age <= time.monotonic() - t0 + 1, (share, age)
        finally:
            server.close()
    with pytest.raises(ValueError, match="trace_max_share"):
        MetricsServer(ServerMetrics(), "127.0.0.1", 0, trace_max_share=0.0)


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="per-thread CPU time is read from /proc")
def test_event_loop_cpu_seconds_count_the_loop_thread_only() -> None:
    """slmrank_event_loop_cpu_seconds_total is the serving loop's thread: work on the loop moves
    it, the same work on another thread does not."""
    import threading

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    async def run() -> None:
        m = ServerMetrics()
        server = MetricsServer(m, "127.0.0.1", 0)
        port = server.start()

        async def loop_seconds() -> float:
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            return value_of(parse(body.decode()), "slmrank_event_loop_cpu_seconds_total")

        try:
            assert m.loop_thread_id == threading.get_native_id()
            a = await loop_seconds()
            spin(0.3)  # on the loop
            b = await loop_seconds()
            worker = threading.Thread(target=spin, args=(0.3,))
            worker.start()
            await asyncio.to_thread(worker.join)
            c = await loop_seconds()
            assert b - a >= 0.25, (a, b)
            assert c - b < 0.15, (b, c)
        finally:
            server.close()

    asyncio.run(run())
