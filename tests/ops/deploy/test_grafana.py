"""ops/deploy/grafana/slmrank.json: every metric its PromQL names is one a running `slmrank serve`
exports (scraped from its /metrics after a Score and a BeamSearch, on the CPU, with one front
process so that the fronts' series are there too; the GPU's memory, exported only where CUDA is
initialised, from the function that exports it with a stand-in device), with the labels the
queries select, group and name their series by; and the dashboard is whole (ids, layout, the
datasource and instance variables on every query)."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "ops" / "deploy" / "grafana" / "slmrank.json"
ADDED_BY_PROMETHEUS = {"job", "instance"}  # target labels every scraped series gets
METRIC = re.compile(r"\b((?:slmrank|process)_[a-z0-9_]+)\b")
SELECTOR = re.compile(r"\b((?:slmrank|process)_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
GROUPING = re.compile(r"\b(?:by|on)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(d: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every target, and the variables' queries."""
    out = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in d["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["definition"], "") for v in d["templating"]["list"] if v["type"] == "query"]
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sample name -> its label names, as a tiny server exports them after one RPC of each
    method, plus the GPU memory family from gpu_memory_families() on a stand-in device."""
    cache, log = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, SLMRANK_CACHE=str(cache), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--model", "embedded:tiny", "--host",
                             "127.0.0.1", "--port", "0", "--metrics-port", "0", "--fronts", "1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        target = url = None
        ready = False
        end = time.monotonic() + 120
        while not (target and url and ready):
            assert time.monotonic() < end and proc.poll() is None, log.read_text()[-3000:]
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if m := re.search(r"listening on (127\.0\.0\.1:\d+)", line):
                target = m.group(1)
            if m := re.search(r"metrics on (http://\S+/metrics)", line):
                url = m.group(1)
            ready = ready or "send a request" in line  # announced once SERVING
        from service.serving.client import RankerClient

        with RankerClient(target, timeout_s=60) as c:
            c.score([[1, 2, 3], [4, 5]], [6, 7], prefix=[8, 9])
            c.beam([1, 2, 3, 4], 2, 2)
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {**names_and_labels(text), **gpu_memory_names()}


def names_and_labels(text: str) -> dict[str, set[str]]:
    """Every sample name a family of the exposition has or would have (a counter's _total, a
    histogram's _bucket/_sum/_count: a family with no sample yet, such as refusals by a reason
    not seen, still names them), with the labels its samples carry."""
    out: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, ("",)):
            out.setdefault(family.name + suffix, set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def gpu_memory_names() -> dict[str, set[str]]:
    """slmrank_gpu_memory_bytes as gpu_memory_families() exports it on a host with one GPU."""
    import torch

    from service.observe.metrics import gpu_memory_families, render

    fake = {"is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: 1,
            "mem_get_info": lambda i: (1 << 30, 2 << 30), "memory_allocated": lambda i: 1 << 20,
            "memory_reserved": lambda i: 2 << 20}
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in fake.items():
            mp.setattr(torch.cuda, name, fn)
        families = gpu_memory_families()
    assert families, "gpu_memory_families exported nothing with a device"
    return names_and_labels(render(families))


def test_every_metric_the_dashboard_queries_is_exported(exported: dict[str, set[str]]) -> None:
    named = {(title, m) for title, expr, _ in queries(dashboard()) for m in METRIC.findall(expr)}
    missing = sorted(f"{m} ({title})" for title, m in named if m not in exported)
    assert not missing, f"not exported by slmrank serve: {missing}"
    # the dashboard covers what the issue asks of it
    metrics = {m for _, m in named}
    for want in ("slmrank_requests_total", "slmrank_request_latency_seconds_bucket", "slmrank_refused_total",
                 "slmrank_queue_work_seconds", "slmrank_admission_calibration", "slmrank_gpu_memory_bytes",
                 "slmrank_event_loop_lag_seconds", "slmrank_event_loop_cpu_seconds_total"):
        assert want in metrics, want


def test_the_labels_the_queries_use_are_the_metrics_own(exported: dict[str, set[str]]) -> None:
    for title, expr, legend in queries(dashboard()):
        names = METRIC.findall(expr)
        labels = set().union(*(exported.get(m, set()) for m in names)) | ADDED_BY_PROMETHEUS
        for name, matchers in SELECTOR.findall(expr):
            for label in MATCHER.findall(matchers):
                assert label in exported[name] | ADDED_BY_PROMETHEUS, f"{title}: {name} has no label {label!r}"
        grouped = {g.strip() for clause in GROUPING.findall(expr) for g in clause.split(",") if g.strip()}
        for label in grouped:
            assert label in labels, f"{title}: no metric of {expr!r} has the label {label!r}"
        for label in LEGEND.findall(legend):
            assert label in (grouped or labels), f"{title}: the legend names {label!r}, which the query drops"


def test_the_dashboard_is_whole() -> None:
    d = dashboard()
    assert d["uid"] == "slmrank" and d["schemaVersion"] >= 36
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and p["targets"], p["title"]
        assert p.get("description"), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            # every series selected is the chosen job's and instance's
            for name, matchers in SELECTOR.findall(t["expr"]):
                assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (p["title"], name)
            assert len(SELECTOR.findall(t["expr"])) == len(METRIC.findall(t["expr"])), (p["title"], t["expr"])
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


def test_each_methods_latency_panel_shows_the_p99_of_each_lane_against_the_slo() -> None:
    panels = [p for p in dashboard()["panels"] if "slmrank_request_latency_seconds_bucket" in str(p.get("targets"))]
    assert {p["title"].split()[0] for p in panels} == {"Score", "BeamSearch"}
    for p in panels:
        per_lane = [t for t in p["targets"] if t["expr"].startswith("histogram_quantile(0.99, sum by (le, priority) ")]
        assert len(per_lane) == 1 and "{{priority}}" in per_lane[0]["legendFormat"], p["title"]
        steps = p["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert 0.08 in [s["value"] for s in steps], p["title"]  # the P99 SLO's line, 80 ms (the unit is s)
        assert p["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] in ("dashed", "line"), p["title"]
