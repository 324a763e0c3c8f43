"""Proto messages <-> request types, for the gRPC server.

Every field of a request message is checked before any work, cheapest first (priority, counts,
label ids or label texts (a few characters each, bounded), beam sizes) and text segments are
tokenized last; a bad field raises RequestError named
by its proto path (`samples[2].ids[5]`, `prompt.text`, `beam_width`) with the limit it breaks.
The engine's own validation (validate_score / validate_beam) runs last, its field names mapped to
the proto's.
"""

from __future__ import annotations

import functools
import re
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..sched.verdict import PROTO_PRIORITY_NAMES, Priority
from ..sched.verdict import lane_of
from ..artifact.artifact import Artifact
from .proto_gen import load as load_stubs
from ..runtime.requests import (BeamRequest, BeamResult, RequestError, ScoreRequest, ScoreResult, label_ids_of_texts,
                                validate_beam, validate_score)
from ..model.tokenizer import Tokenizer
from ..observe.records import current_trace
from ..sched.shapes import TEXT_SLACK, message_dims
from ..siblings import sibling



# validate_score / validate_beam name fields after the request dataclasses; the client wrote protos.
_ENGINE_TO_PROTO = [
    (re.compile(r"^prefix_ids\["), "prefix.ids["),
    (re.compile(r"^prefix_ids$"), "prefix"),
    (re.compile(r"^samples\[(\d+)\]\["), r"samples[\1].ids["),
    (re.compile(r"^prompt_ids\["), "prompt.ids["),
    (re.compile(r"^prompt_ids$"), "prompt"),
]


# BeamSearchRequest.normalization (proto enum Normalization) -> BeamRequest.normalization
NORMALIZATION_NAMES = {0: "vocab", 1: "codes"}


@dataclass
class TokenizeStats:
    """Per text segment (sample, prefix or prompt): how long tokenizing it took."""

    num_segments: int = 0
    total_ns: int = 0
    max_ns: int = 0

    def add(self, ns: int) -> None:
        self.num_segments += 1
        self.total_ns += ns
        self.max_ns = max(self.max_ns, ns)

    def as_dict(self) -> dict[str, float]:
        mean_us = self.total_ns / self.num_segments / 1e3 if self.num_segments else 0.0
        return {"num_segments": self.num_segments, "mean_us": round(mean_us, 3), "max_us": round(self.max_ns / 1e3, 3)}


