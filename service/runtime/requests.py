"""Request types and their validation.

A request is checked field by field before any work; a bad one raises RequestError naming the
field and the limit, and nothing else is disturbed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from ..model.config import ModelConfig, ServingLimits


class RequestError(ValueError):
    """A request that breaks the API contract. str(e) names the field and the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ExecutionError(RuntimeError):
    """A valid request whose batch failed in the runtime; the other batches are unaffected."""


@dataclass(frozen=True)
class ScoreRequest:
    samples: tuple[tuple[int, ...], ...]
    label_ids: tuple[int, ...] = ()
    prefix_ids: tuple[int, ...] = ()
    id: str | None = None

    @cached_property  # asked for a request many times on the event loop (admission, batching, packing)
    def num_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.samples))

    @property
    def num_samples(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class BeamRequest:
    prompt_ids: tuple[int, ...]
    beam_width: int
    new_tokens: int
    id: str | None = None
    catalog: str = ""  # a catalog's name: only its items come back (each beam with its item_id); "": any tokens
    # with a catalog: "vocab", the log-probs normalised over the whole vocabulary (Hugging Face's), or
    # "codes", over the catalog's code tokens only (a code-vocabulary LM head: NORMALIZATIONS)
    normalization: str = "vocab"


NORMALIZATIONS = ("vocab", "codes")


@dataclass(frozen=True)
class ScoreResult:
    scores: list[list[float]]  # per sample: one log-prob per label id (or the head's outputs)


class Beam(NamedTuple):
    """One beam: a NamedTuple, not a dataclass: a batch unpacks thousands of them on the event loop
    (8 W2 requests: 800), and a tuple is built ~10x faster than a frozen dataclass."""

    ids: list[int]
    logprob: float
    item_id: str | None = None  # the catalog item these ids are (a request with a catalog)


class BeamResult:
    """A request's beams, best first. From a runtime, it holds the output rows they were read from
    (ids [w, n] int64, log-probs [w] float32, on the CPU, owned by this result): an encoder can
    write the response straight from them (the gRPC codec's BeamWire), and `beams` becomes Python
    objects only when first asked for (a W5 request has 400 beams, unpacked on the event loop).
    Equal when the beams are; the rows are no part of the value. item_ids: each row's catalog item
    (a request with a catalog), else None; catalog_version: the version of the catalog they are
    items of (Catalog.version: a server may have replaced the artifact's), else None."""

    __slots__ = ("_beams", "rows", "item_ids", "catalog_version")

    def __init__(self, beams: list[Beam] | None = None, rows: tuple[Any, Any] | None = None,
                 item_ids: list[str] | None = None, catalog_version: str | None = None) -> None:
        if beams is None and rows is None:
            raise ValueError("BeamResult: needs its beams or its output rows")
        self._beams, self.rows, self.item_ids = beams, rows, item_ids
        self.catalog_version = catalog_version

    @property
    def beams(self) -> list[Beam]:
        if self._beams is None:
            seqs, scores = self.rows  # type: ignore[misc]
            if self.item_ids is None:
                self._beams = list(map(Beam, seqs.tolist(), scores.tolist()))
            else:
                self._beams = list(map(Beam, seqs.tolist(), scores.tolist(), self.item_ids))
        return self._beams

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BeamResult) and self.beams == other.beams

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BeamResult(beams={self.beams!r})"


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    # the common case in C-level passes (a W1 request has ~1,000 ids, checked on the event loop);
    # anything else takes the element-wise loop below, which names the first bad id
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        return
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{field}[{i}]", f"must be an integer token id, got {t!r}")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")


def _no_check(field: str, ids: Sequence[int], vocab_size: int) -> None:
    pass


