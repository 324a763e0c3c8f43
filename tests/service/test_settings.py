"""The settings registry: flag > SLMRANK_* environment > config file > default, for every kind of
value; --help shows each default and variable; every field of the layers' config dataclasses is a
setting; every mistake is one SettingsError line naming where the bad value came from; the
resolved settings build a valid ServerConfig."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from service.cli import _server_config
from service.cli import main as cli_main
from service.observe.tracing import TracingConfig
from service.sched.admission import AdmissionConfig
from service.sched.batcher import BatcherConfig
from service.serving.settings import SERVE_SETTINGS, SettingsError, add_arguments, resolve


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


@pytest.mark.parametrize("config, prefix, excluded", [
    (AdmissionConfig, "admission_", ()),
    (BatcherConfig, "batcher_", ("validate_requests",)),
    (TracingConfig, "trace_", ("otlp_endpoint", "otlp_protocol", "seed")),
])
def test_every_tunable_field_is_a_setting_with_its_default(config, prefix, excluded) -> None:
    registry = {s.name: s for s in SERVE_SETTINGS}
    for f in dataclasses.fields(config):
        if f.name in excluded:
            continue
        assert prefix + f.name in registry, f"{config.__name__}.{f.name} has no setting"
        assert registry[prefix + f.name].default == f.default


def test_defaults_build_a_valid_server_config() -> None:
    values = resolve(SERVE_SETTINGS, parse(["--model", "m"]), {})
    config = _server_config(values)
    assert config.metrics_port == 9464 and config.metrics_host == "127.0.0.1", "metrics on by default, locally"
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
