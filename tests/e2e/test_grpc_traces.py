"""`slmrank serve` with its observability flags, as a subprocess on embedded:tiny over loopback:
--metrics-port 0 prints the metrics address; GET /metrics counts the requests by kind and status;
--trace-port 0 prints another, where GET /trace is the Chrome trace of the kept requests (and the
scrape port has none); on SIGTERM --trace-file gets it, and
`slmrank trace FILE` prints where the time went, stage by stage and by DAG node category.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.cli import main as cli_main
from service.serving.client import RankerClient
from service.observe.trace_report import breakdown, load_events

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["receive", "decode", "tokenize", "queue", "batch", "execute", "h2d", "d2h", "unpack", "encode", "send"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("traces")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SLMRANK_TRACE_"))}
    env.update(SLMRANK_CACHE=str(tmp / "cache"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    trace_file, log = tmp / "trace.json", tmp / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--model", "embedded:tiny", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--trace-port", "0",
         "--trace-sample-rate", "1", "--trace-slow-ms", "0", "--trace-file", str(trace_file),
         "--grace-s", "10"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    ports: dict[str, int] = {}
    end = time.monotonic() + 120
    while len(ports) < 3:
        assert time.monotonic() < end and proc.poll() is None, log.read_text()
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            ports["grpc"] = int(m.group(1))
        if m := re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", line):
            ports["metrics"] = int(m.group(1))
        if m := re.search(r"Chrome trace of the kept requests on http://127\.0\.0\.1:(\d+)/trace", line):
            ports["trace"] = int(m.group(1))
    target = f"127.0.0.1:{ports['grpc']}"
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < end and proc.poll() is None, log.read_text()
            time.sleep(0.05)
    yield proc, target, ports, trace_file, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _samples(text: str) -> dict[tuple[str, frozenset[str]], float]:
    """{(name, {label="value", ...}): value} of an exposition (labels in any order)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name, _, labels = sample.partition("{")
            out[name, frozenset(labels.rstrip("}").split(",")) if labels else frozenset()] = float(value)
    return out


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.read().decode()


def test_metrics_trace_endpoint_trace_file_and_report(served, capsys: pytest.CaptureFixture[str]):
    proc, target, ports, trace_file, log = served
    metrics_port = ports["metrics"]
    with RankerClient(target, timeout_s=60) as c:
        c.score([" Trail runner 3", " Garden hose"], [9834, 902], prefix="Query: running shoes. Relevant?")
        c.score([[1, 2, 3]], [5], priority="online")
        c.beam("The best running shoes are", 2, 2, priority="background")
        with pytest.raises(grpc.RpcError) as err:
            c.score([[1, 2]], [])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # grpc.aio's abort sends the status before the tracing interceptor sees it: the count may lag a moment
    end = time.monotonic() + 5
    invalid = ("slmrank_requests_total", frozenset({'kind="Score"', 'code="INVALID_ARGUMENT"'}))
    while _samples(metrics := _get(metrics_port, "/metrics")).get(invalid) != 1:
        assert time.monotonic() < end, metrics
        time.sleep(0.01)
    samples = _samples(metrics)
    for line in ('slmrank_requests_total{kind="Score",code="OK"} 2',
                 'slmrank_requests_total{kind="Score",code="INVALID_ARGUMENT"} 1',
                 'slmrank_requests_total{kind="BeamSearch",code="OK"} 1',
                 'slmrank_request_latency_seconds_count{kind="Score",priority="NORMAL"} 2',
                 'slmrank_request_latency_seconds_count{kind="Score",priority="ONLINE"} 1',
                 'slmrank_request_latency_seconds_count{kind="BeamSearch",priority="BACKGROUND"} 1',
                 'slmrank_queue_depth{lane="ONLINE"} 0', 'slmrank_admitted_total{priority="ONLINE"} 1'):
        ((key, value),) = _samples(line).items()
        assert samples.get(key) == value, line

    served_trace = json.loads(_get(ports["trace"], "/trace"))
    with pytest.raises(urllib.error.HTTPError) as not_there:  # megabytes of timings: never on the scrape port
        _get(metrics_port, "/trace")
    assert not_there.value.code == 404
    kinds = breakdown(served_trace["traceEvents"])
    assert dict(kinds["Score"].statuses) == {"OK": 2, "INVALID_ARGUMENT": 1}
    assert set(STAGES) <= set(kinds["BeamSearch"].stages) and "step1.beam_step" in {
        e["name"] for e in served_trace["traceEvents"] if e.get("cat") == "node"}

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, log.read_text()
    assert "Chrome trace of 4 kept requests" in log.read_text()
    assert len(breakdown(load_events(trace_file))["Score"].end_to_end_ms) == 3

    assert cli_main(["trace", str(trace_file)]) == 0
    report = capsys.readouterr().out
    assert report.startswith("BeamSearch: 1 requests (OK 1)") and "Score: 3 requests (INVALID_ARGUMENT 1, OK 2)" in report
    rows = {ln.split()[0] for ln in report.splitlines() if ln.startswith("  ")}
    assert set(STAGES) | {"DAG", "layers", "lm_head", "embed", "unaccounted"} <= rows, report
    assert "decode lm_head" in report and "beam_step" in report  # the beam's decode steps, by category
    assert report.count("where the time went: ") == 2


def test_otlp_endpoint_without_its_package_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch):
    # the exporter made unimportable, whether or not this machine has it (None in sys.modules: ImportError)
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    assert cli_main(["serve", "--model", "embedded:tiny", "--port", "0", "--otlp-endpoint", "127.0.0.1:4317"]) == 2
    assert "opentelemetry-exporter-otlp-proto-grpc" in capsys.readouterr().err
    assert cli_main(["serve", "--model", "embedded:tiny", "--trace-sample-rate", "2"]) == 2
    assert "sample_rate" in capsys.readouterr().err
