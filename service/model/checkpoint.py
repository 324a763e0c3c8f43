"""Reading weights: local Hugging Face checkpoints and embedded specs, into the artifact layout.

Artifact layout (fused where one GEMM serves several HF projections):
  embed [V, D]; final_norm [D]; lm_head [V, D] (untied only); cls_head [labels, D] (classifier only)
  layers.{i}.attn_norm [D], .wqkv [(H+2G)E, D], .bqkv (qwen2), .q_norm/.k_norm [E] (qwen3),
  layers.{i}.wo [D, HE], .mlp_norm [D], .wgu [2F, D] (gate rows first), .wdown [D, F]
With FP8 linear layers (`slmrank build --fp8`, kernels/fp8_linear.py) the chosen GEMM weights are
float8_e4m3fn, each with NAME.scale [rows] float32 (per output channel); an fp8 head of tied
embeddings is its own lm_head (embed stays in the model dtype for the lookup). A part given a row
floor (`--fp8 mlp:2048`) also keeps each weight in the model dtype, NAME.full, with NAME.min_rows
(int64 [1]): a GEMM of fewer activation rows runs on NAME.full (fp8_min_rows, layers.gemm_weight).
Nothing is ever downloaded and nothing is unpickled: safetensors only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig
from .files import check_safetensors, read_json
from .fp8_policy import FP8_PARTS  # noqa: F401  (re-exported: which linear layers `--fp8` makes e4m3)


def fp8_weight_names(cfg: ModelConfig, fp8: tuple[str, ...] | list[str] = ()) -> list[str]:
    """The weights stored as float8_e4m3fn under the fp8 policy (parts of FP8_PARTS); each has NAME.scale."""
    names = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        names += [p + "wqkv", p + "wo"] if "attn" in fp8 else []
        names += [p + "wgu", p + "wdown"] if "mlp" in fp8 else []
    if "head" in fp8:
        names.append("cls_head" if cfg.has_cls_head else "lm_head")
    return names


FULL, MIN_ROWS = ".full", ".min_rows"  # an e4m3 weight's model-dtype copy and its row floor (int64 [1])


def weight_floors(cfg: ModelConfig, floors: dict[str, int]) -> dict[str, int]:
    """A policy's part -> row floor (`--fp8 mlp:2048`) as each of its e4m3 weights' floor: what a
    build stores as NAME.min_rows, and fp8_min_rows reads back."""
    return {name: rows for part, rows in floors.items() for name in fp8_weight_names(cfg, (part,))}


def fp8_min_rows(weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each e4m3 weight with a row floor -> the floor (NAME.min_rows): a GEMM of fewer activation
    rows runs on NAME.full instead. Read once, on the host, when a runtime is made."""
    return {name[:-len(MIN_ROWS)]: int(t.reshape(-1)[0]) for name, t in weights.items() if name.endswith(MIN_ROWS)}


