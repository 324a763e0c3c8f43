"""Model configuration (Qwen2 / Qwen3 decoder families) and serving limits.

One frozen dataclass per concern, validated on construction and passed explicitly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS = ("qwen2", "qwen3")


class ConfigError(ValueError):
    """A model configuration that slmrank cannot serve."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "qwen2" (q/k/v bias) or "qwen3" (q/k RMSNorm, no bias)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_labels: int = 0  # > 0: a sequence-classification head ("score") replaces the LM head

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"arch: {self.arch!r} is not one of {SUPPORTED_ARCHS}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.num_labels < 0:
            raise ConfigError(f"num_labels: must be >= 0, got {self.num_labels}")

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def has_cls_head(self) -> bool:
        return self.num_labels > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"model config: unknown keys {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Reads a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"config.json: model_type {arch!r} is not one of {SUPPORTED_ARCHS}")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in ("default", None):
            raise ConfigError(f"config.json: rope type {rope_type!r} is not supported (only default RoPE)")
        if hf.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"config.json: hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        archs = hf.get("architectures") or []
        is_cls = any(a.endswith("ForSequenceClassification") for a in archs)
        num_labels = 0
        if is_cls:
            num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_positions=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(hf.get("attention_bias", False)),
            num_labels=num_labels,
        )


@dataclass(frozen=True)
class ServingLimits:
    """Per-request maxima; a request over any of them is refused naming the field."""

    max_prompt_tokens: int = 1024  # BeamSearch prompt (W6: 1,000 tokens)
    max_beam_width: int = 400
    max_new_tokens: int = 5
    max_samples: int = 64  # Score samples per request
    max_score_tokens: int = 2048  # Score: prefix + all samples
    max_labels: int = 16  # label ids per Score request

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ConfigError(f"limits.{f.name}: must be > 0, got {getattr(self, f.name)}")

    def check_positions(self, model: ModelConfig) -> None:
        if self.max_beam_width > model.vocab_size:
            raise ConfigError(f"limits.max_beam_width {self.max_beam_width} exceeds the vocabulary size "
                              f"{model.vocab_size} (a beam step keeps at most one beam per token)")
        if self.max_prompt_tokens + self.max_new_tokens > model.max_positions:
            raise ConfigError(
                f"limits: max_prompt_tokens + max_new_tokens ({self.max_prompt_tokens}"
                f" + {self.max_new_tokens}) exceeds the model's max_positions {model.max_positions}")
        if self.max_score_tokens > model.max_positions:
            raise ConfigError(f"limits.max_score_tokens {self.max_score_tokens} exceeds the "
                              f"model's max_positions {model.max_positions}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def for_model(cls, model: ModelConfig, **overrides: int) -> "ServingLimits":
        """The defaults, shrunk where the model has fewer positions."""
        d = cls()
        max_new = overrides.get("max_new_tokens", d.max_new_tokens)
        fit = {"max_prompt_tokens": min(d.max_prompt_tokens, model.max_positions - max_new),
               "max_score_tokens": min(d.max_score_tokens, model.max_positions),
               "max_beam_width": min(d.max_beam_width, model.vocab_size)}
        limits = cls(**{**fit, **overrides})
        limits.check_positions(model)
        return limits

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServingLimits":
        return cls(**d)
