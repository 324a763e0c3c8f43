"""The one registry of `slmrank serve` / `slmrank run` settings, and where each value comes from.

The public settings are written out one by one below: what an operator has a decision to make
about (the model and its placement, the listeners, TLS, the queue caps, batching's bounds,
observability, logging). The other fields of the layers' config dataclasses (the prediction
model's constants: service_window, safety_margin, load_wait_*, ...) keep their dataclass
defaults and are no settings; a test or a benchmark that varies one builds the dataclass.

Every setting has one snake_case name, which is its config-file key; its flag is the name with
dashes (`--batcher-max-wait-s`) and its environment variable the name upper-cased behind
SLMRANK_ (`SLMRANK_BATCHER_MAX_WAIT_S`). A value is taken from the first of

    flag  >  SLMRANK_* environment variable  >  config file (TOML, --config / SLMRANK_CONFIG)  >  default

`--help` shows each default and variable. A setting of a config field takes the field's default
(field_setting: one place for each default); the values are validated there when the configs are
built (ServerConfig, BatcherConfig, AdmissionConfig, TracingConfig). docs/operations.md has the
table of them all (tests/service/test_settings.py holds the two equal).
Every mistake (an unknown file key, an SLMRANK_ADMISSION_* / _BATCHER_* / _TRACE_* variable that
is no setting, a value of the wrong type, a missing file) is a SettingsError: one line, naming
the flag, variable or file key, and exit 2 in the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..observe.tracing import TracingConfig
from ..sched.admission import AdmissionConfig
from ..sched.batcher import BatcherConfig
from .server import ServerConfig

ENV_PREFIX = "SLMRANK_"
NOT_GIVEN = argparse.SUPPRESS  # a flag's default: absent from the namespace unless given
OFF = ("off", "none", "")  # an optional setting (a port, a path) turned off from a string


class SettingsError(ValueError):
    """A setting's value (from a flag, the environment or the config file) is unusable."""


def _int(value: Any) -> int:
    if isinstance(value, (bool, float)):
        raise ValueError("not an integer")
    return int(value)  # int("5.0") raises too


def _float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError("not a number")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return value


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("true/false, 1/0, yes/no or on/off")


_int.__name__, _float.__name__, _str.__name__, _bool.__name__ = "integer", "number", "string", "boolean"
PARSERS = {int: _int, float: _float, str: _str, bool: _bool}