class Codec:
    def __init__(self, artifact: Artifact, tokenizer: Tokenizer) -> None:
        self.pb2 = load_stubs().pb2
        self.model = artifact.config
        self.limits = artifact.limits
        self.catalog_lengths = artifact.catalog_lengths
        self.tokenizer = tokenizer
        self.tokenize_stats = TokenizeStats()
        # tables the first request would otherwise build on the event loop (~40 ms each for a 150k
        # vocabulary): the decode table, and the longest token's bytes (the text-length bound)
        tokenizer.decode([])
        self.max_token_bytes = tokenizer.max_token_bytes
        # the response encoder's varint of every model id (a response's ids and lengths; ~6 MB for a
        # 152k vocabulary)
        self._varint_table = [_varint(i) for i in range(max(self.model.vocab_size, 1 << 14))]
        self._wire = _beam_wire(tokenizer, self.model.vocab_size)

    # -- requests -------------------------------------------------------------------------------
    def score_request(self, msg: Any) -> tuple[ScoreRequest, Priority]:
        priority = priority_of(msg.priority)
        _check_count("samples", len(msg.samples), self.limits.max_samples)
        label_ids = self._label_ids(msg)
        has_prefix = msg.HasField("prefix")
        if not has_prefix:
            fast = self._score_ids_only(msg.samples)
            if fast is not None:
                req = ScoreRequest(samples=fast, label_ids=label_ids)
                _engine_check(validate_score, req, self)
                return req, priority
        segments = [("prefix", msg.prefix)] if has_prefix else []
        segments += [(f"samples[{i}]", s) for i, s in enumerate(msg.samples)]
        for field, seg in segments:  # every structural check before the first tokenization
            self._check_segment(field, seg)
        self._check_text_length(segments, self.limits.max_score_tokens)
        max_tokens, num_tokens = self.limits.max_score_tokens, 0
        ids: list[tuple[int, ...]] = []
        for field, seg in segments:
            ids.append(self._segment_ids(field, seg, cached=field == "prefix"))
            num_tokens += len(ids[-1])
            if num_tokens > max_tokens:  # stop tokenizing as soon as the request is too long
                raise RequestError(field, f"the request exceeds the maximum of {max_tokens} tokens "
                                          f"(prefix + samples) at this segment")
        prefix = ids.pop(0) if msg.HasField("prefix") else ()
        req = ScoreRequest(samples=tuple(ids), label_ids=label_ids, prefix_ids=prefix)
        _engine_check(validate_score, req, self)
        return req, priority

    def _label_ids(self, msg: Any) -> tuple[int, ...]:
        """label_ids, or label_texts' one token each (a few short texts, bounded before they are
        tokenized, through the tokenizer's cache: the same labels come with every request)."""
        if msg.label_texts:
            if msg.label_ids:
                raise RequestError("label_texts", "both label_ids and label_texts are set: set exactly one of them")
            return label_ids_of_texts(msg.label_texts, self.tokenizer.encode_cached, self.model, self.limits,
                                      max_chars=TEXT_SLACK * self.max_token_bytes)
        label_ids = self._ids("label_ids", msg.label_ids)
        max_labels = self.limits.max_labels
        if len(label_ids) > max_labels:
            raise RequestError("label_ids", f"{len(label_ids)} label ids exceed the maximum of {max_labels}")
        return label_ids

    def _score_ids_only(self, samples: Any) -> tuple[tuple[int, ...], ...] | None:
        """The samples' ids in one pass when every sample is a valid ids segment (the common case;
        W1's decode 117 -> 103 us on the CI machine, most of what is left being protobuf's ids
        becoming Python ints); None when any is not (text, empty, an id outside the vocabulary,
        too many tokens): the segment-by-segment path then names the field, with the same messages."""
        if any(s.text for s in samples):
            return None
        ids = tuple(tuple(s.ids) for s in samples)
        if not all(ids) or sum(map(len, ids)) > self.limits.max_score_tokens:
            return None
        if min(map(min, ids)) < 0 or max(map(max, ids)) >= self.model.vocab_size:
            return None
        return ids

    def beam_request(self, msg: Any) -> tuple[BeamRequest, Priority]:
        priority = priority_of(msg.priority)
        for field, hi in (("beam_width", self.limits.max_beam_width), ("new_tokens", self.limits.max_new_tokens)):
            value = getattr(msg, field)
            if not 1 <= value <= hi:
                raise RequestError(field, f"{value} is outside the allowed range [1, {hi}]")
        if not msg.HasField("prompt"):
            raise RequestError("prompt", "is required")
        self._check_segment("prompt", msg.prompt)
        self._check_text_length([("prompt", msg.prompt)], self.limits.max_prompt_tokens)
        if msg.normalization not in NORMALIZATION_NAMES:
            raise RequestError("normalization", f"{msg.normalization} is not a Normalization (0: VOCABULARY, 1: CODES)")
        req = BeamRequest(prompt_ids=self._segment_ids("prompt", msg.prompt), beam_width=msg.beam_width,
                          new_tokens=msg.new_tokens, catalog=msg.catalog,
                          normalization=NORMALIZATION_NAMES[msg.normalization])
        _engine_check(functools.partial(validate_beam, catalogs=self.catalog_lengths), req, self)
        return req, priority

    def tokenize(self, msg: Any) -> Any:
        """A TokenizeRequest -> its TokenizeResponse: text -> ids (as a text segment is tokenized),
        or ids -> text (as a beam's text is decoded); either way both, within the longest a request
        may be."""
        most = max(self.limits.max_score_tokens, self.limits.max_prompt_tokens)
        if msg.text and msg.ids:
            raise RequestError("text", "both text and ids are set: set exactly one of text or ids")
        if msg.ids:
            if len(msg.ids) > most:
                raise RequestError("ids", f"{len(msg.ids)} ids exceed the maximum of {most} (the longest request)")
            ids = self._ids("ids", msg.ids)
        elif msg.text:
            if len(msg.text) > TEXT_SLACK * most * self.max_token_bytes:
                raise RequestError("text", f"{len(msg.text)} characters of text cannot fit in the maximum of {most} "
                                           "tokens: refused before tokenizing")
            ids = self._segment_ids("", msg)
            if len(ids) > most:
                raise RequestError("text", f"tokenizes to {len(ids)} tokens, more than the maximum of {most} "
                                           "(the longest request)")
        else:
            raise RequestError("text", "empty request: set exactly one of text or ids")
        return self.pb2.TokenizeResponse(ids=ids, text=self.text(ids))

    def shape_of(self, kind: str, msg: Any) -> tuple[ScoreRequest | BeamRequest, Priority] | None:
        """A request of the message's shape (placeholder ids) no larger than the one score_request /
        beam_request would make: ids segments at their length, text at the fewest tokens it can
        become (len / (TEXT_SLACK x max_token_bytes)); and its priority. For admission's gate before decoding;
        None when the message is outside the limits (decoding will name the field)."""
        priority = lane_of(msg.priority)
        request = self._shape(kind, msg) if priority is not None else None
        return None if request is None else (request, priority)

    def _shape(self, kind: str, msg: Any) -> ScoreRequest | BeamRequest | None:
        dims = message_dims(kind, msg, self.limits, self.max_token_bytes)
        if dims is None:
            return None
        if dims[0] == 1:
            _, n, beam_width, new_tokens = dims
            return BeamRequest(prompt_ids=(0,) * n, beam_width=beam_width, new_tokens=new_tokens)
        _, prefix, samples = dims
        return ScoreRequest(samples=tuple((0,) * n for n in samples), prefix_ids=(0,) * prefix)

    # -- responses ------------------------------------------------------------------------------
    def score_response(self, result: ScoreResult) -> Any:
        pb2 = self.pb2
        return pb2.ScoreResponse(samples=[pb2.SampleScore(logprobs=row) for row in result.scores])

    def beam_response(self, result: BeamResult) -> bytes:
        """The BeamSearchResponse's wire bytes, written here rather than through message objects
        (hundreds of beams a response: half the event-loop time of building the message and
        serializing it), byte for byte what BeamSearchResponse(...).SerializeToString() gives:
        each Beam is field 1 of the response, length-delimited; in it ids (field 1, packed varints),
        logprob (field 2, float32; left out when +0.0, as proto3 does), text (field 3, UTF-8) and
        item_id (field 4, with a catalog); then the catalog's version (field 2 of the response).
        From the result's output rows through the C++ BeamWire when it can (~1 us a beam instead of
        ~4), else here."""
        if self._wire is not None and result.rows is not None and result.item_ids is None:
            wire = self._wire.encode(*result.rows)
            if wire is not None:  # None: an id that is no token or not the model's, handled below
                return wire
        beams = result.beams
        seqs = [b.ids for b in beams]
        flat = [i for ids in seqs for i in ids]
        if flat and not (min(flat) >= 0 and max(flat) < self.model.vocab_size):
            raise ValueError("beam ids outside the model's vocabulary")  # the runtime's bug, never the client's
        vt = self._varint_table  # every id of the model, and every length below 2**14
        texts = self._text_bytes(seqs)
        logprobs = struct.pack(f"<{len(beams)}f", *[b.logprob for b in beams])
        join, n_vt = b"".join, len(vt)
        parts: list[bytes] = []
        for k, (ids, text) in enumerate(zip(seqs, texts)):
            packed = join([vt[i] for i in ids])
            lp = logprobs[4 * k:4 * k + 4]
            n_text = len(text)
            if packed and lp != _ZERO_F32 and 0 < n_text < n_vt:  # the usual beam: all three fields
                body = join((b"\x0a", vt[len(packed)], packed, b"\x15", lp, b"\x1a", vt[n_text], text))
            else:  # proto3 leaves empty and zero fields out
                body = join(((b"\x0a" + vt[len(packed)] + packed) if packed else b"",
                             (b"\x15" + lp) if lp != _ZERO_F32 else b"",
                             (b"\x1a" + _varint(n_text) + text) if text else b""))
            if beams[k].item_id:  # field 4, a catalog's item
                item = beams[k].item_id.encode()
                body += b"\x22" + _varint(len(item)) + item
            n_body = len(body)
            parts += (b"\x0a", vt[n_body] if n_body < n_vt else _varint(n_body), body)
        if result.catalog_version:  # field 2 of the response
            version = result.catalog_version.encode()
            parts += (b"\x12", _varint(len(version)), version)
        return join(parts)

    def _text_bytes(self, seqs: list[list[int]]) -> list[bytes]:
        """Each beam's text, UTF-8: the usual case (every id a token the tokenizer knows) in one
        decode_utf8_many call; an id it does not know (a model's padded embedding rows) is U+FFFD (text())."""
        if max(map(max, filter(None, seqs)), default=-1) < self.tokenizer.vocab_size:
            return self.tokenizer.decode_utf8_many(seqs)
        return [self.text(ids).encode() for ids in seqs]

    def text(self, ids: Sequence[int]) -> str:
        """The tokenizer's decoding; an id it does not know (a model's padded embedding rows) is U+FFFD."""
        known = self.tokenizer.vocab_size
        if not ids or max(ids) < known:
            return self.tokenizer.decode(ids)
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t < known:
                run.append(t)
                continue
            parts += [self.tokenizer.decode(run), "\ufffd"]
            run = []
        return "".join(parts) + self.tokenizer.decode(run)

    # -- fields ---------------------------------------------------------------------------------
    def _ids(self, field: str, ids: Sequence[int]) -> tuple[int, ...]:
        vocab = self.model.vocab_size
        ids = tuple(ids)  # one pass over the protobuf container; min/max then run over the tuple
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise RequestError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab})")
        return ids

    @staticmethod
    def _check_segment(field: str, seg: Any) -> None:
        has_text, has_ids = bool(seg.text), len(seg.ids) > 0
        if has_text and has_ids:
            raise RequestError(field, "both text and ids are set: set exactly one of text or ids")
        if not has_text and not has_ids:
            raise RequestError(field, "empty segment: set exactly one of text or ids")

    def _check_text_length(self, segments: list[tuple[str, Any]], max_tokens: int) -> None:
        """Text that cannot fit in max_tokens is refused before any of it is tokenized (a 1 MB
        text would hold the event loop for tens of milliseconds)."""
        most = TEXT_SLACK * max_tokens * self.tokenizer.max_token_bytes
        total = 0
        for field, seg in segments:
            total += len(seg.text)
            if total > most:
                raise RequestError(f"{field}.text", f"{total} characters of text (here and before) cannot fit in the "
                                                    f"maximum of {max_tokens} tokens: refused before tokenizing")

    def _segment_ids(self, field: str, seg: Any, cached: bool = False) -> tuple[int, ...]:
        """field "": a top-level text/ids pair (TokenizeRequest), its fields named text, ids."""
        prefix = f"{field}." if field else ""
        if seg.ids:
            return self._ids(f"{prefix}ids", seg.ids)
        t0 = time.monotonic_ns()
        ids = self.tokenizer.encode_cached(seg.text) if cached else self.tokenizer.encode(seg.text)
        t1 = time.monotonic_ns()
        current_trace().add_stage("tokenize", t0, t1)  # inside the request's decode stage
        self.tokenize_stats.add(t1 - t0)
        vocab = self.model.vocab_size
        if ids and max(ids) >= vocab:  # a checkpoint whose model vocabulary is smaller than its tokenizer's
            raise RequestError(f"{prefix}text", f"tokenizes to id {max(ids)}, outside the model's "
                                                f"vocabulary [0, {vocab})")
        return tuple(ids)


