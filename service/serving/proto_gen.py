"""Python stubs of proto/slmrank/v1/ranker.proto, generated, never committed.

An installed wheel carries them: the build (CMakeLists.txt) runs `python -m
service.serving.proto_gen DIR`, and DIR (the .proto and its stubs) is installed as service/_proto/;
`load()` uses those when they are there. In a checkout, `load()` generates them with grpc_tools.protoc into service/_gen/<sha256 of the .proto>/
(gitignored) when that directory is missing, so a changed .proto always gets fresh stubs and an
unchanged one is never regenerated. Two processes may generate at once: each writes into its own
temp directory and renames it into place (atomic); the one that loses the race drops its copy.

grpc_tools is imported only here and only to generate: `slmrank run` never imports this module,
and a machine without grpcio-tools serves from stubs generated elsewhere (copy service/_gen/).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
PROTO = "slmrank/v1/ranker.proto"
GEN_ROOT = Path(__file__).resolve().parents[1] / "_gen"
PACKAGED = Path(__file__).resolve().parents[1] / "_proto"  # in an installed wheel only
MODULE = "slmrank.v1.ranker"  # protoc names modules after the .proto's path under PROTO_ROOT


@dataclass(frozen=True)
class Stubs:
    pb2: ModuleType  # messages and enums
    pb2_grpc: ModuleType  # RankerServicer, RankerStub, add_RankerServicer_to_server


def stubs_dir() -> Path:
    digest = hashlib.sha256((PROTO_ROOT / PROTO).read_bytes()).hexdigest()[:16]
    return GEN_ROOT / digest


@functools.cache
def load() -> Stubs:
    if (PACKAGED / PROTO).with_name("ranker_pb2.py").exists():
        out = PACKAGED
    else:
        out = stubs_dir()
        if not (out / PROTO).with_name("ranker_pb2.py").exists():
            _generate(out)
    # The generated _pb2_grpc imports `slmrank.v1.ranker_pb2` absolutely: its root goes on the path.
    if str(out) not in sys.path:
        sys.path.append(str(out))
    return Stubs(importlib.import_module(f"{MODULE}_pb2"), importlib.import_module(f"{MODULE}_pb2_grpc"))


def generate_into(out: Path) -> None:
    """The .proto and its stubs under `out` (slmrank/v1/...): what a wheel ships as service/_proto."""
    _run_protoc(out)
    shutil.copyfile(PROTO_ROOT / PROTO, out / PROTO)


def _generate(out: Path) -> None:
    GEN_ROOT.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=GEN_ROOT))
    try:
        _run_protoc(tmp)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_protoc(out: Path) -> None:
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise RuntimeError(f"the gRPC stubs of proto/{PROTO} are not generated here ({out}) and grpcio-tools "
                           "is not installed: `pip install grpcio-tools`, or copy service/_gen/ from a "
                           "checkout that has them") from e
    import importlib.resources

    out.mkdir(parents=True, exist_ok=True)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    rc = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={out}",
                      f"--pyi_out={out}", f"--grpc_python_out={out}", str(PROTO_ROOT / PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on proto/{PROTO} (exit {rc}; its errors are above)")


if __name__ == "__main__":  # the build: python -m service.serving.proto_gen OUT_DIR
    generate_into(Path(sys.argv[1]))
