"""Logical matrix FLOPs of a request (docs/benchmarks.md's effective-MFU numerator).

Counted: linear layers, LM head (only at positions whose logits are used; over a catalog's code
tokens only for a request normalised over them) and attention
(each query token against the keys it may see, itself included); FMA = 2 FLOPs. No padding,
no recomputed prefix.
"""

from __future__ import annotations

from .config import ModelConfig


def _linear_per_token(c: ModelConfig) -> int:
    d, h, g, e, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    return 2 * c.num_layers * (d * h * e + 2 * d * g * e + h * e * d + 3 * d * f)


def _attention(c: ModelConfig, visible_keys: int) -> int:
    return 2 * 2 * c.num_layers * c.num_heads * c.head_dim * visible_keys


def _head(c: ModelConfig, positions: int, width: int | None = None) -> int:
    width = width if width is not None else c.num_labels if c.has_cls_head else c.vocab_size
    return 2 * c.hidden_size * width * positions


def _causal(c: ModelConfig, start: int, length: int) -> int:
    # tokens at positions start..start+length-1, each seeing every earlier key and itself
    return _attention(c, sum(start + i + 1 for i in range(length)))


def score_flops(c: ModelConfig, prefix_len: int, sample_lens: list[int]) -> int:
    tokens = prefix_len + sum(sample_lens)
    attn = _causal(c, 0, prefix_len) + sum(_causal(c, prefix_len, n) for n in sample_lens)
    return tokens * _linear_per_token(c) + attn + _head(c, len(sample_lens))


def beam_flops(c: ModelConfig, prompt_len: int, beam_width: int, new_tokens: int, head_width: int | None = None) -> int:
    """head_width: the LM head's outputs when not the vocabulary (a request normalised over its
    catalog's code tokens: their number)."""
    head = _head(c, 1, head_width)
    total = prompt_len * _linear_per_token(c) + _causal(c, 0, prompt_len) + head
    for t in range(1, new_tokens):  # decode step t: one token per beam, seeing the prompt and t suffix keys
        total += beam_width * (_linear_per_token(c) + _attention(c, prompt_len + t) + head)
    return total


def linear_flops_per_token(c: ModelConfig) -> int:
    """One token row through every layer's linear maps (q, k, v, o, gate, up, down)."""
    return _linear_per_token(c)


def head_flops(c: ModelConfig) -> int:
    """One LM-head row (a classification head's: its labels)."""
    return _head(c, 1)
