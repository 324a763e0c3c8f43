"""The one-TU rule (docs/building.md): only bindings.cpp may include the slow Python headers."""

import re
from pathlib import Path

CPP_DAG = Path(__file__).resolve().parents[2] / "cpp_dag"
PYTHON_HEADERS = re.compile(
    r'^\s*#\s*include\s*[<"](torch/extension\.h|torch/python\.h|torch/torch\.h|torch/all\.h'
    r"|pybind11/[^>\"]*|Python\.h)[>\"]",
    re.MULTILINE,
)


def test_only_bindings_includes_python_headers():
    offenders = {
        path.name: PYTHON_HEADERS.findall(path.read_text())
        for path in sorted(CPP_DAG.glob("*"))
        if path.suffix in {".cpp", ".h", ".cu", ".cuh"} and path.name != "bindings.cpp"
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_bindings_includes_torch_extension():
    assert "torch/extension.h" in PYTHON_HEADERS.findall((CPP_DAG / "bindings.cpp").read_text())
