"""The artifact loaded in C++ (cpp_dag/artifact_loader.cpp and its readers) equals what the Python
loader produces: the msgpack manifest, sha256 digests, safetensors weights, config, DAGs and RoPE
tables; corrupted input fails clearly; and `slmrank run --runtime cpp` (which now builds its
executor with Executor.from_artifact) stays byte-identical to `--runtime python`. CPU only.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from cpp_dag import _core as core
from service.artifact.artifact import FORMAT_VERSION, MANIFEST, WEIGHTS, build_artifact, load_artifact
from service.artifact.manifest import write_manifest
from service.model.layers import rope_table

QWEN_VOCAB = 151936  # embedded:tiny
SMALL_VOCAB = 512


# ---- artifacts -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """embedded:tiny: Qwen2 (q/k/v bias, tied embeddings), float32."""
    return build_artifact("embedded:tiny", tmp_path_factory.mktemp("loader") / "tiny", quiet=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 checkpoint (q/k norm, untied LM head, odd theta) built to a bfloat16 artifact."""
    import transformers

    torch.manual_seed(7)
    cfg = transformers.Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=4096, rope_theta=123457.0, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("loader_qwen3")
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(root / "ckpt")
    return build_artifact(str(root / "ckpt"), root / "art", dtype="bfloat16", quiet=True)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(art: Path, **changes: Any) -> None:
    m = msgpack.unpackb((art / MANIFEST).read_bytes())
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        d = m
        for key in path:
            d = d[key]
        d[last] = value
    write_manifest(art, m)


# ---- msgpack -------------------------------------------------------------------------------------

def _read_msgpack(tmp_path: Path, data: bytes) -> Any:
    p = tmp_path / "x.msgpack"
    p.write_bytes(data)
    return core.read_msgpack(str(p))


def test_msgpack_reader_reads_the_real_manifest(tiny_dir: Path, qwen3_dir: Path) -> None:
    for art in (tiny_dir, qwen3_dir):
        path = art / MANIFEST
        assert core.read_msgpack(str(path)) == msgpack.unpackb(path.read_bytes())


_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
            | st.floats(allow_nan=False) | st.text(max_size=40) | st.binary(max_size=40))
_objects = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=6)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=6), max_leaves=30)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=_objects)
def test_msgpack_reader_matches_unpackb(tmp_path: Path, obj: Any) -> None:
    data = msgpack.packb(obj)
    assert _read_msgpack(tmp_path, data) == msgpack.unpackb(data)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=st.lists(st.floats(width=32), max_size=8))
def test_msgpack_reader_float32(tmp_path: Path, obj: list[float]) -> None:
    data = msgpack.packb(obj, use_single_float=True)
    got, want = _read_msgpack(tmp_path, data), msgpack.unpackb(data)
    assert [struct.pack("<d", x) for x in got] == [struct.pack("<d", x) for x in want]  # NaN included


# (value, the type byte msgpack.packb starts it with): every format, at its size boundaries.
_FORMATS = [
    (None, 0xc0), (False, 0xc2), (True, 0xc3), (0, 0x00), (127, 0x7f), (128, 0xcc), (255, 0xcc), (256, 0xcd),
    (65535, 0xcd), (65536, 0xce), (2**32 - 1, 0xce), (2**32, 0xcf), (2**64 - 1, 0xcf), (-1, 0xff), (-32, 0xe0),
    (-33, 0xd0), (-128, 0xd0), (-129, 0xd1), (-32768, 0xd1), (-32769, 0xd2), (-(2**31), 0xd2),
    (-(2**31) - 1, 0xd3), (-(2**63), 0xd3), (2**63 - 1, 0xcf), (1.5, 0xcb), (-0.0, 0xcb), (math.inf, 0xcb),
    (5e-324, 0xcb), ("", 0xa0), ("a" * 31, 0xbf), ("b" * 32, 0xd9), ("c" * 255, 0xd9), ("d" * 256, 0xda),
    ("e" * 65535, 0xda), ("f" * 65536, 0xdb), ("héllo ✓ 𝄞", 0xaf), (b"", 0xc4), (b"x" * 255, 0xc4),
    (b"y" * 256, 0xc5), (b"z" * 65535, 0xc5), (b"w" * 65536, 0xc6), ([], 0x90), ([1] * 15, 0x9f),
    ([2] * 16, 0xdc), ([3] * 65535, 0xdc), ([4] * 65536, 0xdd), ({}, 0x80),
    ({str(i): i for i in range(15)}, 0x8f), ({str(i): i for i in range(16)}, 0xde),
    ({str(i): i for i in range(65535)}, 0xde), ({str(i): i for i in range(65536)}, 0xdf),
]


