"""hf_state_dict inverts the artifact's weight layout: a checkpoint's own tensors come back under
their transformers names, and a model built from hf_config_kwargs loads them with nothing missing."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from service.model.checkpoint import hf_config_kwargs, hf_state_dict


@pytest.mark.parametrize("name", ["qwen2_tiny", "qwen3_tiny"])
def test_the_checkpoint_comes_back(name: str, request: pytest.FixtureRequest) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = request.getfixturevalue(name)
    art = model.artifact
    original = load_file(str(next(model.ckpt.glob("*.safetensors"))))
    sd = hf_state_dict(art.config, art.load_weights("cpu", torch.float32))
    assert set(sd) == set(original) - ({"lm_head.weight"} if art.config.tie_word_embeddings else set())
    for key, tensor in sd.items():
        assert torch.equal(tensor, original[key].float()), key
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(art.config.arch, **hf_config_kwargs(art.config)))
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
