"""The `slmrank run` line format: one JSON request per line in, one JSON result per line out.

  in:  {"id": "a", "kind": "score", "prefix_ids": [..] (optional), "samples": [[..], ..], "label_ids": [..]}
       ("label_texts": [" yes", " no"] instead of "label_ids": texts of one token each)
  out: {"id": "a", "scores": [[logprob per label id], ..]}
  in:  {"id": "b", "kind": "beam", "prompt_ids": [..], "beam_width": B, "new_tokens": T}
       ("catalog": "NAME": only that catalog's items; new_tokens = its code length; "normalization":
       "vocab" (default) or "codes": log-probs over the catalog's code tokens only)
  out: {"id": "b", "beams": [{"ids": [T ids], "logprob": cumulative}, ..]}   (best first;
       with a catalog each beam also has "item_id", and fewer beams come back if fewer items exist)
  a bad line: {"id": .., "error": "<field>: <what is wrong, with the limit>"}

Floats are written with Python's shortest round-trip repr, so two runtimes' files compare byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from .requests import (Beam, BeamRequest, BeamResult, ExecutionError, RequestError, ScoreRequest, ScoreResult,
                       label_ids_of_texts)

KINDS = ("score", "beam")


def _id_list(value: Any, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RequestError(field, f"must be a list of token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{field}[{i}]", f"must be an integer token id, got {t!r}")
    return tuple(value)


def _optional_ids(obj: dict[str, Any], field: str) -> tuple[int, ...]:
    return _id_list(obj[field], field) if field in obj else ()


def _label_ids(obj: dict[str, Any], labels_of: Callable[[Sequence[str]], tuple[int, ...]] | None) -> tuple[int, ...]:
    if "label_texts" not in obj:
        return _optional_ids(obj, "label_ids")
    if "label_ids" in obj:
        raise RequestError("label_texts", "both label_ids and label_texts are set: set exactly one of them")
    texts = obj["label_texts"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise RequestError("label_texts", "must be a list of strings")
    if labels_of is None:
        raise RequestError("label_texts", "cannot be read here: no tokenizer given (use label_ids)")
    return labels_of(texts)


def parse_request(line: str, labels_of: Callable[[Sequence[str]], tuple[int, ...]] | None = None
                  ) -> ScoreRequest | BeamRequest:
    """Raises RequestError; its `request_id` attribute carries the id when one was read.
    labels_of: label texts -> their ids (requests.label_ids_of_texts with the artifact's tokenizer)."""
    rid = None
    try:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError("line", f"invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise RequestError("line", "must be a JSON object")
        rid = obj.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            raise RequestError("id", "must be a string or an integer")
        kind = obj.get("kind")
        if kind == "score":
            samples = obj.get("samples")
            if not isinstance(samples, list):
                raise RequestError("samples", "is required: a list of token-id lists")
            return ScoreRequest(samples=tuple(_id_list(s, f"samples[{i}]") for i, s in enumerate(samples)),
                                label_ids=_label_ids(obj, labels_of),
                                prefix_ids=_optional_ids(obj, "prefix_ids"), id=rid)
        if kind == "beam":
            if "prompt_ids" not in obj:
                raise RequestError("prompt_ids", "is required")
            catalog = obj.get("catalog", "")
            if not isinstance(catalog, str):
                raise RequestError("catalog", "must be a catalog's name (a string)")
            normalization = obj.get("normalization", "vocab")
            if not isinstance(normalization, str):
                raise RequestError("normalization", "must be \"vocab\" or \"codes\" (a string)")
            return BeamRequest(prompt_ids=_id_list(obj["prompt_ids"], "prompt_ids"),
                               beam_width=obj.get("beam_width"), new_tokens=obj.get("new_tokens"),
                               id=rid, catalog=catalog, normalization=normalization)  # type: ignore[arg-type]
            # (validate_beam checks them all)
        raise RequestError("kind", f"{kind!r} is not one of {KINDS}")
    except RequestError as e:
        e.request_id = rid  # type: ignore[attr-defined]
        raise


def artifact_labels(artifact: Any) -> Callable[[Sequence[str]], tuple[int, ...]]:
    """label texts -> their ids with the artifact's own tokenizer, loaded for the first line that has them."""
    tokenizers: list[Any] = []

    def labels_of(texts: Sequence[str]) -> tuple[int, ...]:
        if not tokenizers:
            from ..model.tokenizer import load_tokenizer
            tokenizers.append(load_tokenizer(artifact.tokenizer_dir))
        return label_ids_of_texts(texts, tokenizers[0].encode_cached, artifact.config, artifact.limits)

    return labels_of


def read_request_file(path: str | Path, labels_of: Callable[[Sequence[str]], tuple[int, ...]] | None = None
                      ) -> list[tuple[Any, ScoreRequest | BeamRequest | RequestError]]:
    """Every non-blank line of a request file, in order: (its id, its request or its RequestError;
    a line with no id to go by is named by its number, `line 3: invalid JSON ...`)."""
    # split on "\n" only: U+2028 and friends are legal inside JSON strings
    text = Path(path).read_text(encoding="utf-8")
    out: list[tuple[Any, ScoreRequest | BeamRequest | RequestError]] = []
    for n, ln in enumerate(text.split("\n"), 1):
        if not ln.strip():
            continue
        try:
            req = parse_request(ln, labels_of)
            out.append((req.id, req))
        except RequestError as e:
            rid = getattr(e, "request_id", None)
            if e.field == "line":  # say which line when there is no id to go by
                e = RequestError(f"line {n}", str(e).removeprefix("line: "))
            out.append((rid, e))
    return out


def _beam(b: Beam) -> dict[str, Any]:
    out: dict[str, Any] = {"ids": b.ids, "logprob": b.logprob}
    if b.item_id is not None:
        out["item_id"] = b.item_id
    return out


def format_result(rid: Any, result: ScoreResult | BeamResult | RequestError | ExecutionError) -> str:
    if isinstance(result, (RequestError, ExecutionError)):
        obj: dict[str, Any] = {"id": rid, "error": str(result)}
    elif isinstance(result, ScoreResult):
        obj = {"id": rid, "scores": result.scores}
    else:
        obj = {"id": rid, "beams": [_beam(b) for b in result.beams]}
    return json.dumps(obj, ensure_ascii=False)