def test_msgpack_reader_every_format_at_its_boundaries(tmp_path: Path) -> None:
    for value, tag in _FORMATS:
        data = msgpack.packb(value)
        assert data[0] == tag, (value if len(repr(value)) < 40 else type(value), hex(data[0]))
        assert _read_msgpack(tmp_path, data) == msgpack.unpackb(data)
    data = msgpack.packb([v for v, _ in _FORMATS])
    assert _read_msgpack(tmp_path, data) == msgpack.unpackb(data)


@pytest.mark.parametrize("data, offset, what", [
    (b"", 0, "truncated value"),
    (b"\xc1", 0, "reserved type byte 0xc1"),
    (b"\xd4\x01\x02", 0, "unsupported type byte 0xd4"),
    (b"\x92\x01", 0, "array claims 2 elements but only 1 bytes are left"),
    (b"\x92\xcd\x01", 2, "truncated uint16"),
    (b"\x01\x02", 1, "1 trailing bytes"),
    (b"\xcd\x01", 1, "truncated uint16"),
    (b"\xa3ab", 1, "truncated str"),
    (b"\x91\xa2\xff\xfe", 1, "not valid UTF-8"),
    (b"\x81\x01\x02", 1, "map key is an integer"),
    (b"\x82\xa1a\x01\xa1a\x02", 4, "duplicate map key 'a'"),
    (b"\xdd\xff\xff\xff\xff", 0, "array claims 4294967295 elements"),
    (b"\x91" * 300 + b"\xc0", 257, "nesting deeper than 256"),
])
def test_msgpack_reader_refuses_malformed_input_naming_the_offset(tmp_path: Path, data: bytes, offset: int,
                                                                  what: str) -> None:
    with pytest.raises(RuntimeError) as e:
        _read_msgpack(tmp_path, data)
    assert what in str(e.value) and f"at byte offset {offset}" in str(e.value), str(e.value)
    assert "x.msgpack" in str(e.value)


def test_msgpack_reader_truncated_manifest(tiny_dir: Path, tmp_path: Path) -> None:
    data = (tiny_dir / MANIFEST).read_bytes()
    for cut in (1, 100, len(data) // 2, len(data) - 1):
        with pytest.raises(RuntimeError, match=r"at byte offset \d+"):
            _read_msgpack(tmp_path, data[:cut])


# ---- sha256 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 1000, (1 << 20) - 1, (1 << 20) + 3,
                                  3 * (1 << 20) + 77])
def test_sha256_matches_hashlib(tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size)
    p = tmp_path / "blob"
    p.write_bytes(data)
    assert core.sha256_file(str(p)) == hashlib.sha256(data).hexdigest()


def test_sha256_of_the_weights_is_the_manifests(tiny_dir: Path) -> None:
    digest = msgpack.unpackb((tiny_dir / MANIFEST).read_bytes())["weights"]["sha256"]
    assert core.sha256_file(str(tiny_dir / WEIGHTS)) == digest


def test_sha256_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="nope.bin: cannot open"):
        core.sha256_file(str(tmp_path / "nope.bin"))


# ---- safetensors ---------------------------------------------------------------------------------

def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k  # bytes
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):  # no torch.equal for fp8 on the CPU
            assert torch.equal(got[k], t), k


def test_safetensors_reader_loads_the_artifact_weights(tiny_dir: Path, qwen3_dir: Path) -> None:
    for art in (tiny_dir, qwen3_dir):
        tensors, metadata = core.read_safetensors(str(art / WEIGHTS))
        _assert_same(tensors, load_file(str(art / WEIGHTS)))
        assert metadata == {"format": "slmrank-artifact"}


