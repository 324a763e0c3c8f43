"""`slmrank bench --target` against a running `slmrank serve` (a subprocess on embedded:tiny, real
gRPC on loopback, on the CPU): closed loop at two short levels, open loop at a low rate, a
request file; bench.json, bench.csv and the PNGs written; the workload the server refuses stops
before the levels; and ops/bench/bench_grpc.py's client is this same code.

The numbers are not judged (a shared CI CPU), only that they are whole and sane.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import queue
import re
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from service.cli import main as cli_main
from service.loadgen import loop
from service.loadgen.png import read_png
from tests.e2e.served import start_serve

ROOT = Path(__file__).resolve().parents[2]
TINY = "score,prefix=0,samples=2,len=4,labels=2"  # a few ms of work a request, even on a loaded CPU
SHORT = ["--warmup-s", "0.2", "--measure-s", "1", "--connections", "2", "--pool", "16"]


class Server:
    """`slmrank serve --model embedded:tiny` on free ports; its API target and /metrics URL."""

    def __init__(self, cache: Path, log: Path) -> None:
        self.log = log
        self.proc, lines = start_serve(cache, log)
        self.target = self.metrics = None
        ready = False
        end = time.monotonic() + 120
        while not (self.target and self.metrics and ready):
            assert time.monotonic() < end and self.proc.poll() is None, f"serve: {log.read_text()[-3000:]}"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if m := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                self.target = m.group(1)
            if m := re.search(r"metrics on (http://\S+/metrics)", line):
                self.metrics = m.group(1)
            ready = ready or "send a request" in line  # announced once the model is loaded: SERVING

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("serve") / "serve.log")
    yield s
    s.stop()


def _bench(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    rc = cli_main(["bench", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_closed_loop_writes_json_csv_and_pngs(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "closed"
    # an SLO every level of the CPU holds: the capacity and its effective MFU are reported
    rc, printed, err = _bench(capsys, "--target", server.target, "--workload", TINY, "--levels", "1,2", *SHORT,
                              "--slo-mean-ms", "1e6", "--slo-p99-ms", "1e6", "--metrics", server.metrics,
                              "--out", str(out))
    assert rc == 0, err
    result = json.loads((out / "bench.json").read_text())
    assert result["mode"] == "closed" and [r["level"] for r in result["levels"]] == [1, 2]
    assert result["server"]["model"] == "embedded:tiny" and result["model_shape"].startswith("ModelInfo.model")
    for r in result["levels"]:
        assert r["qps"] > 0 and r["completed"] > 0 and r["num_errors"] == 0, r
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["max_ms"], r
        assert sum(r["histogram"]["counts"]) == r["completed"]
        assert r["flops_per_s"] > 0 and r["within_slo"] is True
        assert r["server"]["batches"] >= 1 and r["server"]["latency_mean_ms"] < r["mean_ms"]  # --metrics
    cap = result["capacity"]
    assert cap["qps"] == max(r["qps"] for r in result["levels"]) and result["eff_mfu"] > 0
    with (out / "bench.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [row["level"] for row in rows] == ["1", "2"] and all(float(row["qps"]) > 0 for row in rows)
    for name in ("latency_vs_load.png", "latency_histogram.png"):
        png = read_png((out / name).read_bytes())
        assert (png.width, png.height) == (900, 540)
    # the table: a line per level, then the capacity
    assert re.search(r"^\s+1\s+\d+\.\d", printed, re.M) and re.search(r"^\s+2\s+\d+\.\d", printed, re.M)
    assert "capacity at mean < 1e+06 ms, P99 < 1e+06 ms: " in printed and "effective MFU" in printed
    # the progress line: stderr is not a terminal here, so plain lines
    assert re.search(r"^level 1: .* (warm-up|measure|draining) ", err, re.M), err

    # the default SLO (20 / 80 ms) against the same levels: a level over it is never the capacity
    over = [dict(r, mean_ms=25.0) for r in result["levels"]]
    assert loop.capacity(over) is None


def test_open_loop_at_a_low_rate(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "open"
    rc, printed, err = _bench(capsys, "--target", server.target, "--workload", TINY, "--rate", "4",
                              "--warmup-s", "0.5", "--measure-s", "2", "--out", str(out), "--seed", "3")
    assert rc == 0, err
    result = json.loads((out / "bench.json").read_text())
    (r,) = result["levels"]
    assert result["mode"] == "open" and r["rate"] == 4 and r["level"] is None
    # Poisson at 4/s over 2.5 s: 10 expected arrivals, seeded; what was sent is what arrived
    assert 2 <= r["sent"] <= 25 and r["not_sent"] == 0, r
    assert r["qps"] > 0 and r["send_lag_p99_ms"] < 1000, r
    assert "4/s" in printed
    assert (out / "latency_vs_load.png").stat().st_size > 0


def test_a_request_file_is_sent_in_order(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(x) for x in (
        {"id": "a", "kind": "score", "prefix_ids": [5, 6], "samples": [[1, 2, 3], [4]], "label_ids": [7, 8]},
        {"id": "b", "kind": "beam", "prompt_ids": [9, 10, 11], "beam_width": 2, "new_tokens": 2},
        {"id": "c", "kind": "score", "samples": [[12]], "label_ids": [13]})) + "\n")
    out = tmp_path / "file"
    rc, _, err = _bench(capsys, "--target", server.target, "--requests", str(requests), "--levels", "1", *SHORT,
                        "--out", str(out), "--quiet")
    assert rc == 0, err
    result = json.loads((out / "bench.json").read_text())
    assert result["workload"]["kind"] == "file"
    pool = result["pool"]
    assert pool["requests"] == 3 and pool["score"]["requests"] == 2 and pool["beam"]["requests"] == 1
    assert pool["score"]["mean_tokens"] == pytest.approx((6 + 1) / 2) and pool["beam"]["mean_beam_width"] == 2
    assert result["levels"][0]["qps"] > 0 and result["levels"][0]["num_errors"] == 0
    assert err == ""  # --quiet: no progress line


def test_a_workload_the_server_refuses_stops_before_the_levels(server: Server, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    rc, _, err = _bench(capsys, "--target", server.target, "--workload", "score,samples=100,len=2",
                        "--levels", "1", "--out", str(tmp_path / "x"))
    assert rc == 2 and "INVALID_ARGUMENT" in err and "samples" in err, err
    assert not (tmp_path / "x").exists()
    rc, _, err = _bench(capsys, "--target", server.target, "--levels", "1,0", "--out", str(tmp_path / "x"))
    assert rc == 2 and "--levels" in err


def test_bench_grpc_and_slmrank_bench_are_one_code_path(server: Server, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both reach service.loadgen.loop.closed_level, through loop.sweep: bench_grpc keeps no
    closed loop of its own."""
    from ops.bench import bench_grpc
    from ops.bench.workloads import parse_workload

    callers: list[str] = []
    real = loop.closed_level

    async def recording(*a, **kw):
        # the first of the two front ends up the stack (through the event loop, for slmrank bench)
        callers.append(next(f.f_globals["__name__"] for f in _frames() if f.f_globals["__name__"] in
                            ("service.loadgen.command", "ops.bench.bench_grpc")))
        return await real(*a, **kw)

    monkeypatch.setattr(loop, "closed_level", recording)
    rc, _, err = _bench(capsys, "--target", server.target, "--workload", TINY, "--levels", "1", *SHORT,
                        "--out", str(tmp_path / "a"), "--quiet")
    assert rc == 0, err
    args = Namespace(levels=[1], warmup_s=0.2, measure_s=1.0, rpc_timeout_s=60.0, stop_above_ms=2000.0, seed=7,
                     pool=16, connections=1)
    system = asyncio.run(bench_grpc.bench_system("slmrank", server.target, parse_workload(TINY), 512, args, 10**6,
                                                 server.metrics))
    assert callers == ["service.loadgen.command", "ops.bench.bench_grpc"]
    assert system["levels"][0]["qps"] > 0 and system["levels"][0]["server"]["batches"] >= 1
    assert not hasattr(bench_grpc, "run_level")


def _frames():
    f = sys._getframe(1)
    while f is not None:
        yield f
        f = f.f_back


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    import io

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, plain = Tty(), io.StringIO()
    for stream in (tty, plain):
        p = loop.Progress(stream)
        p.show("level 1: a")
        p.show("level 1: b")
        p.clear()
    assert tty.getvalue() == "\r\x1b[Klevel 1: a\r\x1b[Klevel 1: b\r\x1b[K"
    assert plain.getvalue() == "level 1: a\nlevel 1: b\n"
    assert not math.isnan(loop.latency_summary([1.0, 2.0])["p99_ms"])
