"""The standard OpenTelemetry environment is honoured: OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES name the service (slmrank only when nothing does), a caller's sampled
flag keeps its trace, OTEL_SDK_DISABLED / OTEL_TRACES_EXPORTER=none turn export off, and an
endpoint injected by the environment (the OpenTelemetry Operator) without the exporter package
installed serves anyway with a warning, where the same endpoint asked for by slmrank's own
setting is a usage error."""

from __future__ import annotations

import sys
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service.cli import _server_config
from service.observe.records import RequestTrace
from service.observe.tracing import RequestTracer, TracingConfig, is_sampled, service_resource
from service.serving.settings import SERVE_SETTINGS, resolve

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize("environ, name", [
    ({}, "slmrank"),
    ({"OTEL_SERVICE_NAME": "ranker-sidecar"}, "ranker-sidecar"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,k8s.pod.name=p-1"}, "from-attrs"),
    ({"OTEL_SERVICE_NAME": "wins", "OTEL_RESOURCE_ATTRIBUTES": "service.name=loses"}, "wins"),
])
def test_service_name(monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], name: str) -> None:
    for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert service_resource().attributes["service.name"] == name
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TracingConfig(sample_rate=1.0, chrome_max_events=0), exporter=exporter)
    trace = RequestTrace("Score")
    trace.end_ns = trace.start_ns + 1000
    assert tracer.finish(trace, "OK")
    (span,) = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == name


@pytest.mark.parametrize("flags, kept", [("01", True), ("00", False), ("03", True), ("zz", False)])
def test_the_callers_sampled_flag_keeps_the_trace(flags: str, kept: bool) -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TracingConfig(sample_rate=0.0, slow_ms=1e6, chrome_max_events=0), exporter=exporter)
    trace = RequestTrace("Score", traceparent=f"00-{TRACE_ID}-{SPAN_ID}-{flags}")
    trace.end_ns = trace.start_ns + 1000  # fast: kept only for its parent
    assert tracer.finish(trace, "OK") is kept
    spans = exporter.get_finished_spans()
    assert len(spans) == int(kept)
    if kept:
        root = next(s for s in spans if s.parent is not None and s.parent.span_id == int(SPAN_ID, 16))
        assert root.context.trace_id == int(TRACE_ID, 16) and root.attributes["slmrank.sampled"] == "parent"


def test_is_sampled_reads_only_well_formed_flags() -> None:
    assert is_sampled(f"00-{TRACE_ID}-{SPAN_ID}-01") and not is_sampled(None) and not is_sampled("garbage")


@pytest.mark.parametrize("environ", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_export_turned_off_by_the_environment(environ: dict[str, str]) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", **environ}
    assert TracingConfig.from_env(env).otlp_endpoint is None
    assert TracingConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}).otlp_endpoint


def test_injected_endpoint_without_exporter_serves_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-collector:4317")
    import argparse

    parser = argparse.ArgumentParser()
    from service.serving.settings import add_arguments

    add_arguments(parser, SERVE_SETTINGS)
    config = _server_config(resolve(SERVE_SETTINGS, parser.parse_args(["--model", "m"]), {}))
    assert config.tracing().otlp_endpoint in (None, "")  # no export, no exit
    assert "opentelemetry-exporter-otlp-proto-grpc" in caplog.text and "serving without span export" in caplog.text
    with pytest.raises(ValueError, match="opentelemetry-exporter-otlp-proto-grpc"):  # asked for by slmrank's setting
        _server_config(resolve(SERVE_SETTINGS, parser.parse_args(["--model", "m", "--otlp-endpoint", "c:4317"]), {}))
    time.sleep(0)
