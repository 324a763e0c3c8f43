"""The settings registry: flag > SLMRANK_* environment > config file > default, for every kind of
value; --help shows each default and variable; the public settings are an explicit list of at
most 36, equal to docs/operations.md's table, each taking its config field's default; the
prediction model's constants are no flag, variable or file key (a test builds the dataclass to
vary one); every mistake is one SettingsError line naming where the bad value came from; the
resolved settings build a valid ServerConfig."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from service.cli import _server_config
from service.cli import main as cli_main
from service.observe.tracing import TracingConfig
from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig
from service.serving.server import ServerConfig
from service.serving.settings import RUN_SETTINGS, SERVE_SETTINGS, SettingsError, add_arguments, resolve

ROOT = Path(__file__).resolve().parents[2]
MAX_PUBLIC = 39  # 35 until send_timeout_s (issue 32, point 3), the one bound on a client a flag sets;
# 38 with catalog_dir and catalog_headroom (issue 28: replacing a catalog while serving needs a place
# to read files from, and the room it may grow into is the operator's call); 39 with beam_graphs (the
# C++ runtime's graph per BeamSearch bucket or per family of them: start-up and device memory against
# a conditional node per decode step, to be measured before either is the only one)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slmrank serve")
    add_arguments(parser, SERVE_SETTINGS)
    return parser.parse_args(argv)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "slmrank.toml"
    path.write_text(text)
    return str(path)


CASES = [  # setting, flag value, env value, file value (TOML), resolved from each, default
    ("port", "7001", "7002", "7003", (7001, 7002, 7003), 50051),
    ("grace_s", "1.5", "2.5", "3.5", (1.5, 2.5, 3.5), 20.0),
    ("host", "10.0.0.1", "10.0.0.2", '"10.0.0.3"', ("10.0.0.1", "10.0.0.2", "10.0.0.3"), "0.0.0.0"),
    ("runtime", "python", "cpp", '"python"', ("python", "cpp", "python"), "auto"),
    ("batcher_max_wait_s", "0.001", "0.002", "0.003", (0.001, 0.002, 0.003), BatcherConfig().max_wait_s),
    ("admission_max_queue_online", "11", "12", "13", (11, 12, 13), AdmissionConfig().max_queue_online),
    ("metrics_port", "off", "9000", "9001", (None, 9000, 9001), 9464),
    ("access_log", None, "yes", "false", (True, True, False), False),
]


@pytest.mark.parametrize("name, flag, env, file, expected, default", CASES, ids=[c[0] for c in CASES])
def test_flag_over_env_over_file_over_default(tmp_path: Path, name, flag, env, file, expected, default) -> None:
    setting = next(s for s in SERVE_SETTINGS if s.name == name)
    config = write(tmp_path, f'model = "m"\n{name} = {file}\n')
    argv = ["--config", config]
    argv += [setting.flag] if flag is None else [setting.flag, flag]  # a boolean flag takes no value
    environ = {setting.env: env}
    from_flag, from_env, from_file = expected
    assert resolve(SERVE_SETTINGS, parse(argv), environ)[name] == from_flag
    assert resolve(SERVE_SETTINGS, parse(["--config", config]), environ)[name] == from_env
    assert resolve(SERVE_SETTINGS, parse(["--config", config]), {})[name] == from_file
    assert resolve(SERVE_SETTINGS, parse(["--model", "m"]), {})[name] == default


def test_config_file_named_by_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path, 'model = "from-file"\nport = 6000\n')
    values = resolve(SERVE_SETTINGS, parse([]), {"SLMRANK_CONFIG": config})
    assert values["model"] == "from-file" and values["port"] == 6000
    other = write(tmp_path.joinpath("x").mkdir() or tmp_path / "x", 'model = "flag-file"\n')
    assert resolve(SERVE_SETTINGS, parse(["--config", other]), {"SLMRANK_CONFIG": config})["model"] == "flag-file"


def test_an_empty_variable_is_not_set(tmp_path: Path) -> None:
    config = write(tmp_path, 'model = "m"\nport = 6001\n')
    assert resolve(SERVE_SETTINGS, parse(["--config", config]), {"SLMRANK_PORT": ""})["port"] == 6001


@pytest.mark.parametrize("argv, environ, file, message", [
    ([], {}, None, "--model is required (or SLMRANK_MODEL"),
    (["--model", "m"], {"SLMRANK_PORT": "fifty"}, None, "SLMRANK_PORT: 'fifty' is not a valid integer"),
    (["--model", "m", "--grace-s", "soon"], {}, None, "--grace-s: 'soon' is not a valid number"),
    (["--model", "m"], {"SLMRANK_RUNTIME": "java"}, None, "SLMRANK_RUNTIME: 'java' is not one of auto, cpp, python"),
    (["--model", "m"], {"SLMRANK_ACCESS_LOG": "maybe"}, None, "SLMRANK_ACCESS_LOG: 'maybe' is not a valid boolean"),
    ([], {}, 'model = "m"\nprot = 1\n', "unknown key 'prot'"),
    ([], {}, 'model = "m"\nport = 1.5\n', "port: 1.5 is not a valid integer"),
    ([], {}, 'model = "m"\nport = "1"\nhost = 5\n', "host: 5 is not a valid string"),
    ([], {}, 'model = "m"\nport = true\n', "port: True is not a valid integer"),
    ([], {}, "model = \n", "not valid TOML"),
])
def test_mistakes_name_their_source(tmp_path: Path, argv, environ, file, message) -> None:
    if file is not None:
        argv = [*argv, "--config", write(tmp_path, file)]
    with pytest.raises(SettingsError, match=None) as err:
        resolve(SERVE_SETTINGS, parse(argv), environ)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"config file .*nope.toml: not found"):
        resolve(SERVE_SETTINGS, parse(["--config", str(tmp_path / "nope.toml")]), {})


CONFIGS = {c.__name__: c for c in (AdmissionConfig, BatcherConfig, TracingConfig, ServerConfig)}


def test_each_public_setting_takes_its_config_fields_default() -> None:
    fields = [s for s in SERVE_SETTINGS if s.field is not None]
    assert len(fields) > 20
    for s in fields:
        config, name = s.field.split(".")
        field = {f.name: f for f in dataclasses.fields(CONFIGS[config])}[name]
        assert s.default == field.default, s.name
    assert len({s.name for s in SERVE_SETTINGS}) == len(SERVE_SETTINGS)
    assert {s.name for s in RUN_SETTINGS} == {"model", "runtime", "device", "dtype", "kernels"}


# the prediction model's constants (and the transport's and tracing's internal bounds): dataclass
# fields with their defaults, and no flag, variable or file key
INTERNAL = [(AdmissionConfig, "admission_", name) for name in (
    "service_window", "service_quantile", "service_ttl_s", "outlier_factor", "calibration_decay_s", "max_calibration",
    "utilisation_window_s", "default_service_s", "online_burst", "normal_burst", "safety_margin",
    "response_margin_s", "max_retry_after_s", "min_retry_after_s", "unavailable_retry_s", "front_max_backlog_s")]
INTERNAL += [(BatcherConfig, "batcher_", name) for name in (
    "heavy_batch_s", "heavy_ratio", "light_window_s", "load_wait_share", "load_wait_max_s", "load_wait_outside_s",
    "validate_requests")]
INTERNAL += [(TracingConfig, "trace_", name) for name in ("max_kept_per_s", "chrome_max_events")]
INTERNAL += [(ServerConfig, "", name) for name in ("max_receive_message_bytes", "max_send_message_bytes",
                                                    "receive_timeout_s", "handshake_timeout_s",
                                                    "max_streams_per_connection", "max_connections")]


def test_there_are_at_most_38_public_settings() -> None:
    assert len(SERVE_SETTINGS) <= MAX_PUBLIC, [s.name for s in SERVE_SETTINGS]


@pytest.mark.parametrize("config, prefix, name", INTERNAL, ids=[p + n for _, p, n in INTERNAL])
def test_an_internal_constant_is_no_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            config, prefix, name) -> None:
    assert name in {f.name for f in dataclasses.fields(config)}, f"{config.__name__}.{name}: gone (drop it here)"
    setting = prefix + name
    assert setting not in {s.name for s in SERVE_SETTINGS}
    flag = "--" + setting.replace("_", "-")
    with pytest.raises(SystemExit) as exit_:  # argparse: unrecognized arguments
        parse(["--model", "m", flag, "1"])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err
    with pytest.raises(SettingsError, match=f"unknown key '{setting}'"):
        resolve(SERVE_SETTINGS, parse(["--config", write(tmp_path, f'model = "m"\n{setting} = 1\n')]), {})
    if prefix:  # SLMRANK_ADMISSION_* / _BATCHER_* / _TRACE_* name settings only: a leftover is refused
        variable = "SLMRANK_" + setting.upper()
        with pytest.raises(SettingsError, match=f"^{variable}: no setting"):
            resolve(SERVE_SETTINGS, parse(["--model", "m"]), {variable: "1"})


def test_an_internal_constant_is_varied_by_building_its_dataclass() -> None:
    """The route a test or an experiment takes: the dataclass, validated there."""
    config = ServerConfig(admission=AdmissionConfig(safety_margin=0.25, service_window=8),
                          batcher=BatcherConfig(load_wait_share=0.0, validate_requests=False))
    assert config.admission.safety_margin == 0.25 and config.admission.service_window == 8
    assert config.batcher.load_wait_share == 0.0
    with pytest.raises(ValueError, match="admission.service_quantile"):
        AdmissionConfig(service_quantile=1.5)


def test_other_slmrank_variables_pass() -> None:
    """SLMRANK_CACHE, SLMRANK_PROFILE_LOOP, ... are no settings and pass; so does `serve`'s variable under `run`."""
    environ = {"SLMRANK_CACHE": "/tmp/c", "SLMRANK_PROFILE_LOOP": "/tmp/p", "SLMRANK_BATCHER_MAX_WAIT_S": "0.001"}
    parser = argparse.ArgumentParser(prog="slmrank run")
    add_arguments(parser, RUN_SETTINGS)
    assert resolve(RUN_SETTINGS, parser.parse_args(["--model", "m"]), environ)["model"] == "m"
    assert resolve(SERVE_SETTINGS, parse(["--model", "m"]), environ)["batcher_max_wait_s"] == 0.001


