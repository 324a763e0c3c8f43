"""The C++ DAG runtime (built against libtorch; see docs/building.md)."""

import torch  # noqa: F401  (loads libtorch, which the compiled module links against)

from ._core import build_info, merge_attention_states

__all__ = ["build_info", "merge_attention_states"]
