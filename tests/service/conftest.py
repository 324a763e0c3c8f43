"""Shared session fixtures: tiny random Hugging Face checkpoints (built with transformers), their
slmrank artifacts and Python runtimes, and the embedded:tiny artifact.

Everything is created fresh from fixed seeds in pytest's tmp dirs; nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from service.serving.client import RankerClient
from service.serving.server import RankerServer, ServerConfig
from service.serving.server_thread import ServerThread

VOCAB = 512
MAX_POS = 256


@dataclass
class TinyModel:
    """A transformers model, its checkpoint dir, and slmrank's artifact + runtime built from it."""

    hf: Any  # the transformers model (eval mode, float32)
    ckpt: Path
    artifact: Any
    runtime: Any


def _make(save: Callable[..., Any], tmp_root: Path, name: str, arch: str, model_cls_name: str, seed: int,
          save_kw: dict[str, Any] | None = None, **cfg_extra: Any) -> TinyModel:
    from service.artifact.artifact import build_artifact, load_artifact
    from service.runtime.python_runtime import PythonRuntime

    model, ckpt = save(tmp_root, name, arch, model_cls_name, seed, vocab=VOCAB, max_pos=MAX_POS, save_kw=save_kw,
                       **cfg_extra)
    art = load_artifact(build_artifact(str(ckpt), tmp_root / f"{name}.art", quiet=True))
    return TinyModel(model, ckpt, art, PythonRuntime(art))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def qwen2_tiny(tiny_root: Path, save_tiny_checkpoint) -> TinyModel:
    """Qwen2: q/k/v bias, tied embeddings."""
    return _make(save_tiny_checkpoint, tiny_root, "qwen2", "qwen2", "Qwen2ForCausalLM",
                 seed=11, tie_word_embeddings=True, rope_theta=50000.0)


@pytest.fixture(scope="session")
def qwen3_tiny(tiny_root: Path, save_tiny_checkpoint) -> TinyModel:
    """Qwen3: q/k RMSNorm, untied embeddings."""
    return _make(save_tiny_checkpoint, tiny_root, "qwen3", "qwen3", "Qwen3ForCausalLM",
                 seed=23, tie_word_embeddings=False, rope_theta=1_000_000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="session")
def qwen3_sharded(tiny_root: Path, save_tiny_checkpoint) -> TinyModel:
    """Qwen3 saved in several safetensors shards with a model.safetensors.index.json."""
    m = _make(save_tiny_checkpoint, tiny_root, "qwen3_sharded", "qwen3", "Qwen3ForCausalLM",
              seed=37, tie_word_embeddings=False, save_kw={"max_shard_size": "60KB"})
    return m


@pytest.fixture(scope="session")
def qwen2_cls(tiny_root: Path, save_tiny_checkpoint) -> TinyModel:
    """Qwen2ForSequenceClassification with 3 labels (a "score" head replaces the LM head)."""
    return _make(save_tiny_checkpoint, tiny_root, "qwen2_cls", "qwen2", "Qwen2ForSequenceClassification", seed=41,
                 num_labels=3, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def embedded_tiny(tmp_path_factory: pytest.TempPathFactory):
    """embedded:tiny built once: (artifact dir, Artifact)."""
    from service.artifact.artifact import build_artifact, load_artifact

    out = build_artifact("embedded:tiny", tmp_path_factory.mktemp("embedded") / "tiny", quiet=True)
    return out, load_artifact(out)


@pytest.fixture(scope="module")
def model(embedded_tiny):
    """What the gRPC server serves in the tests: embedded:tiny, the Python runtime, its tokenizer."""
    from service.runtime.python_runtime import PythonRuntime
    from service.serving.server import Model
    from service.model.tokenizer import load_tokenizer

    art = embedded_tiny[1]
    return Model(art, PythonRuntime(art), load_tokenizer(art.tokenizer_dir))


@pytest.fixture(scope="module", params=["python", "cpp"])
def cpu_runtime(request, embedded_tiny):
    """embedded:tiny on each CPU runtime: the Python runtime, the C++ executor (ops/setup always builds it)."""
    from service.runtime.python_runtime import PythonRuntime

    if request.param == "python":
        yield PythonRuntime(embedded_tiny[1])
        return
    from service.runtime.cpp_runtime import CppRuntime

    rt = CppRuntime(embedded_tiny[1])
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def embedded_tiny_runtime(embedded_tiny):
    from service.runtime.python_runtime import PythonRuntime

    return PythonRuntime(embedded_tiny[1])


# ---- helpers -----------------------------------------------------------------------------------

def rand_ids(rng: random.Random, n: int, vocab: int = VOCAB) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(n))


@torch.no_grad()
def hf_label_logprobs(model, ids: list[int], label_ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[label_ids].tolist()


@torch.no_grad()
def hf_beam(model, prompt: list[int], beams: int, new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """HF generate with the slmrank beam semantics: B sequences of exactly T new tokens, best first,
    cumulative log-probabilities (no length penalty, no EOS). B=1 is greedy in HF."""
    gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=beams, num_return_sequences=beams,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    seqs = gen.sequences[:, len(prompt):].tolist()
    assert all(len(s) == new_tokens for s in seqs)
    if beams > 1:
        scores = gen.sequences_scores.float().tolist()
    else:
        scores = [sum(torch.log_softmax(sc[0].float(), -1)[tok].item() for sc, tok in zip(gen.scores, seqs[0]))]
    return seqs, scores


@pytest.fixture(scope="session")
def hf_ref():
    """The HF reference helpers, as a fixture (test modules cannot import conftest directly)."""
    from types import SimpleNamespace

    return SimpleNamespace(label_logprobs=hf_label_logprobs, beam=hf_beam, rand_ids=rand_ids, vocab=VOCAB)


# ---- a server over real gRPC on the module's embedded:tiny model (a module may define its own) ----

@pytest.fixture(scope="module")
def server(model):
    srv = ServerThread(RankerServer(ServerConfig(host="127.0.0.1", port=0, grace_s=5), lambda: model))
    srv.wait_serving()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with RankerClient(server.target, timeout_s=60) as c:
        yield c
