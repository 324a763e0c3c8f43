"""Fixtures of the C++-runtime tests: tiny random Hugging Face checkpoints with a small vocabulary
(fast on a CPU), their artifacts, and Python / C++ runtimes over them; plus byte-comparison helpers.

Everything is built fresh from fixed seeds in pytest's tmp dirs; nothing is downloaded.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import msgpack
import pytest
import torch

from service.artifact.artifact import MANIFEST
from service.artifact.manifest import write_manifest

VOCAB = 512
MAX_POS = 96  # small limits: prompt buckets of r x 91 tokens keep the CPU runs quick


@dataclass
class Model:
    ckpt: Path  # the Hugging Face checkpoint directory (config.json + model.safetensors)
    artifact: Any
    python: Any  # PythonRuntime
    cpp: Any  # CppRuntime (CPU, eager)


def _make(save: Callable[..., Any], root: Path, name: str, arch: str, cls_name: str, seed: int,
          fp8: tuple[str, ...] = (), **extra: Any) -> Model:
    from service.artifact.artifact import build_artifact, load_artifact
    from service.runtime.cpp_runtime import CppRuntime
    from service.runtime.python_runtime import PythonRuntime

    _, ckpt = save(root, name, arch, cls_name, seed, vocab=VOCAB, max_pos=MAX_POS, **extra)
    art = load_artifact(build_artifact(str(ckpt), root / f"{name}.art", quiet=True, fp8=fp8))
    return Model(ckpt, art, PythonRuntime(art), CppRuntime(art))


@pytest.fixture(scope="session")
def cpp_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpp_tiny_models")


@pytest.fixture(scope="session")
def qwen2_small(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    """Qwen2 (q/k/v bias, tied embeddings), vocab 512, 2 layers, 96 positions."""
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen2", "qwen2", "Qwen2ForCausalLM",
                 seed=101, tie_word_embeddings=True, rope_theta=50000.0)


@pytest.fixture(scope="session")
def qwen3_small(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    """Qwen3 (q/k RMSNorm, no bias, untied LM head), vocab 512, 2 layers."""
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen3", "qwen3", "Qwen3ForCausalLM",
                 seed=202, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def qwen2_cls_small(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    """Qwen2ForSequenceClassification with 3 labels: Score only."""
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen2_cls", "qwen2", "Qwen2ForSequenceClassification",
                 seed=303, num_labels=3, tie_word_embeddings=False)


# the same checkpoints with FP8 (e4m3) linear layers: every part (`slmrank build --fp8 mlp,attn,head`);
# the tied Qwen2 head becomes its own e4m3 lm_head
FP8_ALL = ("mlp", "attn", "head")


@pytest.fixture(scope="session")
def qwen2_small_fp8(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen2_fp8", "qwen2", "Qwen2ForCausalLM",
                 seed=101, fp8=FP8_ALL, tie_word_embeddings=True, rope_theta=50000.0)


@pytest.fixture(scope="session")
def qwen3_small_fp8(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen3_fp8", "qwen3", "Qwen3ForCausalLM",
                 seed=202, fp8=FP8_ALL, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def qwen2_cls_small_fp8(cpp_models_root: Path, save_tiny_checkpoint) -> Model:
    return _make(save_tiny_checkpoint, cpp_models_root, "qwen2_cls_fp8", "qwen2", "Qwen2ForSequenceClassification",
                 seed=303, fp8=("mlp", "attn"), num_labels=3, tie_word_embeddings=False)


# ---- helpers -----------------------------------------------------------------------------------

def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal byte for byte: same dtype, same shape, same bits (NaN == NaN, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def describe_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
    n = int((a.reshape(-1).contiguous().view(torch.uint8) != b.reshape(-1).contiguous().view(torch.uint8)).sum())
    return f"{n} differing bytes, max |diff| {diff.max().item():.3g}"


def executor_with_dags(art, tmp_path: Path, score_dag: list[dict[str, Any]] | None = None,
                       beam_dag: list[dict[str, Any]] | None = None):
    """A cpp_dag._core.Executor (CPU, eager) from a copy of the artifact whose manifest carries
    other DAGs (node dicts): the executor's one construction path is an artifact directory."""
    from cpp_dag import _core

    copy = tmp_path / f"art-{len(list(tmp_path.glob('art-*')))}"
    shutil.copytree(art.path, copy)
    m = msgpack.unpackb((copy / MANIFEST).read_bytes())
    m["dags"]["score"] = score_dag if score_dag is not None else m["dags"]["score"]
    m["dags"]["beam"] = beam_dag if beam_dag is not None else m["dags"]["beam"]
    write_manifest(copy, m)
    return _core.Executor.from_artifact(str(copy), "cpu", verify=False, use_graphs=False)


def rand_ids(rng: random.Random, n: int, vocab: int = VOCAB) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    """Helpers as a fixture (test modules cannot import conftest under --import-mode=importlib)."""
    return SimpleNamespace(same_bytes=same_bytes, describe_diff=describe_diff, rand_ids=rand_ids, vocab=VOCAB,
                           executor_with_dags=executor_with_dags)