def _check_int(field: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(field, f"must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise RequestError(field, f"{value} is outside the allowed range [{lo}, {hi}]")
    return value


def validate_score(req: ScoreRequest, model: ModelConfig, limits: ServingLimits, ids_checked: bool = False) -> None:
    """ids_checked: every id is already known to be an int in the vocabulary (the gRPC codec checks
    them as it reads them), so the range checks are not done twice on the event loop."""
    check_ids = _no_check if ids_checked else _check_ids
    if not req.samples:
        raise RequestError("samples", "at least one sample is required")
    if len(req.samples) > limits.max_samples:
        raise RequestError("samples", f"{len(req.samples)} samples exceed the maximum of {limits.max_samples}")
    check_ids("prefix_ids", req.prefix_ids, model.vocab_size)
    for i, s in enumerate(req.samples):
        if not s:
            raise RequestError(f"samples[{i}]", "empty sample (each sample needs at least 1 token)")
        check_ids(f"samples[{i}]", s, model.vocab_size)
    if req.num_tokens > limits.max_score_tokens:
        raise RequestError("samples", f"{req.num_tokens} tokens (prefix + samples) exceed the maximum "
                                      f"of {limits.max_score_tokens}")
    if model.has_cls_head:
        if req.label_ids:
            raise RequestError("label_ids", "must be empty: this model has a classification head "
                                            f"and returns its {model.num_labels} outputs per sample")
        return
    if not req.label_ids:
        raise RequestError("label_ids", "at least one label id is required")
    if len(req.label_ids) > limits.max_labels:
        raise RequestError("label_ids", f"{len(req.label_ids)} label ids exceed the maximum of {limits.max_labels}")
    check_ids("label_ids", req.label_ids, model.vocab_size)


def label_ids_of_texts(texts: Sequence[str], encode: Callable[[str], Sequence[int]], model: ModelConfig,
                       limits: ServingLimits, max_chars: int | None = None, field: str = "label_texts") -> tuple[int, ...]:
    """Score labels given as texts -> their ids: each text must be exactly one token of the
    artifact's tokenizer (`encode`), or the request is refused naming `label_texts[i]` and how many
    tokens it made. max_chars: longer texts are refused before they are tokenized (no one token
    is that long: the gRPC codec's bound, so that a label cannot hold the event loop)."""
    if model.has_cls_head:
        raise RequestError(field, "must be empty: this model has a classification head "
                                  f"and returns its {model.num_labels} outputs per sample")
    if len(texts) > limits.max_labels:
        raise RequestError(field, f"{len(texts)} labels exceed the maximum of {limits.max_labels}")
    ids: list[int] = []
    for i, text in enumerate(texts):
        if max_chars is not None and len(text) > max_chars:
            raise RequestError(f"{field}[{i}]", f"{len(text)} characters cannot be one token (at most {max_chars}): "
                                                "a label must be exactly one token")
        got = list(encode(text))
        if len(got) != 1:
            raise RequestError(f"{field}[{i}]", f"{text!r} makes {len(got)} tokens with the artifact's tokenizer; "
                                                "a label must be exactly one token (Tokenize shows the tokens)")
        if not 0 <= got[0] < model.vocab_size:  # a checkpoint whose vocabulary is smaller than its tokenizer's
            raise RequestError(f"{field}[{i}]", f"{text!r} is token {got[0]}, outside the model's vocabulary "
                                                f"[0, {model.vocab_size})")
        ids.append(got[0])
    return tuple(ids)


def validate_beam(req: BeamRequest, model: ModelConfig, limits: ServingLimits, ids_checked: bool = False,
                  catalogs: Mapping[str, int] | None = None) -> None:
    """catalogs: the artifact's catalog names -> their code length (a request's new_tokens must equal it)."""
    if model.has_cls_head:
        raise RequestError("kind", "this model has a classification head: only Score is served")
    if not req.prompt_ids:
        raise RequestError("prompt_ids", "empty prompt (at least 1 token is required)")
    if len(req.prompt_ids) > limits.max_prompt_tokens:
        raise RequestError("prompt_ids", f"{len(req.prompt_ids)} tokens exceed the maximum prompt "
                                         f"length of {limits.max_prompt_tokens}")
    if not ids_checked:
        _check_ids("prompt_ids", req.prompt_ids, model.vocab_size)
    _check_int("beam_width", req.beam_width, 1, limits.max_beam_width)
    _check_int("new_tokens", req.new_tokens, 1, limits.max_new_tokens)
    if req.catalog:
        if not isinstance(req.catalog, str) or req.catalog not in (catalogs or {}):
            known = ", ".join(sorted(catalogs or {})) or "none"
            raise RequestError("catalog", f"{req.catalog!r} is not a catalog of this model (catalogs: {known})")
        if req.new_tokens != catalogs[req.catalog]:  # type: ignore[index]
            raise RequestError("new_tokens", f"{req.new_tokens} does not match catalog {req.catalog!r}, whose "
                                             f"items are {catalogs[req.catalog]} tokens long")  # type: ignore[index]
    if req.normalization not in NORMALIZATIONS:
        raise RequestError("normalization", f"{req.normalization!r} is not one of {', '.join(NORMALIZATIONS)}")
    if req.normalization == "codes" and not req.catalog:
        raise RequestError("normalization", "'codes' normalises over a catalog's code tokens: the request names "
                                            "no catalog")


class BindError(OSError):
    """The server cannot listen on its address (e.g. the port is taken)."""
