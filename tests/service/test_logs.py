"""Logs: text and JSON formats (one line per record, a record's extra fields kept), the
announcements on stdout, and the access log's one record per finished RPC."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest

from service.model import progress
from service.observe.logs import ACCESS, JsonFormatter, TextFormatter, announce, configure_logging, current_settings
from service.serving.client import RankerClient
from service.serving.server import RankerServer, ServerConfig
from service.serving.server_thread import ServerThread


def _record(msg: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("slmrank.server", logging.WARNING, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


def test_json_lines_carry_level_logger_message_and_fields() -> None:
    line = JsonFormatter().format(_record("batch failed\nsecond line", method="Score", latency_ms=1.5))
    assert "\n" not in line
    obj = json.loads(line)
    assert obj["level"] == "warning" and obj["logger"] == "slmrank.server" and obj["msg"] == "batch failed\nsecond line"
    assert obj["method"] == "Score" and obj["latency_ms"] == 1.5 and obj["ts"].endswith("Z")


def test_text_lines() -> None:
    line = TextFormatter().format(_record("drain complete", code="OK"))
    assert line.split(" ", 1)[1] == "WARNING slmrank.server: drain complete code=OK"


def test_current_settings_are_what_configure_logging_set(monkeypatch) -> None:
    """What a child process (a server's front) is told to log with."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if not getattr(h, "_slmrank", False)])
    monkeypatch.setattr(root, "level", root.level)
    assert current_settings() == ("info", "text")
    configure_logging("warning", "json", stderr=io.StringIO(), stdout=io.StringIO())
    assert current_settings() == ("warning", "json")
    configure_logging("debug", "text", stderr=io.StringIO(), stdout=io.StringIO())
    assert current_settings() == ("debug", "text")


def test_configure_logging_routes_and_replaces_only_its_own_handlers() -> None:
    err, out = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    others = list(root.handlers)
    level = root.level
    try:
        configure_logging("info", "json", stderr=err, stdout=out)
        configure_logging("info", "json", stderr=err, stdout=out)  # again: no duplicate lines
        logging.getLogger("slmrank.server").info("loaded")
        announce("listening on 127.0.0.1:1")
        assert [json.loads(x)["msg"] for x in err.getvalue().splitlines()] == ["loaded"]
        assert [json.loads(x)["msg"] for x in out.getvalue().splitlines()] == ["listening on 127.0.0.1:1"]
        assert all(h in root.handlers for h in others), "someone else's handler was removed"
        with pytest.raises(ValueError):
            configure_logging("loud", "json")
    finally:
        progress.set_sink(None)
        for h in [h for h in root.handlers if getattr(h, "_slmrank", False)]:
            root.removeHandler(h)
        root.setLevel(level)


def test_progress_of_long_work_is_records_of_the_log_format() -> None:
    """With logging configured (serve), the artifact build / capture progress and notes are JSON
    records too, never bare lines among them; without it they are plain stderr lines."""
    progress.set_sink(None)
    err, out, bare = io.StringIO(), io.StringIO(), io.StringIO()
    root = logging.getLogger()
    level = root.level
    try:
        with progress.Progress("capture graphs", 4, stream=bare) as bar:  # not configured: bare lines
            bar.advance(4, "b1")
        progress.note("building artifact", stream=bare)
        assert bare.getvalue().splitlines()[0].startswith("[capture graphs] 100% (4/4)")
        assert bare.getvalue().count("100%") == 1  # once, not once for the last advance and again at the end
        assert bare.getvalue().splitlines()[-1] == "[slmrank] building artifact"
        configure_logging("info", "json", stderr=err, stdout=out)
        progress.note("building artifact for embedded:x")
        with progress.Progress("capture graphs", 20, stream=bare) as bar:
            for i in range(20):
                bar.advance(1, f"bucket {i}")
        records = [json.loads(x) for x in err.getvalue().splitlines()]  # every line is JSON
        assert records[0]["msg"] == "building artifact for embedded:x" and records[0]["logger"] == "slmrank.progress"
        bars = [r for r in records if r.get("progress") == "capture graphs"]
        # each decile 0%..100% once, the last one the end's ("done"): no line written twice
        assert [r["done"] for r in bars] == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20], [r["msg"] for r in bars]
        assert bars[-1]["msg"].endswith(" done") and bars[-1]["total"] == 20
        assert bare.getvalue().count("\n") == 2, "a configured process wrote a bare progress line"
    finally:
        progress.set_sink(None)
        for h in [h for h in root.handlers if getattr(h, "_slmrank", False)]:
            root.removeHandler(h)
        root.setLevel(level)


def _score_then_bad_beam(srv: ServerThread, caplog: pytest.LogCaptureFixture, **score_args) -> None:
    """A Score and an invalid BeamSearch through the server, which is stopped after both access
    records are in (grpc.aio sends an abort's status before the interceptor finishes the RPC: its
    record may lag)."""
    try:
        srv.wait_serving()
        with caplog.at_level(logging.INFO, logger=ACCESS), RankerClient(srv.target, timeout_s=30) as c:
            c.score([[1, 2, 3]], [4, 5], **score_args)
            with pytest.raises(Exception):
                c.beam([1, 2], beam_width=0, new_tokens=1)
            end = time.monotonic() + 10
            while len([r for r in caplog.records if r.name == ACCESS]) < 2 and time.monotonic() < end:
                time.sleep(0.01)
    finally:
        srv.stop()


