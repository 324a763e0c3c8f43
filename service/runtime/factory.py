"""make_runtime: a runtime by name ("python" | "cpp") over an artifact."""

from __future__ import annotations

from ..artifact.artifact import DTYPES, Artifact
from .cpp_runtime import CppRuntime
from .fused import resolve_kernels
from .python_runtime import PythonRuntime


def make_runtime(name: str, artifact: Artifact, device: str, dtype: str | None, kernels: str = "auto",
                 num_lanes: int = 0, catalog_headroom: float = 1.0, beam_graphs: str = "bucket"):
    """kernels: aten | triton | auto (triton on CUDA). num_lanes: the C++ runtime's batches in flight
    (0: its default, 2 on CUDA, 1 on the CPU). catalog_headroom: room for replaced catalogs
    (x what the artifact's need; Scheduler.replace_catalog). beam_graphs: the C++ runtime's
    (CppRuntime; "bucket" is the only one the Python runtime has: it captures no graph)."""
    torch_dtype = DTYPES[dtype] if dtype else None
    kernels = resolve_kernels(kernels, device)
    if name == "python":
        if beam_graphs != "bucket":
            raise ValueError(f"--beam-graphs {beam_graphs}: a C++ runtime setting (--runtime cpp); the Python "
                             "runtime captures no graph")
        return PythonRuntime(artifact, device=device, dtype=torch_dtype, kernels=kernels,
                             catalog_headroom=catalog_headroom)
    if name == "cpp":
        return CppRuntime(artifact, device=device, dtype=torch_dtype, kernels=kernels, num_lanes=num_lanes,
                          catalog_headroom=catalog_headroom, beam_graphs=beam_graphs)
    raise ValueError(f"--runtime: {name!r} is not one of python, cpp")