def expected_shapes(cfg: ModelConfig, fp8: tuple[str, ...] | list[str] = ()) -> dict[str, tuple[int, ...]]:
    d, e, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, d), "final_norm": (d,)}
    if cfg.has_cls_head:
        shapes["cls_head"] = (cfg.num_labels, d)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    qkv = cfg.q_size + 2 * cfg.kv_size
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm"] = (d,)
        shapes[p + "wqkv"] = (qkv, d)
        if cfg.attention_bias:
            shapes[p + "bqkv"] = (qkv,)
        if cfg.qk_norm:
            shapes[p + "q_norm"] = (e,)
            shapes[p + "k_norm"] = (e,)
        shapes[p + "wo"] = (d, cfg.q_size)
        shapes[p + "mlp_norm"] = (d,)
        shapes[p + "wgu"] = (2 * f, d)
        shapes[p + "wdown"] = (d, f)
    for name in fp8_weight_names(cfg, fp8):
        if name == "lm_head":  # an fp8 head of tied embeddings: its own table
            shapes[name] = (cfg.vocab_size, d)
        shapes[name + ".scale"] = shapes[name][:1]
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], fp8: tuple[str, ...] | list[str] = ()) -> None:
    """Names and shapes as the config (and the fp8 policy) want; the fp8 policy's weights float8_e4m3fn
    with float32 scales, and no other weight fp8."""
    want = expected_shapes(cfg, fp8)
    quantized = fp8_weight_names(cfg, fp8)
    for name in quantized:  # a row floor's pair, both or neither (cpp_dag/artifact_loader.cpp::check_weights)
        if name + FULL in weights or name + MIN_ROWS in weights:
            want[name + FULL], want[name + MIN_ROWS] = want[name], (1,)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing or extra:
        raise ConfigError(f"weights do not match the model config: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, shape in want.items():
        if tuple(weights[name].shape) != shape:
            raise ConfigError(f"weight {name}: shape {tuple(weights[name].shape)} != expected {shape}")
    for name, t in weights.items():
        is_fp8 = t.dtype == torch.float8_e4m3fn
        if is_fp8 != (name in quantized):
            raise ConfigError(f"weight {name}: dtype {t.dtype} does not match the fp8 policy {list(fp8) or 'none'}")
        if name.endswith(".scale") and t.dtype != torch.float32:
            raise ConfigError(f"weight {name}: an fp8 scale must be float32, got {t.dtype}")
        if name.endswith(MIN_ROWS) and (t.dtype != torch.int64 or int(t[0]) < 1):
            raise ConfigError(f"weight {name}: a row floor must be one int64 >= 1, got {t.dtype} {t.tolist()}")


# ---- Hugging Face checkpoints ---------------------------------------------------------------

class _HFTensors:
    """Lazy access to the tensors of one or several (sharded) safetensors files."""

    def __init__(self, ckpt: Path) -> None:
        index = ckpt / "model.safetensors.index.json"
        if index.exists():
            index_json = read_json(index)
            weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) and Path(v).name == v for k, v in weight_map.items()):
                raise ConfigError(f"{index}: weight_map must map tensor names to file names in {ckpt}")
            self.files = {name: ckpt / fname for name, fname in weight_map.items()}
            for path in set(self.files.values()):
                check_safetensors(path)
        else:
            files = sorted(ckpt.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{ckpt}: no *.safetensors weights (and pickled weights are never loaded)")
            self.files = {}
            for path in files:
                check_safetensors(path)  # a pickle named model.safetensors: one clear error
                with _opened(path) as fh:
                    for name in fh.keys():
                        self.files[name] = path

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise ConfigError(f"checkpoint: tensor {name!r} not found")
        with _opened(self.files[name]) as fh:
            try:
                return fh.get_tensor(name)
            except Exception as e:  # noqa: BLE001 -- SafetensorError and friends: a corrupted file
                raise ConfigError(f"{self.files[name]}: tensor {name!r} cannot be read ({e})") from None


class _opened:
    """safe_open, its errors (a file the safetensors library refuses) as ConfigError naming the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        try:
            self.fh = safe_open(str(self.path), framework="pt")
            return self.fh.__enter__()
        except Exception as e:  # noqa: BLE001 -- SafetensorError is no ValueError
            raise ConfigError(f"{self.path}: not a readable safetensors file ({e})") from None

    def __exit__(self, *exc) -> None:
        self.fh.__exit__(*exc)


def load_hf_config(ckpt: Path) -> ModelConfig:
    path = ckpt / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{ckpt}: no config.json (expected a Hugging Face checkpoint directory)")
    hf = read_json(path)  # a regular file, of a config's size: a link to /dev/zero is refused unread
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: not a JSON object")
    try:
        return ModelConfig.from_hf(hf)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path}: missing or malformed key ({type(e).__name__}: {e})") from None


def iter_hf_weights(ckpt: Path, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields artifact-layout tensors, one at a time (bounded host memory)."""
    src = _HFTensors(ckpt)
    base = "model." if src.has("model.embed_tokens.weight") else ""
    yield "embed", src.get(base + "embed_tokens.weight")
    yield "final_norm", src.get(base + "norm.weight")
    if cfg.has_cls_head:
        yield "cls_head", src.get("score.weight")
    elif not cfg.tie_word_embeddings:
        yield "lm_head", src.get("lm_head.weight")
    for i in range(cfg.num_layers):
        p, a = f"{base}layers.{i}.", f"layers.{i}."
        at = p + "self_attn."
        yield a + "attn_norm", src.get(p + "input_layernorm.weight")
        yield a + "wqkv", torch.cat([src.get(at + f"{x}_proj.weight") for x in "qkv"])
        if cfg.attention_bias:
            yield a + "bqkv", torch.cat([src.get(at + f"{x}_proj.bias") for x in "qkv"])
        if cfg.qk_norm:
            yield a + "q_norm", src.get(at + "q_norm.weight")
            yield a + "k_norm", src.get(at + "k_norm.weight")
        yield a + "wo", src.get(at + "o_proj.weight")
        yield a + "mlp_norm", src.get(p + "post_attention_layernorm.weight")
        mlp = p + "mlp."
        yield a + "wgu", torch.cat([src.get(mlp + "gate_proj.weight"), src.get(mlp + "up_proj.weight")])
        yield a + "wdown", src.get(mlp + "down_proj.weight")


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, object]:
    """transformers' config of this model: `AutoConfig.for_model(cfg.arch, **hf_config_kwargs(cfg))`."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                intermediate_size=cfg.intermediate_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=cfg.max_positions, tie_word_embeddings=cfg.tie_word_embeddings)


def hf_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Artifact-layout weights back under a transformers causal LM's names (iter_hf_weights, inverted):
    how the benchmarks' peer and the accuracy tests run Hugging Face on the very same weights."""
    sd = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["final_norm"]}
    if "lm_head" in weights:
        sd["lm_head.weight"] = weights["lm_head"]
    q, kv = cfg.q_size, cfg.kv_size
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        for name, t in zip(("q_proj", "k_proj", "v_proj"), weights[a + "wqkv"].split([q, kv, kv])):
            sd[p + f"self_attn.{name}.weight"] = t
        if cfg.attention_bias:
            for name, t in zip(("q_proj", "k_proj", "v_proj"), weights[a + "bqkv"].split([q, kv, kv])):
                sd[p + f"self_attn.{name}.bias"] = t
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = weights[a + "q_norm"], weights[a + "k_norm"]
        gate, up = weights[a + "wgu"].chunk(2)
        sd.update({p + "self_attn.o_proj.weight": weights[a + "wo"], p + "input_layernorm.weight": weights[a + "attn_norm"],
                   p + "post_attention_layernorm.weight": weights[a + "mlp_norm"], p + "mlp.gate_proj.weight": gate,
                   p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": weights[a + "wdown"]})
    return sd


# ---- Embedded specs: real shapes, deterministic random weights -------------------------------

@dataclass(frozen=True)
class EmbeddedSpec:
    name: str
    config: ModelConfig
    dtype: torch.dtype
    init_std: float = 0.02
    seed: int = 20261129


def _qwen(arch: str, d: int, layers: int, heads: int, kv: int, e: int, f: int, max_pos: int) -> ModelConfig:
    return ModelConfig(arch=arch, vocab_size=151936, hidden_size=d, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=e, intermediate_size=f, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, max_positions=max_pos, tie_word_embeddings=True,
                       attention_bias=arch == "qwen2")


EMBEDDED: dict[str, EmbeddedSpec] = {
    # tiny: the same code path at CPU/CI size; larger init so its distributions are not flat.
    "tiny": EmbeddedSpec("tiny", _qwen("qwen2", 128, 2, 4, 2, 32, 384, 4096), torch.float32, init_std=0.08),
    "qwen2.5-0.5b": EmbeddedSpec("qwen2.5-0.5b", _qwen("qwen2", 896, 24, 14, 2, 64, 4864, 32768), torch.bfloat16),
    "qwen3-0.6b": EmbeddedSpec("qwen3-0.6b", _qwen("qwen3", 1024, 28, 16, 8, 128, 3072, 40960), torch.bfloat16),
    "qwen3-1.7b": EmbeddedSpec("qwen3-1.7b", _qwen("qwen3", 2048, 28, 16, 8, 128, 6144, 40960), torch.bfloat16),
}


def embedded_spec(spec: str) -> EmbeddedSpec:
    name = spec.removeprefix("embedded:")
    if name not in EMBEDDED:
        raise ValueError(f"model: unknown embedded spec {spec!r}; known: "
                         + ", ".join(f"embedded:{n}" for n in EMBEDDED))
    return EMBEDDED[name]


def _seed_for(seed: int, name: str) -> int:
    # Per-tensor seeds: each tensor is reproducible on its own, whatever the generation order.
    return (seed ^ int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")) & ((1 << 63) - 1)


def iter_embedded_weights(spec: EmbeddedSpec) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in expected_shapes(spec.config).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
            t = torch.ones(shape)
        else:
            g = torch.Generator().manual_seed(_seed_for(spec.seed, name))
            std = spec.init_std * (0.5 if leaf == "bqkv" else 1.0)
            t = torch.randn(shape, generator=g) * std
        yield name, t.to(spec.dtype)


def weight_source(model: str) -> tuple[ModelConfig, torch.dtype | None, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Resolves a model spec: 'embedded:NAME' or a local HF checkpoint directory.

    Returns the config, the source dtype (None: keep each tensor's own) and a weight iterator.
    """
    if model.startswith("embedded:"):
        spec = embedded_spec(model)
        return spec.config, spec.dtype, lambda: iter_embedded_weights(spec)
    ckpt = Path(model)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"model: {model!r} is neither an embedded spec (embedded:NAME) "
                                "nor a local checkpoint directory")
    cfg = load_hf_config(ckpt)
    return cfg, None, lambda: iter_hf_weights(ckpt, cfg)
