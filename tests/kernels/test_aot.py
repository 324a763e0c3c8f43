"""kernels.aot: `python -m kernels.aot` compiles every kernel variant a model needs into sm_90a
cubins on a machine without a GPU, with a manifest that states the launch ABI. (It runs in a
subprocess: this test session defines the kernels under Triton's interpreter.)"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from service.model.checkpoint import weight_source
from service.runtime.fused import kernel_shape

ROOT = Path(__file__).resolve().parents[2]
# kernels/beam_topk.py: the streaming kernels for 1024 groups, the threshold and select ones per sort width;
# the streaming and select ones without and with an allowed-token bitmask (catalogs)
BEAM_TOPK_VARIANTS = ({f"beam_{k}.g1024.mask{m}.bf16" for k in ("stats", "collect") for m in (0, 1)}
                      | {f"beam_threshold.g1024.k{1 << i}.fp32" for i in range(1, 10)}
                      | {f"beam_select.k{1 << i}.mask{m}.bf16" for i in range(1, 10) for m in (0, 1)}
                      | {f"beam_merge.k{1 << i}.fp32" for i in range(1, 10)})


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    proc = subprocess.run([sys.executable, "-m", "kernels.aot", "--shape", json.dumps(kernel_shape(weight_source("embedded:tiny")[0])),
                           "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "kernels.json").read_text())


def test_every_variant_is_a_cubin_for_sm90a(compiled) -> None:
    out, manifest = compiled
    assert manifest["target"] == "sm_90a"
    variants = {k["variant"] for k in manifest["kernels"]}
    # embedded:tiny: hidden 128, head_dim 32, 4 heads / 2 KV heads
    assert variants == {"rms_norm.n128.res0.bf16", "rms_norm.n128.res1.bf16", "silu_mul.i384.bf16",
                        "qkv_rope.h4.g2.e32.norm0.bf16", "qkv_rope.h4.g2.e32.norm1.bf16",
                        "decode_attention.h4.g2.e32.norm0.bf16", "decode_attention.h4.g2.e32.norm1.bf16", "segment_attention.h4.g2.e32.bf16",
                        # before FP8 GEMMs (bf16 only); q_size = hidden here: one quantizer
                        "rms_norm_fp8.n128.res0.bf16", "rms_norm_fp8.n128.res1.bf16", "silu_mul_fp8.i384.bf16",
                        "quantize_rows.n128.bf16",
                        # a catalog trie's lookups: integer kernels, one variant for every model
                        "trie_allowed.cols0.fp32", "trie_allowed.cols1.fp32", "trie_advance.fp32",
                        # the beam step's bookkeeping: integer kernels, one variant for every model
                        "beam_commit.codes0.fp32", "beam_commit.codes1.fp32"} | BEAM_TOPK_VARIANTS
    assert msgpack.unpackb((out / "kernels.msgpack").read_bytes()) == manifest
    for k in manifest["kernels"]:
        blob = (out / k["cubin"]).read_bytes()
        assert blob[:4] == b"\x7fELF" and hashlib.sha256(blob).hexdigest() == k["sha256"]
        assert k["num_warps"] in (1, 4, 8) and k["shared_bytes"] >= 0
        # read from the cubin (Triton's cuobjdump): no variant spills registers to local memory
        assert 0 < k["registers"] <= 255 and k["local_bytes"] == 0 and k["stack_bytes"] == 0, k["variant"]


def test_manifest_states_the_launch_abi(compiled) -> None:
    _, manifest = compiled
    by_name = {k["variant"]: k for k in manifest["kernels"]}
    # the order cpp_dag/triton_kernels.cpp passes them in; the e4m3 output a pointer like the rest
    fp8_norm = by_name["rms_norm_fp8.n128.res1.bf16"]["params"]
    assert [p["name"] for p in fp8_norm][:8] == ["x_ptr", "res_ptr", "w_ptr", "q_ptr", "scale_ptr", "sum_ptr",
                                                 "num_rows", "eps"]
    assert [p["type"] for p in fp8_norm][3:5] == ["CUdeviceptr", "CUdeviceptr"]
    assert [p["name"] for p in by_name["silu_mul_fp8.i384.bf16"]["params"]][:4] == ["gu_ptr", "q_ptr", "scale_ptr",
                                                                                   "num_rows"]
    attn = by_name["decode_attention.h4.g2.e32.norm1.bf16"]
    names = [p["name"] for p in attn["params"]]
    # constexprs are baked in and absent; the two scratch pointers of Triton >= 3.5 come last
    assert names == ["q_ptr", "pk_ptr", "pv_ptr", "start_ptr", "len_ptr", "sk_ptr", "sv_ptr", "sr_ptr", "out_ptr",
                     "pos_ptr", "cos_ptr", "sin_ptr", "qw_ptr", "kw_ptr", "num_rows", "num_slots", "num_suffix", "pos_offset",
                     "scale", "eps", "global_scratch", "profile_scratch"]
    types = {p["name"]: p["type"] for p in attn["params"]}
    assert types["scale"] == "float" and types["num_suffix"] == "int32_t" and types["q_ptr"] == "CUdeviceptr"
    assert types["sr_ptr"] == "CUdeviceptr"  # suffix_rows: where each row's suffix slots are
    assert attn["constexprs"]["E"] == 32 and attn["function"] == "decode_attention_kernel"  # embedded:tiny head_dim
    assert attn["constexprs"]["BEAMS"] == 32 and attn["constexprs"]["INTERPRETED"] is False  # 64 rows / 2 q heads
    # the runtimes' form only: from the q/k/v GEMM's output, with and without Qwen3's q/k norms
    assert attn["constexprs"]["ROPE"] is True and attn["constexprs"]["QK_NORM"] is True
    assert by_name["decode_attention.h4.g2.e32.norm0.bf16"]["constexprs"]["QK_NORM"] is False
    (seg,) = [k for k in manifest["kernels"] if k["variant"].startswith("segment_attention.")]
    assert [p["name"] for p in seg["params"]] == ["q_ptr", "k_ptr", "v_ptr", "ranges_ptr", "out_ptr", "num_rows",
                                                  "scale", "global_scratch", "profile_scratch"]
    assert {p["name"]: p["type"] for p in seg["params"]}["ranges_ptr"] == "CUdeviceptr"
    assert seg["constexprs"]["BLOCK_M"] == 64 and seg["constexprs"]["H"] == 4 and seg["constexprs"]["G"] == 2
    assert seg["function"] == "segment_attention_kernel" and seg["grid"] == "(num_heads, cdiv(rows, BLOCK_M), 1)"


def test_a_constexpr_missing_from_the_signature_is_refused(tmp_path: Path) -> None:
    from kernels.aot import KernelSpec, compile_kernels
    from kernels.norm_act import silu_mul_kernel

    signature = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "num_rows": "i32", "INTER": "constexpr", "BLOCK": "constexpr",
                 "ROWS": "constexpr"}
    spec = KernelSpec("bad", silu_mul_kernel, signature, {"INTER": 64, "BLOCK": 64, "ROWS": 1, "NOPE": 1})
    with pytest.raises(ValueError, match=r"constexprs \['NOPE'\] are not constexpr"):
        compile_kernels([spec], tmp_path)


_PARALLEL = """
import json, sys
from kernels.aot import beam_topk_specs, compile_kernels, trie_specs
specs = trie_specs() + [s for s in beam_topk_specs("bf16", max_sort=4) if s.variant.startswith("beam_merge")]
out = {}
for jobs in (1, 3):
    m = compile_kernels(specs, f"{sys.argv[1]}/j{jobs}", jobs=jobs)
    out[jobs] = [{k: v for k, v in e.items() if k != "compile_ms"} for e in m["kernels"]]
print(json.dumps({"order": [s.variant for s in specs], "one": out[1], "three": out[3]}))
"""


def test_worker_processes_compile_the_same_cubins_in_the_specs_order(tmp_path: Path) -> None:
    """compile_kernels in 3 forked workers (jobs=3) writes the manifest one process writes, entry for
    entry (cubin hashes included), in the order of the specs, whichever worker finished first."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", _PARALLEL, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(got["order"]) >= 4
    assert [e["variant"] for e in got["three"]] == got["order"]
    assert got["three"] == got["one"]
    for e in got["three"]:
        assert (tmp_path / "j3" / e["cubin"]).read_bytes() == (tmp_path / "j1" / e["cubin"]).read_bytes()


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_job_count_is_refused_by_name(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.aot import default_jobs

    monkeypatch.setenv("SLMRANK_AOT_JOBS", value)
    with pytest.raises(ValueError, match="SLMRANK_AOT_JOBS"):
        default_jobs()
    monkeypatch.setenv("SLMRANK_AOT_JOBS", "3")
    assert default_jobs() == 3
