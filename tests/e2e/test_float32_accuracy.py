"""On the GPU at real shapes: the float32 Triton path (kernels="triton", both runtimes) computes in
float32 — Score log-probs and BeamSearch cumulative log-probs within 3e-4 of Hugging Face run in
float64 on the same weights (issue 8: the ATen path is within 1.8e-4; TF32 dots or fused roundings
would show as 1e-2). Random Qwen2.5-0.5B- and Qwen3-0.6B-shaped checkpoints (embedded specs), beams
up to 400 wide and 5 tokens. Marked gpu and slow (builds two 0.5B artifacts, runs HF in float64)."""

from __future__ import annotations

import random

import pytest
import torch

from service.runtime.engine import execute
from service.model.checkpoint import hf_config_kwargs, hf_state_dict
from service.runtime.requests import BeamRequest, BeamResult, ScoreRequest, ScoreResult

# tens of GB of GPU memory a worker: under --dist loadgroup two such groups share a GPU, not eight workers
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.xdist_group("gpu-memory-a")]
TOL = 3e-4
VOCAB = 151936


def _hf_float64(art):
    """transformers' model for the artifact's config with its very weights, in float64 on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(art.config.arch, **hf_config_kwargs(art.config)),
                                             dtype=torch.float64)
    sd = hf_state_dict(art.config, {k: v.double() for k, v in art.load_weights("cpu").items()})
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.to("cuda").eval()


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], continuations: list[list[int]], chunk: int = 50) -> list[list[float]]:
    """For each continuation, log p(token | prompt + earlier tokens) of each of its tokens (float64)."""
    out: list[list[float]] = []
    for i in range(0, len(continuations), chunk):
        conts = continuations[i:i + chunk]
        ids = torch.tensor([prompt + c for c in conts], device="cuda")
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, P + T, D]
        n = len(conts[0])
        logits = model.lm_head(hidden[:, len(prompt) - 1:len(prompt) - 1 + n])  # [B, T, V]: only where needed
        logp = torch.log_softmax(logits, dim=-1)
        out += logp.gather(-1, ids[:, len(prompt):, None]).squeeze(-1).tolist()
    return out


@torch.no_grad()
def _hf_last_logprobs(model, ids: list[int], label_ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids], device="cuda")).logits[0, -1]
    return torch.log_softmax(logits, -1)[label_ids].tolist()


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


@pytest.fixture(scope="module", params=["embedded:qwen2.5-0.5b", "embedded:qwen3-0.6b"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    from service.artifact.artifact import build_artifact, load_artifact

    art = load_artifact(build_artifact(request.param, tmp_path_factory.mktemp("f32") / "art", quiet=True))
    return art, _hf_float64(art)


def run_both_runtimes(art, reqs: list, dtype: torch.dtype = torch.float32) -> list:
    """The requests through the Python runtime and the C++ one (CUDA graphs), both on the Triton
    kernels: they launch the same kernels, so their results must be equal; returns them."""
    from service.runtime.cpp_runtime import CppRuntime
    from service.runtime.python_runtime import PythonRuntime

    cpp = CppRuntime(art, device="cuda", dtype=dtype, use_graphs=True, kernels="triton")
    try:
        got = execute(art, PythonRuntime(art, device="cuda", dtype=dtype, kernels="triton"), reqs)
        assert execute(art, cpp, reqs) == got, "the two runtimes launch the same kernels: equal results"
    finally:
        cpp.shutdown()
    return got


def test_float32_triton_path_within_3e4_of_hf_float64(model) -> None:
    art, hf = model
    rng = random.Random(8)
    labels = _ids(rng, 6)
    reqs = [ScoreRequest(tuple(_ids(rng, 64) for _ in range(15)), labels, _ids(rng, 40)),  # W1-like, after a prefix
            ScoreRequest(tuple(_ids(rng, rng.randint(3, 30)) for _ in range(7)), labels),
            BeamRequest(_ids(rng, 100), 400, 5),  # W5's width
            BeamRequest(_ids(rng, 128), 100, 5),  # W2
            BeamRequest(_ids(rng, 17), 4, 3)]
    got = run_both_runtimes(art, reqs)
    worst = 0.0
    for req, res in zip(reqs, got):
        if isinstance(req, ScoreRequest):
            assert isinstance(res, ScoreResult), res
            prefix = list(req.prefix_ids)
            for sample, row in zip(req.samples, res.scores):
                want = _hf_last_logprobs(hf, prefix + list(sample), list(req.label_ids))
                worst = max(worst, max(abs(a - b) for a, b in zip(row, want)))
        else:
            assert isinstance(res, BeamResult) and len(res.beams) == req.beam_width, res
            hf_steps = _hf_logprobs(hf, list(req.prompt_ids), [b.ids for b in res.beams])
            for beam, steps in zip(res.beams, hf_steps):
                worst = max(worst, abs(beam.logprob - sum(steps)))
            scores = [b.logprob for b in res.beams]
            assert scores == sorted(scores, reverse=True)
    assert worst <= TOL, worst