_ZERO_F32 = bytes(4)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def priority_of(value: int) -> Priority:
    lane = lane_of(value)
    if lane is None:
        raise RequestError("priority", f"{value} is not one of {PROTO_PRIORITY_NAMES}")
    return lane


def _check_count(field: str, n: int, hi: int) -> None:
    if n == 0:
        raise RequestError(field, "at least one is required")
    if n > hi:
        raise RequestError(field, f"{n} exceed the maximum of {hi}")


def _engine_check(validate: Callable[..., None], req: ScoreRequest | BeamRequest, codec: Codec) -> None:
    try:
        validate(req, codec.model, codec.limits, ids_checked=True)  # _ids and the tokenizer: ids in range
    except RequestError as e:
        field = e.field
        for pattern, repl in _ENGINE_TO_PROTO:
            field = pattern.sub(repl, field)
        raise RequestError(field, str(e).removeprefix(f"{e.field}: ")) from None


def _beam_wire(tokenizer: Tokenizer, model_vocab: int) -> Any:
    """The C++ response encoder over the tokenizer's token bytes, or None (a tokenizer whose
    decoding is more than joining bytes, or no extension built): Codec.beam_response's Python path."""
    table = tokenizer.token_bytes()
    if table is None:
        return None
    try:
        BeamWire = sibling("cpp_dag._core").BeamWire
    except ImportError:
        return None
    return BeamWire(table, model_vocab)
