"""make_runtime: a runtime by name ("python" | "cpp") over an artifact."""

from __future__ import annotations

from ..artifact.artifact import DTYPES, Artifact
from .cpp_runtime import CppRuntime
from .python_runtime import PythonRuntime


def make_runtime(name: str, artifact: Artifact, device: str, dtype: str | None, kernels: str = "aten"):
    torch_dtype = DTYPES[dtype] if dtype else None
    if name == "python":
        return PythonRuntime(artifact, device=device, dtype=torch_dtype, kernels=kernels)
    if name == "cpp":
        return CppRuntime(artifact, device=device, dtype=torch_dtype, kernels=kernels)
    raise ValueError(f"--runtime: {name!r} is not one of python, cpp")