def test_safetensors_reader_places_tensors_as_load_file_does(tiny_dir: Path, qwen3_dir: Path, tmp_path: Path) -> None:
    # A CPU GEMV's rounding depends on its operand's alignment: for the two runtimes to stay
    # byte-identical, every weight must sit at the alignment load_file (an mmap) gives it.
    odd = tmp_path / "odd.safetensors"  # odd sizes: tensors at every alignment
    save_file({f"t{i}": torch.ones(i, dtype=torch.uint8 if i % 2 else torch.float32) for i in range(1, 12)},
              str(odd), metadata={"pad": "x" * 3})
    for path in (tiny_dir / WEIGHTS, qwen3_dir / WEIGHTS, odd):
        tensors, _ = core.read_safetensors(str(path))
        want = load_file(str(path))
        assert {k: t.data_ptr() % 4096 for k, t in tensors.items()} == {k: t.data_ptr() % 4096 for k, t in want.items()}


def test_safetensors_reader_every_dtype(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    want = {
        "f32": torch.randn(3, 5, generator=g), "f64": torch.randn(4, dtype=torch.float64, generator=g),
        "bf16": torch.randn(2, 3, generator=g).bfloat16(), "f16": torch.randn(7, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (3, 2), generator=g), "i32": torch.randint(-9, 9, (5,), generator=g,
                                                                                        dtype=torch.int32),
        "i16": torch.arange(-3, 3, dtype=torch.int16), "i8": torch.arange(-4, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4), "3d": torch.randn(2, 3, 4, generator=g),
    }
    p = tmp_path / "all.safetensors"
    save_file(want, str(p), metadata={"a": "b", "ünï": "cödé"})
    tensors, metadata = core.read_safetensors(str(p))
    _assert_same(tensors, load_file(str(p)))
    assert metadata == {"a": "b", "ünï": "cödé"}
    # a dtype casts the floating-point tensors only
    cast, _ = core.read_safetensors(str(p), dtype="bfloat16")
    assert cast["f32"].dtype == torch.bfloat16 and torch.equal(cast["f32"], want["f32"].bfloat16())
    assert cast["i64"].dtype == torch.int64 and cast["bool"].dtype == torch.bool


def _safetensors_bytes(header: dict[str, Any] | bytes, data: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("blob, what", [
    (b"\x01\x00", "has no header length"),
    (struct.pack("<Q", 1000) + b"{}", "header length 1000 exceeds the file"),
    (_safetensors_bytes(b"{not json}", b""), "header JSON: expected a string key at header byte 1"),
    (_safetensors_bytes(b'{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', b"\0" * 4),
     "only integers are supported"),
    (_safetensors_bytes({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a': unsupported dtype 'Q4'"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
     "tensor 'a': data_offsets [0, 4) hold 4 bytes, but F32 of this shape needs 8"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
     "tensor 'a': data_offsets [0, 8) exceed the data section (4 bytes)"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
     "tensor 'a': data_offsets begin at 4, expected 0"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                         "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8),
     "tensor 'b': data_offsets begin at 0, expected 4"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 12),
     "the tensors cover 4 of the data section's 12 bytes"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
     "data_offsets must be [begin, end] with 0 <= begin <= end"),
    (_safetensors_bytes({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4),
     "tensor 'a': needs dtype, shape and data_offsets"),
    (_safetensors_bytes({"a": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\x07"),
     "tensor 'a': BOOL byte 7"),
    (_safetensors_bytes({"__metadata__": {"k": 1}}, b""), "__metadata__['k'] must be a string"),
])
def test_safetensors_reader_refuses_corrupt_files(tmp_path: Path, blob: bytes, what: str) -> None:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(blob)
    with pytest.raises(RuntimeError) as e:
        core.read_safetensors(str(p))
    assert what in str(e.value) and str(p) in str(e.value), str(e.value)


def test_safetensors_reader_json_escapes(tmp_path: Path) -> None:
    meta = {"k": 'é😀\n"x\\/', "ünï": "\t"}
    p = tmp_path / "escaped.safetensors"
    p.write_bytes(_safetensors_bytes({"__metadata__": meta}, b""))  # json.dumps writes \uXXXX pairs
    assert core.read_safetensors(str(p)) == ({}, meta)


def test_safetensors_reader_truncated_weights(tiny_dir: Path, tmp_path: Path) -> None:
    p = tmp_path / WEIGHTS
    p.write_bytes((tiny_dir / WEIGHTS).read_bytes()[:-1])
    with pytest.raises(RuntimeError, match="exceed the data section"):
        core.read_safetensors(str(p))


# ---- the whole artifact --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_loader_matches_the_python_loader(tiny_dir: Path, qwen3_dir: Path, dtype: str | None) -> None:
    for art_dir in (tiny_dir, qwen3_dir):
        art = load_artifact(art_dir)
        want_dtype = getattr(torch, dtype) if dtype else art.weight_dtype
        got = core.load_artifact(str(art_dir), "cpu", dtype)
        want = art.load_weights("cpu", want_dtype)
        _assert_same(got["weights"], want)
        assert {k: t.data_ptr() % 64 for k, t in got["weights"].items()} == {k: t.data_ptr() % 64
                                                                              for k, t in want.items()}

        cfg = art.config
        assert got["config"] == {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                                 "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
                                 "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                                 "intermediate_size": cfg.intermediate_size, "num_labels": cfg.num_labels,
                                 "rms_norm_eps": cfg.rms_norm_eps, "qk_norm": cfg.qk_norm}
        for name, nodes in (("score_dag", art.score_dag), ("beam_dag", art.beam_dag)):
            assert [(n["name"], n["type"], tuple(n["inputs"]), tuple(n["outputs"]), n["layer"], n["step"], n["mode"],
                     n["weight"]) for n in got[name]] == [
                (n.name, n.type, n.inputs, n.outputs, n.attrs.get("layer", -1), n.attrs.get("step", 0),
                 n.attrs.get("mode", ""), n.attrs.get("weight", "")) for n in nodes]

        # the RoPE tables: byte-identical to service/model/layers.py::rope_table(...).to(dtype)
        lim = art.limits
        num_positions = max(lim.max_prompt_tokens + lim.max_new_tokens, lim.max_score_tokens)
        assert got["num_positions"] == num_positions
        cos, sin = rope_table(cfg, num_positions, torch.device("cpu"))
        for key, want in (("rope_cos", cos.to(want_dtype)), ("rope_sin", sin.to(want_dtype))):
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), key


@pytest.mark.gpu
def test_loader_on_cuda_matches_the_python_loader(tiny_dir: Path, qwen3_dir: Path) -> None:
    cuda = torch.device("cuda")
    for art_dir in (tiny_dir, qwen3_dir):
        art = load_artifact(art_dir)
        got = core.load_artifact(str(art_dir), "cuda", "bfloat16")
        assert all(t.device.type == "cuda" for t in got["weights"].values())
        _assert_same(got["weights"], art.load_weights(cuda, torch.bfloat16))
        cos, sin = rope_table(art.config, got["num_positions"], cuda)
        assert torch.equal(got["rope_cos"], cos.bfloat16()) and torch.equal(got["rope_sin"], sin.bfloat16())


def test_loader_rope_with_an_integer_theta(tiny_dir: Path, tmp_path: Path) -> None:
    # A manifest may hold theta as an int: Python then computes `int ** t`; so must C++.
    art_dir = _copy(tiny_dir, tmp_path / "art")
    _rewrite_manifest(art_dir, model__rope_theta=500000)
    art = load_artifact(art_dir)
    got = core.load_artifact(str(art_dir))
    cos, sin = rope_table(art.config, got["num_positions"], torch.device("cpu"))
    assert torch.equal(got["rope_cos"], cos) and torch.equal(got["rope_sin"], sin)


def test_loader_flipped_weight_byte_fails_the_sha256(tiny_dir: Path, tmp_path: Path) -> None:
    art_dir = _copy(tiny_dir, tmp_path / "art")
    data = bytearray((art_dir / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0x01
    (art_dir / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"weights\.safetensors: sha256 mismatch"):
        core.Executor.from_artifact(str(art_dir))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        core.load_artifact(str(art_dir))
    core.load_artifact(str(art_dir), verify=False)  # the bytes still parse: only the hash catches it


def test_loader_refuses_another_format_version(tiny_dir: Path, tmp_path: Path) -> None:
    art_dir = _copy(tiny_dir, tmp_path / "art")
    _rewrite_manifest(art_dir, format_version=FORMAT_VERSION - 1)
    with pytest.raises(ValueError, match=rf"manifest\.msgpack: format_version {FORMAT_VERSION - 1} is not supported "
                                         rf"\(this slmrank reads version {FORMAT_VERSION}\)"):
        core.Executor.from_artifact(str(art_dir))


@pytest.mark.parametrize("changes, what", [
    ({"format": "something-else"}, "manifest.msgpack: not a slmrank-artifact manifest"),
    ({"model__arch": "llama"}, "model.arch: 'llama' is not one of qwen2, qwen3"),
    ({"model__num_layers": "two"}, "model.num_layers: must be an integer in [1, 1048576], got 'two'"),
    ({"model__num_layers": 1}, "weights do not match the model config: missing [], unexpected [layers.1."),
    ({"model__head_dim": 16}, "weight layers.0.bqkv: shape [256] != expected [128]"),
    ({"weights__dtype": "int4"}, "weights.dtype: 'int4' is not one of float32, bfloat16, float16"),
    ({"weights__file": "../weights.safetensors"}, "must be a file name inside the artifact directory"),
    ({"dags__score": 3}, "malformed manifest (dags.score: msgpack value is an integer, not an array)"),
])
def test_loader_refuses_a_bad_manifest_naming_the_field(tiny_dir: Path, tmp_path: Path, changes: dict[str, Any],
                                                        what: str) -> None:
    art_dir = _copy(tiny_dir, tmp_path / "art")
    _rewrite_manifest(art_dir, **changes)
    with pytest.raises(ValueError) as e:
        core.load_artifact(str(art_dir), verify=False)
    assert what in str(e.value), str(e.value)


def test_loader_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an artifact"):
        core.Executor.from_artifact(str(tmp_path))
    write_manifest(tmp_path, b"\x92\x01\xcd")  # its digest matches: the decoder sees it
    with pytest.raises(ValueError, match=r"manifest\.msgpack: corrupted manifest \(msgpack: truncated uint16 .* "
                                         r"at byte offset 3\)"):
        core.Executor.from_artifact(str(tmp_path))


# ---- the C++ runtime, loaded in C++, answers byte for byte like the Python runtime ------------------

def _requests(vocab: int) -> list[Any]:
    rng = random.Random(99)
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    return [
        {"id": "s-prefix", "kind": "score", "prefix_ids": ids(9), "samples": [ids(3), ids(6), ids(1)],
         "label_ids": ids(5)},
        {"id": "s-plain", "kind": "score", "samples": [ids(4), ids(2)], "label_ids": ids(2)},
        {"id": "b4-t3", "kind": "beam", "prompt_ids": ids(11), "beam_width": 4, "new_tokens": 3},
        {"id": "bad-width", "kind": "beam", "prompt_ids": ids(3), "beam_width": 0, "new_tokens": 2},
        {"id": "b1-t5", "kind": "beam", "prompt_ids": ids(7), "beam_width": 1, "new_tokens": 5},
        '{"id": "broken", ',
    ]


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_cli_run_cpp_equals_python_byte_for_byte(tiny_dir: Path, qwen3_dir: Path, tmp_path: Path, which: str) -> None:
    from service.cli import main

    art_dir, vocab = (tiny_dir, QWEN_VOCAB) if which == "tiny" else (qwen3_dir, SMALL_VOCAB)
    req = tmp_path / "requests.jsonl"
    req.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in _requests(vocab)))
    outs = {}
    for runtime in ("python", "cpp"):
        outs[runtime] = tmp_path / f"{runtime}.jsonl"
        rc = main(["run", "--model", str(art_dir), "--runtime", runtime, "--requests", str(req),
                   "--out", str(outs[runtime]), "--quiet"])
        assert rc == 0
    python_bytes = outs["python"].read_bytes()
    assert outs["cpp"].read_bytes() == python_bytes
    lines = [json.loads(x) for x in python_bytes.decode().splitlines()]
    assert sum("error" in x for x in lines) == 2 and len(lines) == 6