def test_access_log_one_record_per_rpc(model, caplog: pytest.LogCaptureFixture) -> None:
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=5, access_log=True),
                                    lambda: model))
    _score_then_bad_beam(srv, caplog, priority="online")
    records = [r for r in caplog.records if r.name == ACCESS]
    assert [(r.method, r.code) for r in records] == [("Score", "OK"), ("BeamSearch", "INVALID_ARGUMENT")]
    assert all(r.latency_ms > 0 and r.peer for r in records)
    assert records[0].samples == 1 and records[0].priority == "ONLINE"


def test_json_access_log_carries_the_trace(model, caplog: pytest.LogCaptureFixture) -> None:
    """A kept request's access record has the trace_id and span_id of its server span; one that
    is not kept has its caller's trace_id (traceparent); one with neither has none. A client's
    mistake leaves its span's status UNSET (OpenTelemetry's gRPC conventions)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from service.observe.records import RequestTrace
    from service.observe.tracing import RequestTracer, TracingConfig

    exporter = InMemorySpanExporter()
    # every request kept (a slow one is, and every request is slower than 0 ms)
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, access_log=True, trace_slow_ms=0.0)
    srv = ServerThread(RankerServer(config, lambda: model, span_exporter=exporter))
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"  # the caller's, for a request not kept
    _score_then_bad_beam(srv, caplog)
    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == ACCESS]
    spans = {s.name: s for s in exporter.get_finished_spans() if s.parent is None}
    assert [(x["method"], x["code"]) for x in lines[:2]] == [("Score", "OK"), ("BeamSearch", "INVALID_ARGUMENT")]
    for line in lines[:2]:
        context = spans[line["method"]].get_span_context()
        assert (line["trace_id"], line["span_id"]) == (format(context.trace_id, "032x"), format(context.span_id, "016x"))
    assert spans["BeamSearch"].status.status_code == StatusCode.UNSET  # the client's mistake, not the server's
    assert len(lines) == 2

    none_kept = RequestTracer(TracingConfig(sample_rate=0.0, slow_ms=1e9), exporter=InMemorySpanExporter())
    traced = RequestTrace("Score", traceparent=f"00-{caller_trace}-00f067aa0ba902b7-00")
    assert not none_kept.finish(traced, "OK") and none_kept.log_ids(traced) == {"trace_id": caller_trace}
    untraced = RequestTrace("Score")
    assert not none_kept.finish(untraced, "OK") and none_kept.log_ids(untraced) == {}


def test_access_log_has_each_request_shape_and_none_of_its_content(model, caplog: pytest.LogCaptureFixture) -> None:
    """What `slmrank traffic` reads: kind, arrival (wall clock), latency and, once a request is
    decoded and valid, its shape (sample count and lengths, prefix, or prompt, beam width, new
    tokens). No token id and no text of a request appears in a line; an invalid request has a line
    with its kind and times but no shape."""
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=5, access_log=True),
                                    lambda: model))
    ids = [12345, 23456, 34567]
    try:
        srv.wait_serving()
        with caplog.at_level(logging.INFO, logger=ACCESS), RankerClient(srv.target, timeout_s=30) as c:
            before = time.time()
            c.score(["zebracrossing", ids[:2]], [4, 5], prefix="Query: okapiwhistle")
            c.beam(ids, beam_width=3, new_tokens=2)
            with pytest.raises(Exception):
                c.beam(ids, beam_width=0, new_tokens=1)
            after = time.time()
            end = time.monotonic() + 10
            while len([r for r in caplog.records if r.name == ACCESS]) < 3 and time.monotonic() < end:
                time.sleep(0.01)
    finally:
        srv.stop()
    lines = [JsonFormatter().format(r) for r in caplog.records if r.name == ACCESS]
    score, beam, bad = (json.loads(x) for x in lines)
    tokenizer = model.tokenizer
    prefix_len, text_len = len(tokenizer.encode("Query: okapiwhistle")), len(tokenizer.encode("zebracrossing"))
    assert (score["kind"], score["samples"], score["sample_tokens"], score["prefix_tokens"], score["tokens"]) == \
        ("score", 2, [text_len, 2], prefix_len, prefix_len + text_len + 2)
    assert (beam["kind"], beam["prompt_tokens"], beam["beam_width"], beam["new_tokens"]) == ("beam", 3, 3, 2)
    assert bad["kind"] == "beam" and bad["code"] == "INVALID_ARGUMENT"
    assert not {"prompt_tokens", "beam_width", "new_tokens"} & set(bad), "an invalid request's shape was logged"
    for x in (score, beam, bad):
        # its arrival is on the wall clock, before its end by its latency
        assert before - 0.002 <= x["arrival_s"] <= x["arrival_s"] + x["latency_ms"] / 1e3 <= after + 0.002, x
    for line in lines:
        assert not any(w in line for w in ("zebra", "okapi", "Query")), line
        assert not any(str(i) in line for i in ids), line
