"""The `slmrank` command line's own flags (the commands are tested beside what they run)."""

from __future__ import annotations

from importlib import metadata

import pytest

from service.cli import main as cli_main


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's version action exits, before the command is required
        cli_main(["--version"])
    assert done.value.code == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"slmrank {metadata.version('slmrank')}" and "required" not in err


@pytest.mark.parametrize("flag, capture, at_once", [("all", True, False), ("parallel", True, True),
                                                    ("lazy", False, False)])
def test_serve_capture_graphs_reaches_load_model(monkeypatch: pytest.MonkeyPatch, flag: str, capture: bool,
                                                 at_once: bool) -> None:
    """--capture-graphs all | parallel | lazy: whether load_model captures before SERVING, and whether
    the lanes capture at once (the C++ executor's prepare(lanes_at_once))."""
    from service.observe import logs
    from service.serving import server

    seen: dict = {}
    monkeypatch.setattr(logs, "configure_logging", lambda *a, **kw: None)  # no handlers left on the root logger
    monkeypatch.setattr(server, "load_model", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(server, "serve", lambda config, loader, *rest: loader() or 0)
    assert cli_main(["serve", "--model", "embedded:tiny", "--runtime", "python", "--device", "cpu", "--port", "0",
                     "--capture-graphs", flag, "--quiet"]) == 0
    assert seen["capture_graphs"] is capture and seen["capture_lanes_at_once"] is at_once


def test_beam_graphs_on_the_python_runtime_is_one_line_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", "--model", "embedded:tiny", "--runtime", "python", "--device", "cpu", "--port", "0",
                     "--beam-graphs", "conditional", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--beam-graphs conditional" in err[0] and "python" in err[0], err