def _documented(value) -> str:
    """A default as docs/operations.md writes it."""
    if value is None:
        return "off"
    if isinstance(value, bool):
        return str(value).lower()
    return format(value, "g") if isinstance(value, float) else str(value)


def test_the_operations_table_lists_every_public_setting() -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    table = text.split("<!-- settings table: one row per public setting -->", 1)[1].lstrip("\n")
    rows = []
    for line in table.split("\n"):
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    header, rule, *rows = rows
    assert header[:4] == ["setting", "flag", "variable", "default"] and set(rule[0]) == {"-"}
    cells = {re.sub(r"`", "", row[0]): [re.sub(r"`", "", c) for c in row[1:]] for row in rows}
    assert len(cells) == len(rows), "a setting in two rows"
    registry = {s.name: s for s in SERVE_SETTINGS}
    assert set(cells) == set(registry), (set(cells) ^ set(registry))
    assert len(cells) <= MAX_PUBLIC
    for name, (flag, variable, default, what) in cells.items():
        s = registry[name]
        assert (flag, variable) == (s.flag, s.env), name
        assert default == ("(required)" if s.required else _documented(s.default)), name
        assert what, name


def test_defaults_build_a_valid_server_config() -> None:
    values = resolve(SERVE_SETTINGS, parse(["--model", "m"]), {})
    config = _server_config(values)
    assert config.metrics_port == 9464 and config.metrics_host == "127.0.0.1", "metrics on by default, locally"
    assert config.trace_port is None, "/trace (request timings) is served only when asked for"
    assert config.admission == AdmissionConfig() and config.batcher.max_wait_s == BatcherConfig().max_wait_s
    assert config.batcher.validate_requests is False


