"""ops/device/ab_prepare: REF's version of every tracked path that differs from the working tree,
for the GPU machine's copy (no git there) to run the old server beside the new one
(ops/device/capacity AB_ROUNDS)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin"}).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    (r / "ops" / "device").mkdir(parents=True)
    (r / "service").mkdir()
    shutil.copy(ROOT / "ops" / "device" / "ab_prepare", r / "ops" / "device" / "ab_prepare")
    (r / "service" / "batcher.py").write_text("WAIT = 'old'\n")
    (r / "service" / "gone.py").write_text("old only\n")
    (r / "run.sh").write_text("#!/bin/sh\necho old\n")
    (r / "run.sh").chmod(0o755)
    git(r, "init", "-q")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "old")
    return r


def prepare(repo: Path, ref: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "ops" / "device" / "ab_prepare"), ref], cwd=repo, capture_output=True,
                          text=True)


def test_old_versions_deleted_paths_and_the_ref_are_written(repo: Path) -> None:
    old = git(repo, "rev-parse", "HEAD")
    (repo / "service" / "batcher.py").write_text("WAIT = 'new'\n")  # changed, not committed
    (repo / "run.sh").write_text("#!/bin/sh\necho new\n")
    (repo / "service" / "added.py").write_text("new only\n")
    git(repo, "add", "service/added.py")
    git(repo, "rm", "-q", "service/gone.py")
    git(repo, "commit", "-qm", "new")
    (repo / "service" / "untouched.py").write_text("untracked: not compared\n")

    done = prepare(repo, old[:8])
    assert done.returncode == 0, done.stderr
    ab = repo / ".ab"
    assert (ab / "ref").read_text().strip() == old
    assert (ab / "tree" / "service" / "batcher.py").read_text() == "WAIT = 'old'\n"
    assert (ab / "tree" / "service" / "gone.py").read_text() == "old only\n"  # the old tree had it
    assert (ab / "tree" / "run.sh").read_text() == "#!/bin/sh\necho old\n"
    assert (ab / "tree" / "run.sh").stat().st_mode & 0o111  # still executable
    assert (ab / "deleted").read_text().split() == ["service/added.py"]  # the old tree lacks it
    assert not (ab / "tree" / "service" / "untouched.py").exists()
    assert not (ab / "tree" / "ops").exists()  # ab_prepare itself is the same on both sides


def test_nothing_to_compare_and_a_bad_ref_fail_clearly(repo: Path) -> None:
    same = prepare(repo, "HEAD")
    assert same.returncode == 1 and "nothing to compare" in same.stderr
    assert not (repo / ".ab").exists()
    bad = prepare(repo, "no-such-ref")
    assert bad.returncode == 2 and "'no-such-ref' names no commit" in bad.stderr
