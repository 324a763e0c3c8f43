"""Where a model runs when nobody says: production defaults for `slmrank serve` / `slmrank run`.

    device  auto -> cuda when torch sees a GPU, else cpu
    runtime auto -> cpp (the C++ DAG executor) when its extension imports, else python
    dtype   auto -> bfloat16 on cuda, else the weights' own dtype

An explicit choice that cannot work here (--device cuda without a GPU, --runtime cpp without
the extension, an extension built without CUDA on a GPU) is a PlacementError, one line, before
anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..siblings import sibling


class PlacementError(ValueError):
    """A runtime / device / dtype that this machine cannot provide."""


@dataclass(frozen=True)
class Placement:
    runtime: str  # "cpp" | "python"
    device: str  # "cuda" | "cpu"
    dtype: str | None  # None: the weights' dtype

    def describe(self) -> str:
        return f"{self.runtime} runtime, {self.device}, {self.dtype or 'weights dtype'}"


def _extension() -> tuple[object | None, str]:
    """(cpp_dag._core or None, why not)."""
    try:
        return sibling("cpp_dag._core"), ""
    except ImportError as e:
        return None, str(e)


def resolve_placement(runtime: str = "auto", device: str = "auto", dtype: str = "auto") -> Placement:
    has_gpu = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if has_gpu else "cpu"
    elif device == "cuda" and not has_gpu:
        raise PlacementError("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False; "
                             f"torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'})")
    core, why = _extension()
    if runtime == "auto":
        runtime = "cpp" if core is not None else "python"
    elif runtime == "cpp" and core is None:
        raise PlacementError(f"--runtime cpp: the C++ extension cpp_dag._core does not import ({why}); "
                             "build it (ops/setup) or use --runtime python")
    if runtime == "cpp" and device == "cuda" and core is not None and not core.build_info()["with_cuda"]:
        raise PlacementError("--runtime cpp --device cuda: the installed extension was built without CUDA; "
                             "rebuild it against a CUDA torch (docs/building.md)")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else None
    return Placement(runtime, device, dtype)