def test_values_reach_the_server_config(tmp_path: Path) -> None:
    config = write(tmp_path, 'model = "m"\nadmission_max_queue_normal = 3\nbatcher_max_inflight = 4\n'
                             'trace_sample_rate = 0.5\nhealth_port = 8081\n')
    values = resolve(SERVE_SETTINGS, parse(["--config", config, "--trace-slow-ms", "7"]), {})
    server = _server_config(values)
    assert server.admission.max_queue_normal == 3 and server.batcher.max_inflight == 4
    assert server.health_port == 8081
    tracing = server.tracing()
    assert tracing.sample_rate == 0.5 and tracing.slow_ms == 7


def test_help_shows_every_default_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for s in SERVE_SETTINGS:
        assert s.flag in text and f"env {s.env}]" in text, s.name
    assert "[default: 50051; env SLMRANK_PORT]" in text
    assert "[default: 127.0.0.1; env SLMRANK_METRICS_HOST]" in text
    assert f"[default: {AdmissionConfig().max_queue_online}; env SLMRANK_ADMISSION_MAX_QUEUE_ONLINE]" in text


def test_client_and_trace_commands_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, service.cli as c; c.main(['client', '--help'])"
    out = subprocess.run([sys.executable, "-c", code + "\n"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    code = ("import sys, service.cli as c\ntry:\n    c.main(['trace', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("argv, environ, slots, warns", [
    ([], {}, BatcherConfig().max_inflight, False),  # the defaults: 2 lanes on CUDA, 2 slots
    (["--lanes", "1"], {}, BatcherConfig().max_inflight, False),  # one running, one queued, as before
    (["--lanes", "3"], {}, 3, False),  # a third lane gets a slot to be used
    (["--lanes", "3", "--batcher-max-inflight", "4"], {}, 4, False),
    (["--lanes", "3", "--batcher-max-inflight", "2"], {}, 2, True),  # given: kept, and said
    (["--lanes", "3"], {"SLMRANK_BATCHER_MAX_INFLIGHT": "2"}, 2, True),  # given by the environment is given
])
def test_slots_follow_more_lanes_unless_given(argv, environ, slots, warns) -> None:
    from service.cli import lanes_and_slots

    defaulted: set[str] = set()
    values = resolve(SERVE_SETTINGS, parse(["--model", "m", *argv]), environ, defaulted=defaulted)
    warning = lanes_and_slots(values, defaulted)
    assert values["batcher_max_inflight"] == slots
    assert _server_config(values).batcher.max_inflight == slots
    if warns:
        assert "--lanes 3" in warning and f"--batcher-max-inflight {slots}" in warning and "1 lane(s)" in warning
    else:
        assert warning == ""


def test_defaulted_names_exactly_the_settings_no_source_gave(tmp_path: Path) -> None:
    config = write(tmp_path, 'model = "m"\nport = 6000\n')
    defaulted: set[str] = set()
    resolve(SERVE_SETTINGS, parse(["--config", config, "--lanes", "2"]), {"SLMRANK_GRACE_S": "3"}, defaulted=defaulted)
    assert defaulted == {s.name for s in SERVE_SETTINGS} - {"model", "port", "lanes", "grace_s"}


def test_negative_lanes_are_refused_naming_the_flag() -> None:
    from service.cli import lanes_and_slots

    defaulted: set[str] = set()
    values = resolve(SERVE_SETTINGS, parse(["--model", "m", "--lanes", "-1"]), {}, defaulted=defaulted)
    with pytest.raises(ValueError, match="--lanes: must be >= 0"):
        lanes_and_slots(values, defaulted)