def _optional(cast: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """cast, or None for "off" / "none" / "" (a port or a path turned off from a string)."""
    def parse(value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() in OFF else cast(value)
    parse.__name__ = cast.__name__
    return parse


@dataclass(frozen=True)
class Setting:
    name: str  # config-file key; flag --name-with-dashes; environment SLMRANK_NAME
    parse: Callable[[Any], Any]  # str (flag, environment) or TOML value -> value
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] | None = None
    required: bool = False
    field: str | None = None  # "AdmissionConfig.max_queue_online": the config field it sets, and its default

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def convert(self, value: Any, source: str) -> Any:
        """value from `source` ("--port", "SLMRANK_PORT", "config file F: port") -> the setting's value."""
        try:
            converted = self.parse(value)
        except (TypeError, ValueError) as e:
            raise SettingsError(f"{source}: {value!r} is not a valid {self.parse.__name__} ({e})") from None
        if self.choices is not None and converted not in self.choices:
            raise SettingsError(f"{source}: {converted!r} is not one of {', '.join(self.choices)}")
        return converted


def field_setting(config: type, field: str, prefix: str, group: str, help: str,
                  parse: Callable[[Any], Any] | None = None, choices: tuple[str, ...] | None = None) -> Setting:
    """The public setting `prefix + field` of a config dataclass's field: its default is the
    field's (one place for each default), its parser the default's type unless given (a field
    whose default is None needs one). A field that is not there fails at import."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    if field not in fields:
        raise TypeError(f"{config.__name__} has no field {field!r}")
    default = fields[field].default
    if default is dataclasses.MISSING:
        raise TypeError(f"{config.__name__}.{field} has no plain default")
    return Setting(prefix + field, parse or PARSERS[type(default)], default, help, group, choices,
                   field=f"{config.__name__}.{field}")


# Every public setting is written out here; a config field that is not listed (the prediction
# model's constants: service_window, safety_margin, the bursts, load_wait_*, ...) keeps its
# dataclass default and is no flag, variable or file key (build the dataclass to vary it).
MODEL_SETTINGS = (
    Setting("model", _str, None, "an artifact directory, an embedded spec (embedded:tiny, embedded:qwen2.5-0.5b, "
            "...) or a local Hugging Face checkpoint directory", "model", required=True),
    Setting("runtime", _str, "auto", "cpp: the C++ DAG executor (CUDA graphs on a GPU); python: the reference; "
            "auto: cpp when the extension is installed", "model", ("auto", "cpp", "python")),
    Setting("device", _str, "auto", "auto: cuda when a GPU is visible, else cpu", "model", ("auto", "cuda", "cpu")),
    Setting("dtype", _str, "auto", "compute dtype; auto: bfloat16 on a GPU, else the weights'", "model",
            ("auto", "bfloat16", "float32", "float16")),
    Setting("kernels", _str, "auto", "decoder-layer kernels: aten, or the fused Triton kernels (CUDA); "
            "auto: triton on a GPU, else aten", "model", ("auto", "aten", "triton")),
)

SERVE_SETTINGS = MODEL_SETTINGS + (
    Setting("capture_graphs", _str, "all", "C++ runtime on a GPU: capture every bucket's CUDA graph before "
            "SERVING, lane after lane (all) or each lane on its own thread at once (parallel), or each at its first "
            "batch (lazy: faster start, slower first requests)", "model", ("all", "parallel", "lazy")),
    Setting("beam_graphs", _str, "bucket", "C++ runtime: a CUDA graph per BeamSearch bucket, its decode steps "
            "unrolled (bucket), or one per family of buckets that differ only in new tokens, its decode steps "
            "conditional (conditional: fewer graphs to capture and hold; not yet run on a GPU)", "model",
            ("bucket", "conditional")),
    Setting("lanes", _int, 0, "C++ runtime: batches on the GPU at once, each with its own stream, graphs and "
            "memory pool (0: 2 on CUDA, 1 on the CPU); --batcher-max-inflight follows a larger count unless given",
            "model"),
    field_setting(ServerConfig, "host", "", "server", "address of the gRPC API (127.0.0.1: a sidecar's loopback "
                  "only)"),
    field_setting(ServerConfig, "port", "", "server", "port of the gRPC API (0: any free port, printed)"),
    field_setting(ServerConfig, "health_port", "", "server", "a second, plaintext gRPC listener serving "
                  "grpc.health.v1 only (kubelet probes reach the pod IP, and speak no TLS); off: health on the API "
                  "port only", parse=_optional(_int)),
    field_setting(ServerConfig, "fronts", "", "server", "front processes that own the API port (SO_REUSEPORT), "
                  "refuse what admission would refuse without the engine's event loop, and forward the rest to it "
                  "over a Unix socket (0: none, the engine listens itself; 4 to 8 under heavy overload)"),
    field_setting(ServerConfig, "grace_s", "", "server", "SIGTERM/SIGINT: finish in-flight requests for at most "
                  "this long (seconds), then exit"),
    field_setting(ServerConfig, "send_timeout_s", "", "server", "an answer its client has not taken this long "
                  "(seconds) after it was ready is cancelled (no HTTP/2 flow-control window, a client that does not "
                  "read): one client cannot keep answers in the server"),
    field_setting(ServerConfig, "catalog_dir", "", "server", "a directory of catalog files: Admin.ReplaceCatalog "
                  "(`slmrank client replace-catalog`) swaps one of the artifact's catalogs for a file under it "
                  "while serving, and DIR/NAME.tsv, where it exists, is catalog NAME from the start; off: no "
                  "replacement", parse=_optional(_str)),
    field_setting(ServerConfig, "catalog_headroom", "", "server", "with --catalog-dir: room on the device for "
                  "replaced catalogs, x what the artifact's need (trie nodes, edges, children at a node)"),
    field_setting(ServerConfig, "tls_cert", "", "tls", "PEM certificate chain of the server: TLS on the API port",
                  parse=_optional(_str)),
    field_setting(ServerConfig, "tls_key", "", "tls", "PEM private key of --tls-cert", parse=_optional(_str)),
    field_setting(ServerConfig, "tls_client_ca", "", "tls", "PEM CA bundle: clients must present a certificate it "
                  "signed (mTLS)", parse=_optional(_str)),
    field_setting(BatcherConfig, "max_wait_s", "batcher_", "batching", "the oldest request of a batch that is not "
                  "full waits at most this long (seconds) for more to join"),
    field_setting(BatcherConfig, "max_inflight", "batcher_", "batching", "batches handed to the executor at once "
                  "(running + queued there)"),
    field_setting(BatcherConfig, "max_batch_requests", "batcher_", "batching", "whole requests per batch, at most "
                  "(the artifact's buckets may hold fewer)"),
    field_setting(AdmissionConfig, "max_queue_online", "admission_", "admission", "queued (not yet batched) ONLINE "
                  "requests, at most; more: UNAVAILABLE with a retry hint"),
    field_setting(AdmissionConfig, "max_queue_normal", "admission_", "admission", "likewise NORMAL (and unspecified) "
                  "requests"),
    field_setting(AdmissionConfig, "max_queue_background", "admission_", "admission", "likewise BACKGROUND requests"),
    field_setting(AdmissionConfig, "max_lane_work_s", "admission_", "admission", "predicted executor seconds queued "
                  "per lane, at most (one request always fits)"),
    field_setting(AdmissionConfig, "max_client_work_s", "admission_", "admission", "predicted executor seconds one "
                  "client may have queued and in flight (one request always fits); 0: no cap"),
    field_setting(AdmissionConfig, "max_inflight_rpcs", "admission_", "admission", "Ranker RPCs handled at once; "
                  "more: UNAVAILABLE at once"),
    field_setting(AdmissionConfig, "client_id_metadata", "admission_", "admission", "lower-case metadata key naming "
                  "the client (for --admission-max-client-work-s); absent from a call: the peer's address"),
    field_setting(ServerConfig, "metrics_host", "", "observability", "address of GET /metrics (Prometheus; "
                  "0.0.0.0 to be scraped from outside the pod)"),
    # on in `slmrank serve` (ServerConfig's None, off, is for servers built in-process)
    Setting("metrics_port", _optional(_int), 9464, "port of /metrics (0: any free port, printed; "
            "off: not served)", "observability"),
    field_setting(ServerConfig, "trace_port", "", "observability", "serve GET /trace (the Chrome trace of the "
                  "kept requests) on 127.0.0.1 at this port, a listener of its own (0: any free port, printed; "
                  "off: not served)", parse=_optional(_int)),
    field_setting(TracingConfig, "sample_rate", "trace_", "observability", "share of the requests that are not "
                  "slow whose trace is kept"),
    field_setting(TracingConfig, "slow_ms", "trace_", "observability", "a request at least this long (receive -> "
                  "send, ms) is always kept"),
    field_setting(ServerConfig, "trace_file", "", "observability", "write the Chrome/Perfetto trace of the kept "
                  "requests here when the server stops (read it with `slmrank trace FILE`)", parse=_optional(_str)),
    field_setting(ServerConfig, "otlp_endpoint", "", "observability", "export kept traces as OpenTelemetry spans "
                  "over OTLP to this endpoint (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)", parse=_optional(_str)),
    Setting("log_level", _str, "info", "least severe log record written", "logging",
            ("debug", "info", "warning", "error")),
    Setting("log_format", _str, "text", "text: one readable line per record; json: one JSON object per line",
            "logging", ("text", "json")),
    field_setting(ServerConfig, "access_log", "", "logging", "one log record per finished RPC (method, code, "
                  "latency, peer)"),
)

RUN_SETTINGS = MODEL_SETTINGS

# SLMRANK_<prefix>* variables name settings only: one left over from a setting that became internal
# is refused, not ignored
_SETTING_PREFIXES = ("batcher_", "admission_", "trace_")

GROUP_TITLES = {
    "model": "model and placement",
    "server": "gRPC server",
    "tls": "TLS (plaintext unless --tls-cert and --tls-key are given)",
    "batching": "batching",
    "admission": "admission (bounded priority lanes, deadline-aware refusal)",
    "observability": "metrics and tracing (standard OTEL_* variables are honoured too)",
    "logging": "logging",
}


def add_arguments(parser: argparse.ArgumentParser, settings: Sequence[Setting], with_config: bool = True) -> None:
    """One flag per setting, in groups, with the default and the variable in its help. A flag left
    out is absent from the parsed namespace (resolve() then looks further)."""
    if with_config:
        parser.add_argument("--config", default=NOT_GIVEN, metavar="FILE",
                            help=f"a TOML file of settings, keys as the flags without '--' and with '_' for '-' "
                                 f"[env {ENV_PREFIX}CONFIG]")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings:
        group = groups.get(s.group)
        if group is None:
            group = groups[s.group] = parser.add_argument_group(GROUP_TITLES.get(s.group, s.group))
        default = "required" if s.required else "off" if s.default is None else s.default
        kw: dict[str, Any] = dict(default=NOT_GIVEN, help=f"{s.help} [default: {default}; env {s.env}]")
        if s.parse is _bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["metavar"] = "{" + ",".join(s.choices) + "}" if s.choices else _metavar(s)
        group.add_argument(s.flag, dest=s.name, **kw)


def _metavar(s: Setting) -> str:
    for suffix, metavar in (("_per_s", "N"), ("_s", "SECONDS"), ("_ms", "MS"), ("_port", "PORT"), ("_host", "ADDR"),
                            ("_bytes", "BYTES"), ("_file", "FILE"), ("_cert", "FILE"), ("_key", "FILE"),
                            ("_ca", "FILE"), ("_endpoint", "URL")):
        if s.name.endswith(suffix) or s.name == suffix[1:]:
            return metavar
    return {"integer": "N", "number": "X"}.get(s.parse.__name__, "VALUE")


def read_config_file(path: str | os.PathLike[str], settings: Iterable[Setting]) -> dict[str, Any]:
    """{key: value} of a TOML config file; every key must be a setting's name."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: not found") from None
    except OSError as e:
        raise SettingsError(f"config file {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"config file {path}: not valid TOML ({e})") from None
    known = _known(settings)
    for key in data:
        if key not in known:
            raise SettingsError(f"config file {path}: unknown key {key!r} (`slmrank serve --help` lists the settings; "
                                "keys are the flags without '--', with '_' for '-')")
    return data


def _known(settings: Iterable[Setting]) -> set[str]:
    """The names one config file or environment may give: `serve`'s and `run`'s alike."""
    return {s.name for s in (*SERVE_SETTINGS, *settings)}


def _check_environment(env: Mapping[str, str], settings: Iterable[Setting]) -> None:
    """An SLMRANK_ADMISSION_* / _BATCHER_* / _TRACE_* variable names a setting: one that names none
    (left from a setting that became internal, or mistyped) is an error, not silently ignored."""
    known = _known(settings)
    for key in sorted(env):
        name = key[len(ENV_PREFIX):].lower()
        if key.startswith(ENV_PREFIX) and name.startswith(_SETTING_PREFIXES) and name not in known:
            raise SettingsError(f"{key}: no setting of slmrank serve has this variable (`slmrank serve --help` lists "
                                "them; the prediction model's constants are not settings)")


def resolve(settings: Sequence[Setting], args: argparse.Namespace,
            environ: Mapping[str, str] | None = None, defaulted: set[str] | None = None) -> dict[str, Any]:
    """{name: value} for every setting: flag > SLMRANK_* environment > config file > default. The
    names of those that took their default (given by none of the three) are added to `defaulted`."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    given = vars(args)
    _check_environment(env, settings)
    config_path = given.get("config") or env.get(ENV_PREFIX + "CONFIG") or None
    from_file = read_config_file(config_path, settings) if config_path else {}
    values: dict[str, Any] = {}
    for s in settings:
        if s.name in given:
            value = s.convert(given[s.name], s.flag)
        elif env.get(s.env, "") != "":
            value = s.convert(env[s.env], s.env)
        elif s.name in from_file:
            value = s.convert(from_file[s.name], f"config file {config_path}: {s.name}")
        elif s.required:
            raise SettingsError(f"{s.flag} is required (or {s.env}, or `{s.name} = ...` in the config file)")
        else:
            value = s.default
            if defaulted is not None:
                defaulted.add(s.name)
        values[s.name] = value
    return values


def section(values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The values whose names start with prefix, without it: section(v, "batcher_") -> BatcherConfig(**...)."""
    return {k.removeprefix(prefix): v for k, v in values.items() if k.startswith(prefix)}


__all__ = ["ENV_PREFIX", "GROUP_TITLES", "MODEL_SETTINGS", "RUN_SETTINGS", "SERVE_SETTINGS", "Setting",
           "SettingsError", "add_arguments", "field_setting", "read_config_file", "resolve", "section"]

