"""Stub generation: keyed by the .proto's content, safe when several processes generate at once,
and never needed (grpc_tools never imported) by `slmrank run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.serving import proto_gen

ROOT = Path(__file__).resolve().parents[2]

_GENERATE = """
import sys
from pathlib import Path
import service.serving.proto_gen as g
g.GEN_ROOT = Path(sys.argv[1])
g._generate(g.stubs_dir())
"""


def test_concurrent_generation_leaves_one_complete_copy(tmp_path: Path):
    procs = [subprocess.Popen([sys.executable, "-c", _GENERATE, str(tmp_path)], cwd=ROOT, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert [d.name for d in tmp_path.iterdir()] == [proto_gen.stubs_dir().name], "one copy, no temp dirs left"
    gen = tmp_path / proto_gen.stubs_dir().name / "slmrank" / "v1"
    assert {"ranker_pb2.py", "ranker_pb2_grpc.py"} <= {f.name for f in gen.iterdir()}
    assert "class RankerStub" in (gen / "ranker_pb2_grpc.py").read_text()


def test_a_changed_proto_gets_fresh_stubs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    before = proto_gen.stubs_dir()
    changed = tmp_path / proto_gen.PROTO
    changed.parent.mkdir(parents=True)
    changed.write_text((proto_gen.PROTO_ROOT / proto_gen.PROTO).read_text() + "\n// changed\n")
    monkeypatch.setattr(proto_gen, "PROTO_ROOT", tmp_path)
    assert proto_gen.stubs_dir() != before


def test_slmrank_run_needs_no_grpc():
    code = ("import sys, service.cli, service.runtime.engine, service.runtime.jsonl; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'grpc_tools', 'slmrank')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
