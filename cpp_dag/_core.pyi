from typing import TypedDict

import torch

class BuildInfo(TypedDict):
    torch_version: str
    with_cuda: bool
    cxx_standard: str
    cxx11_abi: bool

def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def build_info() -> BuildInfo: ...
