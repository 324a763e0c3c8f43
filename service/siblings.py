"""The import names of kernels/ and cpp_dag/, the packages beside service/.

In a checkout (and its editable install: ops/setup, the tests, ops/bench) the three are top-level
packages: `service`, `kernels`, `cpp_dag`. The wheel installs them as `slmrank.service`,
`slmrank.kernels` and `slmrank.cpp_dag` (pyproject.toml's wheel.packages), so that it claims no
generic top-level name: `kernels` is also a Hugging Face package that transformers imports. Code in
service/ therefore reaches its siblings through `sibling()` instead of `import kernels...`, and
names modules it runs with `python -m` through `module_name()`; kernels/ and cpp_dag/ import
only themselves, relatively.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

# What stands before "service" in this module's name: "" in a checkout, "slmrank." in the wheel.
PREFIX = __name__.removesuffix("service.siblings")
# The directory that holds service/, kernels/ and cpp_dag/ (the checkout, or the wheel's slmrank/).
ROOT = Path(__file__).resolve().parents[1]
# Where `python -m module_name(...)` finds the module: the directory above the top-level package.
IMPORT_ROOT = ROOT.parent if PREFIX else ROOT


def module_name(name: str) -> str:
    """"kernels.aot" or "service.serving.fronts.front" -> the name it is imported by here."""
    return PREFIX + name


def sibling(name: str) -> ModuleType:
    """The module `name` ("kernels.attention", "cpp_dag._core"), imported under this install's name."""
    return importlib.import_module(module_name(name))
