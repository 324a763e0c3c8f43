"""The catalog workloads (W7, W8, and their unconstrained twins W7u, W8u) and their generated
catalog, on the CPU: the requests name the catalog with new_tokens its code length; the catalog file
is the same bytes for a seed and parses into distinct codes with each level's tokens apart; the
benches' artifact is built once with it, and a W7-shaped batch through the executor bench's path
comes back as items of the catalog."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ops.bench import bench_executor as be
from ops.bench.workloads import WORKLOADS, Requests, catalog_artifact, parse_workload, runtime_of, runtime_request
from service.artifact.artifact import load_artifact
from service.artifact.catalog import parse_catalog
from service.loadgen import catalogs as gen
from service.runtime.engine import execute
from service.runtime.python_runtime import PythonRuntime


@pytest.mark.parametrize("name,twin", [("W7", "W7u"), ("W8", "W8u")])
def test_catalog_workloads_name_the_catalog_with_new_tokens_its_code_length(name: str, twin: str) -> None:
    w, u = parse_workload(name), parse_workload(twin)
    spec = gen.CATALOGS[w["catalog"]]
    assert w["catalog"] == "sid-1m" and w["new"] == spec["levels"] == 3 and spec["codes"] == 256
    assert spec["items"] == 1_000_000
    assert {k: v for k, v in w.items() if k not in ("catalog", "name")} == {k: v for k, v in u.items() if k != "name"}
    assert (w["prompt"], w["beam"], w["model"]) == ((128, 100, "embedded:qwen2.5-0.5b") if name == "W7"
                                                     else (128, 400, "embedded:qwen3-0.6b"))
    msg = Requests(w, 150_000, seed=3).next()
    assert (msg.catalog, msg.new_tokens, msg.beam_width, len(msg.prompt.ids)) == ("sid-1m", 3, w["beam"], 128)
    assert runtime_of(msg).catalog == "sid-1m" and runtime_of(msg).new_tokens == 3
    assert runtime_request(w, torch.Generator().manual_seed(1)).catalog == "sid-1m"
    assert Requests(u, 150_000, seed=3).next().catalog == "" and runtime_request(u, torch.Generator()).catalog == ""
    assert be.WORKLOAD_MODELS[name][0] == w["model"].removeprefix("embedded:") + "+sid-1m"
    assert be.WORKLOAD_MODELS[twin][0] == w["model"].removeprefix("embedded:")


@pytest.mark.parametrize("name,base", [("W7c", "W7"), ("W8c", "W8")])
def test_code_workloads_are_their_catalog_twins_normalised_over_the_codes(name: str, base: str) -> None:
    w, b = parse_workload(name), parse_workload(base)
    assert w["normalization"] == "codes" and {k: v for k, v in w.items() if k not in ("normalization", "name")} == \
        {k: v for k, v in b.items() if k != "name"}
    msg = Requests(w, 150_000, seed=3).next()
    assert msg.normalization == msg.DESCRIPTOR.fields_by_name["normalization"].enum_type.values_by_name[
        "NORMALIZATION_CODES"].number and msg.catalog == "sid-1m"
    assert runtime_of(msg).normalization == "codes" and runtime_request(w, torch.Generator()).normalization == "codes"
    assert Requests(b, 150_000, seed=3).next().normalization == 0 and runtime_of(Requests(b, 150_000).next()).normalization == "vocab"
    assert be.WORKLOAD_MODELS[name][0] == be.WORKLOAD_MODELS[base][0]  # the same artifact, built with the catalog
    # the logical FLOPs count the LM head over the 768 codes: less than the vocabulary's by exactly that
    from ops.bench.workloads import request_flops
    from service.loadgen.command import model_config
    from service.loadgen.workloads import flops_per_request, message_flops
    from service.model.flops import beam_flops

    cfg = model_config(w["model"])
    full, codes = flops_per_request(cfg, b), flops_per_request(cfg, w)
    heads = 1 + w["beam"] * (w["new"] - 1)  # positions whose logits are used
    assert full - codes == 2 * cfg.hidden_size * (cfg.vocab_size - 768) * heads
    assert message_flops(cfg, msg) == codes == request_flops(cfg, runtime_of(msg))
    assert message_flops(cfg, msg, {"sid-1m": 700}) == beam_flops(cfg, 128, w["beam"], 3, 700)


def test_the_older_workloads_are_unchanged() -> None:
    assert all("catalog" not in WORKLOADS[n] for n in ("W1", "W2", "W3", "W4", "W5", "W6"))
    assert Requests(parse_workload("W2"), 150_000).next().catalog == ""


def test_the_generated_catalog_is_deterministic_per_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen, "BLOCK", 1000)  # several blocks
    a = gen.write_catalog(tmp_path / "a.tsv", 5000, seed=4).read_bytes()
    assert gen.write_catalog(tmp_path / "b.tsv", 5000, seed=4).read_bytes() == a
    assert gen.write_catalog(tmp_path / "c.tsv", 5000, seed=5).read_bytes() != a
    ids, codes = parse_catalog(tmp_path / "a.tsv", 151_936)
    assert len(ids) == 5000 and len(set(ids.tolist())) == 5000 and ids.tolist()[:2] == ["i0000", "i0001"]
    assert len(np.unique(codes, axis=0)) == 5000  # distinct codes
    for level in range(3):  # each level's 256 tokens, apart from the other levels', inside tiny's 4,096 too
        assert codes[:, level].min() >= 1000 + 256 * level and codes[:, level].max() < 1000 + 256 * (level + 1)
    assert codes.max() < 4096
    assert (gen.catalog_codes(5000, seed=4) == codes - np.array([1000, 1256, 1512])).all()
    with pytest.raises(ValueError, match="1 to 8"):
        gen.catalog_codes(9, seed=1, levels=3, codes=2)


def test_the_catalog_artifact_is_built_once_and_serves_items(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(gen.CATALOGS, "sid-test", dict(items=3000, levels=3, codes=256, base=1000, seed=9))
    monkeypatch.setitem(WORKLOADS, "W7", dict(WORKLOADS["W7"], prompt=8, beam=4, catalog="sid-test"))
    monkeypatch.setitem(be.WORKLOAD_MODELS, "W7", ("tiny+sid-test", 2))
    out = be.art_dir("tiny+sid-test")
    assert out == catalog_artifact("embedded:tiny", "sid-test")
    stamp = (out / "manifest.msgpack").stat().st_mtime_ns
    assert catalog_artifact("embedded:tiny", "sid-test") == out  # cached: not built again
    assert (out / "manifest.msgpack").stat().st_mtime_ns == stamp
    art = load_artifact(out)
    assert art.catalog_lengths == {"sid-test": 3}
    batches = be.fixed_batches(art, "W7", 2, torch.Generator().manual_seed(2))
    assert all(r.catalog == "sid-test" for b in batches for r in b.requests)
    items = set((tmp_path / "cache" / "catalogs" / "sid-test-seed9.tsv").read_text().split("\n")[:-1])
    results = execute(art, PythonRuntime(art, device="cpu"), batches[0].requests)
    for result in results:
        assert len(result.beams) == 4
        for beam in result.beams:
            assert f"{beam.item_id}\t{' '.join(map(str, beam.ids))}" in items


def test_bench_grpc_serves_the_catalog_artifact_and_refuses_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.bench import bench_grpc
    from service.artifact.artifact import build_artifact

    monkeypatch.setenv("SLMRANK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(gen.CATALOGS, "sid-test", dict(items=500, levels=3, codes=256, base=1000, seed=9))
    built = bench_grpc.catalog_model("embedded:tiny", "sid-test")
    assert Path(built) == catalog_artifact("embedded:tiny", "sid-test")
    assert bench_grpc.catalog_model(built, "sid-test") == built  # an artifact that holds it: as it is
    plain = build_artifact("embedded:tiny", tmp_path / "plain", quiet=True)
    with pytest.raises(SystemExit, match="has no catalog 'sid-test'"):
        bench_grpc.catalog_model(str(plain), "sid-test")
    with pytest.raises(SystemExit, match="the peers have no catalog"):
        bench_grpc.main(["--workload", "W7", "--peer", "--out", str(tmp_path / "out")])
