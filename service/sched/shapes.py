"""A request's shape, as admission prices it: computed from a parsed message (at a front, before
decoding: `message_dims`) and from an engine request (`request_dims`) alike, so that both sides
key a shape's service time the same way. Imports no torch: the front processes use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A text of n characters is at least n / (TEXT_SLACK x max_token_bytes) tokens: a character is at
# least one UTF-8 byte, and normalization (NFC) shrinks a text to no fewer than 1/1.5 of its
# characters' bytes (u + two marks -> one 2-byte character); 2 leaves room for other normalizers.
TEXT_SLACK = 2

def shape_key(dims: tuple) -> int:
    """A request shape's key: tuples of ints hash the same in every process of one Python."""
    return hash(dims)


def message_dims(kind: str, msg: Any, limits: Any, max_token_bytes: int) -> tuple | None:
    """The dimensions of the smallest request the message can become (ids segments at their
    length, a text at the fewest tokens it can become): ("beam", prompt, beam_width, new_tokens)
    or ("score", prefix, (sample lengths...)); None when the message is outside the limits
    (decoding names the field). `limits` has the ServingLimits fields."""
    def fewest(seg: Any) -> int:
        if seg.text:
            return -(-len(seg.text) // (TEXT_SLACK * max_token_bytes))
        return len(seg.ids)

    if kind == "beam":
        if not msg.HasField("prompt") or not (1 <= msg.beam_width <= limits.max_beam_width) \
                or not (1 <= msg.new_tokens <= limits.max_new_tokens):
            return None
        n = fewest(msg.prompt)
        if not 1 <= n <= limits.max_prompt_tokens:
            return None
        return (1, n, msg.beam_width, msg.new_tokens)
    if not 1 <= len(msg.samples) <= limits.max_samples:
        return None
    samples = tuple(max(fewest(s), 1) for s in msg.samples)
    prefix = fewest(msg.prefix) if msg.HasField("prefix") else 0
    if prefix + sum(samples) > limits.max_score_tokens:
        return None
    return (0, prefix, samples)


def request_dims(request: Any) -> tuple:
    """message_dims of an engine request (ScoreRequest / BeamRequest, by duck typing)."""
    if hasattr(request, "prompt_ids"):
        return (1, len(request.prompt_ids), request.beam_width, request.new_tokens)
    return (0, len(request.prefix_ids), tuple(len(s) for s in request.samples))


@dataclass(frozen=True)
class Limits:
    max_samples: int
    max_score_tokens: int
    max_beam_width: int
    max_new_tokens: int
    max_prompt_tokens: int


__all__ = ["TEXT_SLACK", "Limits", "message_dims", "request_dims", "shape_key"]
