"""The bucket table: the bounded static shapes a batch of whole requests is padded to.

Every batch runs in the smallest bucket that holds it; the C++ runtime captures one CUDA graph
per bucket. Padding is masked and never changes a result.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..model.config import ConfigError, ServingLimits


@dataclass(frozen=True, order=True)
class ScoreBucket:
    """max_requests blocks of request_tokens (= max_tokens / max_requests) rows each: request i of
    a batch fills block i (its prefix, then its samples), padded to the block's end. Attention is
    computed block by block, so a batch costs R x L^2, not (R x L)^2."""

    max_tokens: int  # rows: max_requests x request_tokens
    max_samples: int  # samples of all requests, i.e. LM-head rows
    max_requests: int = 1

    def __post_init__(self) -> None:
        if self.max_tokens <= 0 or self.max_samples <= 0 or self.max_requests <= 0:
            raise ConfigError(f"score bucket {self}: sizes must be > 0")
        if self.max_tokens % self.max_requests:
            raise ConfigError(f"score bucket {self}: max_tokens must be a multiple of max_requests")

    @property
    def request_tokens(self) -> int:
        return self.max_tokens // self.max_requests

    @property
    def key(self) -> str:
        return f"score.r{self.max_requests}.l{self.request_tokens}.s{self.max_samples}"

    def holds(self, num_requests: int, longest_request: int, num_samples: int) -> bool:
        return (num_requests <= self.max_requests and longest_request <= self.request_tokens
                and num_samples <= self.max_samples)


@dataclass(frozen=True, order=True)
class BeamBucket:
    new_tokens: int  # exact: every request of the batch generates this many tokens
    max_requests: int
    max_prompt_tokens: int  # packed prompts of all requests
    beam_width: int  # upper bound; a narrower request masks its extra beams

    def __post_init__(self) -> None:
        if min(self.new_tokens, self.max_requests, self.max_prompt_tokens, self.beam_width) <= 0:
            raise ConfigError(f"beam bucket {self}: sizes must be > 0")

    @property
    def key(self) -> str:
        return (f"beam.n{self.new_tokens}.r{self.max_requests}"
                f".p{self.max_prompt_tokens}.b{self.beam_width}")


@dataclass(frozen=True)
class BucketTable:
    score: tuple[ScoreBucket, ...]
    beam: tuple[BeamBucket, ...]

    def __post_init__(self) -> None:
        if not self.score or not self.beam:
            raise ConfigError("bucket table: needs at least one score and one beam bucket")

    def to_dict(self) -> dict[str, Any]:
        return {"score": [dataclasses.asdict(b) for b in self.score],
                "beam": [dataclasses.asdict(b) for b in self.beam]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BucketTable":
        return cls(score=tuple(sorted(ScoreBucket(**b) for b in d["score"])),
                   beam=tuple(sorted(BeamBucket(**b) for b in d["beam"])))

    def fits_one(self, limits: ServingLimits) -> None:
        """Every request within the limits must fit some bucket on its own."""
        if not any(b.holds(1, limits.max_score_tokens, limits.max_samples) for b in self.score):
            raise ConfigError(f"bucket table: no score bucket holds one request of the limits "
                              f"({limits.max_score_tokens} tokens, {limits.max_samples} samples)")
        for n in range(1, limits.max_new_tokens + 1):
            ok = [b for b in self.beam if b.new_tokens == n and b.beam_width >= limits.max_beam_width
                  and b.max_prompt_tokens >= limits.max_prompt_tokens]
            if not ok:
                raise ConfigError(f"bucket table: no beam bucket holds a request with new_tokens={n}, "
                                  f"beam_width={limits.max_beam_width}, {limits.max_prompt_tokens} prompt tokens")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return out + [hi]


def default_bucket_table(limits: ServingLimits, max_batch_tokens: int = 8192,
                         max_beam_rows: int = 1600, prompt_tiers: tuple[int, ...] = (128, 512)) -> BucketTable:
    """Powers-of-two tiers (padding waste < 2x) up to the limits.

    max_batch_tokens bounds a Score batch (requests x a per-request token tier; 1, 2, 4 or 8
    requests of up to 64, 128, ... max_score_tokens tokens each); max_beam_rows bounds
    requests x beam_width of a BeamSearch batch; a BeamSearch bucket holds requests x a prompt
    tier (prompt_tiers below the limit, and the limit) packed prompt tokens, so a short prompt is
    not padded to the longest one.
    """
    max_batch_tokens = max(max_batch_tokens, limits.max_score_tokens)
    score = [ScoreBucket(r * t, r * limits.max_samples, r)
             for t in _powers_of_two(min(64, limits.max_score_tokens), limits.max_score_tokens)
             for r in (1, 2, 4, 8) if r == 1 or r * t <= max_batch_tokens]
    widths = sorted({w for w in (1, 4, 16, 64, 128, 256) if w < limits.max_beam_width}
                    | {limits.max_beam_width})
    prompts = sorted({p for p in prompt_tiers if p < limits.max_prompt_tokens} | {limits.max_prompt_tokens})
    beam = []
    for n in range(1, limits.max_new_tokens + 1):
        for w in widths:
            r = 1
            while r * w <= max(max_beam_rows, w):
                beam.extend(BeamBucket(n, r, r * p, w) for p in prompts)
                r *= 2
                if r > 8:
                    break
    table = BucketTable(tuple(sorted(score)), tuple(sorted(beam)))
    table.fits_one(limits)
    return table
