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
