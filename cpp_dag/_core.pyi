from typing import Any, Callable, TypedDict

import torch

class BuildInfo(TypedDict):
    torch_version: str
    with_cuda: bool
    cxx_standard: str
    cxx11_abi: bool

# (outputs, timings): outputs are host tensors (Score: [scores]; beam: [seqs, scores]);
# timings: submit_ns, start_ns, h2d_end_ns, launch_ns, d2h_end_ns, done_ns (monotonic ns),
# graph (bool), nodes [(name, host_ms, device_ms)], and trace [(node, {buffer: tensor})] when asked.
RunResult = tuple[list[torch.Tensor], dict[str, Any]]

class Executor:
    def __init__(
        self,
        config: dict[str, Any],
        weights: dict[str, torch.Tensor],
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        score_dag: list[dict[str, Any]],
        beam_dag: list[dict[str, Any]],
        use_graphs: bool = True,
        num_lanes: int = 0,
    ) -> None: ...
    @staticmethod
    def from_artifact(
        path: str,
        device: str = "cpu",
        dtype: str | None = None,
        use_graphs: bool = True,
        verify: bool = True,
        num_lanes: int = 0,
    ) -> Executor: ...
    def prepare(
        self, kind: str, inputs: dict[str, torch.Tensor], num_requests: int = 0, beam_width: int = 0,
        new_tokens: int = 1,
    ) -> float: ...
    @property
    def uses_graphs(self) -> bool: ...
    @property
    def num_graphs(self) -> int: ...
    @property
    def num_lanes(self) -> int: ...
    def run(
        self, kind: str, inputs: dict[str, torch.Tensor], num_requests: int = 0, beam_width: int = 0,
        new_tokens: int = 1, trace: list[str] = ...,
    ) -> RunResult: ...
    def submit(
        self, kind: str, inputs: dict[str, torch.Tensor], callback: Callable[[RunResult | None, str | None], None],
        num_requests: int = 0, beam_width: int = 0, new_tokens: int = 1,
    ) -> None: ...
    def shutdown(self) -> None: ...
    def pending(self) -> int: ...
    def node_names(self, kind: str) -> list[str]: ...
    def use_triton_kernels(self, dir: str) -> None: ...
    @property
    def uses_triton_kernels(self) -> bool: ...

def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def read_msgpack(path: str) -> Any: ...
def sha256_file(path: str) -> str: ...
def read_safetensors(path: str, device: str = "cpu", dtype: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]: ...
def load_artifact(path: str, device: str = "cpu", dtype: str | None = None, verify: bool = True) -> dict[str, Any]: ...
def build_info() -> BuildInfo: ...

class TritonKernels:
    """CUDA builds only: the cubins of a kernels/aot.py directory, launched on the current stream."""

    def __init__(self, dir: str, device: str = "cuda") -> None: ...
    def variants(self) -> list[str]: ...
    def has(self, variant: str) -> bool: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def rms_norm_residual(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def qkv_rope(
        self, qkv: torch.Tensor, positions: torch.Tensor, pos_offset: int, cos: torch.Tensor, sin: torch.Tensor,
        num_heads: int, num_kv_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
        k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def decode_attention(
        self, q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, kv_start: torch.Tensor,
        kv_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, num_suffix: int, scale: float,
    ) -> torch.Tensor: ...
    def beam_candidates(
        self, logits: torch.Tensor, beam_scores: torch.Tensor, num_candidates: int, num_parents: int,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
