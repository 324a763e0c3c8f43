"""Replacing a catalog while serving (issue 28, point 1): Admin.ReplaceCatalog / `slmrank client
replace-catalog`, Scheduler.replace_catalog, the runtimes' load_catalogs over a forest with room.

- A forest with room answers as one without (both runtimes), and the C++ loader lays it out as
  catalog.py does.
- A runtime whose catalog was replaced answers byte for byte as a runtime built from an artifact
  with the new catalog, on both runtimes, also for the other catalog of the artifact (whose trie
  nodes move) and unconstrained requests.
- Under load over gRPC, catalogs swapped back and forth: no error, every answer's items are all
  items of the one version it names, both versions answer, and ModelInfo follows.
- Refusals name the field and change nothing: unknown name, a file outside --catalog-dir or that
  does not parse, another code length, no room; the RPC is off without --catalog-dir.
- At start-up a server serves --catalog-dir's NAME.tsv as catalog NAME; one that cannot be stops it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import urllib.request
from types import SimpleNamespace

import grpc
import pytest
import torch

from service.artifact.artifact import build_artifact, load_artifact
from service.artifact.catalog import forest_capacity, read_catalog, trie_forest
from service.model.tokenizer import load_tokenizer
from service.runtime.batch import pack_beam, pick_bucket
from service.runtime.cpp_runtime import CppRuntime
from service.runtime.python_runtime import PythonRuntime
from service.runtime.requests import BeamRequest
from service.sched.batcher import BatcherConfig, CatalogReplaceError, Scheduler
from service.serving.client import RankerClient, info_summary
from service.serving.proto_gen import load as load_stubs
from service.serving.server import Model, RankerServer, ServerConfig
from service.serving.server_thread import ServerThread

pb2, pb2_grpc = load_stubs().pb2, load_stubs().pb2_grpc
RUNTIMES = {"python": PythonRuntime, "cpp": CppRuntime}


def _items(rng: random.Random, prefix: str, num_items: int, length: int = 3, per_level: int = 9) -> dict[str, tuple]:
    levels = [rng.sample(range(4, 250), per_level) for _ in range(length)]
    codes: set[tuple[int, ...]] = set()
    while len(codes) < num_items:
        codes.add(tuple(rng.choice(level) for level in levels))
    return {f"{prefix}-{i}": code for i, code in enumerate(sorted(codes))}


def _write(path, items: dict[str, tuple]) -> None:
    path.write_text("".join(f"{k}\t{' '.join(map(str, v))}\n" for k, v in items.items()))


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """Catalog files under dir/ (shop v1, v2, one too big for the room, one of another code
    length, one that does not parse; `other`, the artifact's second catalog) and artifacts with
    shop v1 and with shop v2."""
    root = tmp_path_factory.mktemp("replace")
    d = root / "dir"
    d.mkdir()
    rng = random.Random(28)
    items = {"v1": _items(rng, "old", 60), "v2": _items(rng, "new", 90), "other": _items(rng, "o", 25, per_level=5),
             "big": _items(rng, "big", 700, per_level=12), "short": _items(rng, "s", 10, length=2)}
    for name, its in items.items():
        _write(d / f"{name}.tsv", its)
    (d / "bad.tsv").write_text("x\t1 2 3\ny\t1 2\n")
    arts = {v: load_artifact(build_artifact("embedded:tiny", root / f"art_{v}", quiet=True,
                                            catalogs={"shop": d / f"{v}.tsv", "other": d / "other.tsv"}))
            for v in ("v1", "v2")}
    return SimpleNamespace(dir=d, items=items, arts=arts,
                           versions={v: arts[v].catalogs[0].version for v in ("v1", "v2")})


def _requests() -> list[BeamRequest]:
    return [BeamRequest((1, 2, 3, 4), 8, 3, catalog="shop"), BeamRequest((5, 6), 4, 3, catalog="other"),
            BeamRequest((7, 8, 9), 3, 3), BeamRequest((9, 9, 1), 16, 3, catalog="shop")]


def _run(runtime, art, catalogs) -> tuple[torch.Tensor, torch.Tensor]:
    reqs = _requests()
    batch = pack_beam(reqs, pick_bucket(art.buckets, reqs), catalogs)
    return runtime.run_beam(batch)


def test_read_catalog_has_the_version_a_build_records(shop):
    for v in ("v1", "v2"):
        assert read_catalog("shop", shop.dir / f"{v}.tsv", 1000).version == shop.versions[v]
    assert shop.versions["v1"] != shop.versions["v2"]


@pytest.mark.parametrize("kind", RUNTIMES)
def test_room_in_the_forest_does_not_change_answers(shop, kind):
    art = shop.arts["v1"]
    exact = _run(RUNTIMES[kind](art), art, art.catalogs)
    roomy = _run(RUNTIMES[kind](art, catalog_headroom=1.7), art, art.catalogs)
    assert all(torch.equal(a, b) for a, b in zip(exact, roomy))
    assert torch.isfinite(exact[1][0, :8]).all()  # shop has more than 8 items: 8 of them


def test_cpp_loader_lays_the_forest_out_as_python(shop):
    art = shop.arts["v1"]
    rt = CppRuntime(art, catalog_headroom=1.5)
    cap = forest_capacity(art.catalogs, 1.5)
    assert rt.catalog_capacity == cap and cap.nodes > sum(c.num_nodes for c in art.catalogs)
    for catalogs in (art.catalogs, shop.arts["v2"].catalogs):
        if catalogs is not art.catalogs:
            rt.load_catalogs(catalogs)
        want = trie_forest(catalogs, torch.device("cpu"), cap)
        for name, tensor in want.items():
            assert torch.equal(rt._executor.weight(name), tensor), name


@pytest.mark.parametrize("kind", RUNTIMES)
def test_a_replaced_catalog_answers_as_a_fresh_build(shop, kind):
    old, new = shop.arts["v1"], shop.arts["v2"]
    rt = RUNTIMES[kind](old, catalog_headroom=2.0)
    before = _run(rt, old, old.catalogs)
    rt.load_catalogs(new.catalogs)
    got = _run(rt, new, new.catalogs)
    fresh = _run(RUNTIMES[kind](new), new, new.catalogs)
    assert all(torch.equal(a, b) for a, b in zip(got, fresh))
    assert not torch.equal(got[0][0], before[0][0])  # shop's answer did change
    assert torch.equal(got[0][1:3], before[0][1:3]) and torch.equal(got[1][1:3], before[1][1:3])  # other, free
    rt.load_catalogs(old.catalogs)  # and back
    assert all(torch.equal(a, b) for a, b in zip(_run(rt, old, old.catalogs), before))


def test_replace_catalog_checks_before_anything_changes(shop):
    art = shop.arts["v1"]

    async def main():
        rt = PythonRuntime(art, catalog_headroom=1.3)
        sched = Scheduler(art, rt, batcher=BatcherConfig(validate_requests=True))
        await sched.start()
        before = (await sched.submit(BeamRequest((1, 2, 3, 4), 8, 3, catalog="shop"))).result
        cases = {"name": read_catalog("nope", shop.dir / "v2.tsv", 1000),
                 "file": read_catalog("shop", shop.dir / "short.tsv", 1000),
                 "room": read_catalog("shop", shop.dir / "big.tsv", 1000)}
        for reason, cat in cases.items():
            with pytest.raises(CatalogReplaceError) as e:
                await sched.replace_catalog(cat)
            assert e.value.reason == reason, str(e.value)
        assert "--catalog-headroom" in str(e.value)
        assert sched.catalogs == art.catalogs and sched.catalog_replacements == 0
        after = (await sched.submit(BeamRequest((1, 2, 3, 4), 8, 3, catalog="shop"))).result
        assert after == before and after.catalog_version == shop.versions["v1"]
        old = await sched.replace_catalog(read_catalog("shop", shop.dir / "v2.tsv", 1000))
        assert old.version == shop.versions["v1"] and sched.catalogs[0].version == shop.versions["v2"]
        res = (await sched.submit(BeamRequest((1, 2, 3, 4), 8, 3, catalog="shop"))).result
        assert res.catalog_version == shop.versions["v2"]
        assert all(b.item_id in shop.items["v2"] and tuple(b.ids) == shop.items["v2"][b.item_id] for b in res.beams)
        await sched.close()

    asyncio.run(main())


# ---- over gRPC ------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(RUNTIMES))
def served(request, shop):
    art = load_artifact(shop.arts["v1"].path)  # its own Artifact: the server changes nothing of the module's
    runtime = RUNTIMES[request.param](art, catalog_headroom=2.0)
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=0, trace_sample_rate=0.0,
                          catalog_dir=str(shop.dir))
    srv = ServerThread(RankerServer(config, lambda: Model(art, runtime, load_tokenizer(art.tokenizer_dir))))
    srv.wait_serving()
    yield srv
    srv.stop()


def _replace(target: str, name: str, file: str) -> pb2.ReplaceCatalogResponse:
    with RankerClient(target, timeout_s=60) as c:
        return c.replace_catalog(name, file)


def test_swaps_under_load_answer_every_request_from_one_version(served, shop):
    stop = threading.Event()
    answers: list[tuple[str, pb2.BeamSearchResponse | grpc.RpcError]] = []

    async def load() -> None:
        async with grpc.aio.insecure_channel(served.target) as channel:
            stub = pb2_grpc.RankerStub(channel)

            async def caller(i: int) -> None:
                rng = random.Random(i)
                while not stop.is_set():
                    catalog = rng.choice(["shop", "shop", "other", ""])
                    # half the catalog requests normalised over the codes: batches of their own (CodesBucket)
                    codes = bool(catalog) and rng.random() < 0.5
                    msg = pb2.BeamSearchRequest(prompt=pb2.Segment(ids=[rng.randrange(1, 200) for _ in range(5)]),
                                                beam_width=rng.choice([1, 4, 8, 16]), new_tokens=3, catalog=catalog,
                                                normalization=pb2.NORMALIZATION_CODES if codes else 0)
                    try:
                        answers.append((catalog, await stub.BeamSearch(msg, timeout=30)))
                    except grpc.aio.AioRpcError as e:
                        answers.append((catalog, e))

            await asyncio.gather(*(caller(i) for i in range(6)))

    loader = threading.Thread(target=asyncio.run, args=(load(),))
    loader.start()
    try:
        seen = []
        for k in range(4):  # v2, v1, v2, v1
            want = "v2" if k % 2 == 0 else "v1"
            n = len(answers)
            while len(answers) < n + 10:  # some answers between swaps
                threading.Event().wait(0.01)
            resp = _replace(served.target, "shop", f"{want}.tsv")
            assert resp.catalog.version == shop.versions[want] and resp.catalog.num_items == len(shop.items[want])
            assert resp.previous_version == shop.versions["v1" if want == "v2" else "v2"]
            assert resp.read_ms > 0 and resp.pause_ms >= 0
            seen.append(resp.catalog.version)
        n = len(answers)
        while len(answers) < n + 10:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        loader.join(60)
    errors = [(c, a) for c, a in answers if isinstance(a, grpc.RpcError)]
    assert not errors, errors[:3]
    by_version = {v: 0 for v in shop.versions.values()}
    item_sets = {shop.versions[v]: shop.items[v] for v in ("v1", "v2")}
    for catalog, resp in answers:
        if catalog == "shop":
            items = item_sets[resp.catalog_version]  # a version it named: one of the two
            assert all(b.item_id in items and tuple(b.ids) == items[b.item_id] for b in resp.beams), resp
            by_version[resp.catalog_version] += 1
        elif catalog == "other":
            assert resp.catalog_version == shop.arts["v1"].catalogs[1].version
            assert all(tuple(b.ids) == shop.items["other"][b.item_id] for b in resp.beams)
        else:
            assert not resp.catalog_version and not any(b.item_id for b in resp.beams)
    assert all(by_version.values()), by_version  # both versions answered
    buckets = served.on_loop(lambda: served.server.stats()["scheduler"]["buckets"])
    assert any(key.endswith(".codes-shop") for key in buckets) and any("codes" not in key for key in buckets)
    with RankerClient(served.target, timeout_s=30) as c:
        summary = info_summary(c.model_info())
        assert f"shop: {len(shop.items['v1'])} items of 3 tokens" in summary and shop.versions["v1"] in summary
        info = {cat.name: cat for cat in c.model_info().catalogs}
        assert info["shop"].version == shop.versions["v1"] and info["shop"].num_items == len(shop.items["v1"])
        assert c.beam([1, 2, 3], 4, 3, catalog="shop").catalog_version == shop.versions["v1"]
    url = f"http://127.0.0.1:{served.server.metrics_server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = [ln for ln in r.read().decode().splitlines() if ln.startswith("slmrank_catalog_items{")]
    assert sorted(lines) == sorted(f'slmrank_catalog_items{{catalog="{cat.name}",version="{cat.version}"}} '
                                   f'{float(cat.num_items)}' for cat in info.values()), lines


@pytest.mark.parametrize("name,file,code,says", [
    ("nope", "v2.tsv", grpc.StatusCode.INVALID_ARGUMENT, "name: no catalog 'nope'"),
    ("shop", "../dir/../v2.tsv", grpc.StatusCode.INVALID_ARGUMENT, "file: '../dir/../v2.tsv' is not a path under"),
    ("shop", "missing.tsv", grpc.StatusCode.INVALID_ARGUMENT, "file: no catalog file 'missing.tsv'"),
    ("shop", "", grpc.StatusCode.INVALID_ARGUMENT, "file: required"),
    ("shop", "bad.tsv", grpc.StatusCode.INVALID_ARGUMENT, "file: bad.tsv:2: 2 tokens, but line 1 has 3"),
    ("shop", "short.tsv", grpc.StatusCode.INVALID_ARGUMENT, "file: its items have 2 tokens"),
    ("shop", "big.tsv", grpc.StatusCode.RESOURCE_EXHAUSTED, "--catalog-headroom"),
])
def test_refusals_name_the_field_and_change_nothing(served, shop, name, file, code, says):
    with RankerClient(served.target, timeout_s=30) as c:
        before = c.model_info().catalogs
        with pytest.raises(grpc.RpcError) as e:
            c.replace_catalog(name, file)
        assert e.value.code() == code and says in e.value.details(), e.value.details()
        assert c.model_info().catalogs == before
        resp = c.beam([1, 2, 3], 4, 3, catalog="shop")
        assert resp.catalog_version == next(cat.version for cat in before if cat.name == "shop")


def test_replacement_is_off_without_a_catalog_dir(shop):
    art = shop.arts["v1"]
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=None, trace_sample_rate=0.0)
    srv = ServerThread(RankerServer(config, lambda: Model(art, PythonRuntime(art), load_tokenizer(art.tokenizer_dir))))
    try:
        srv.wait_serving()
        with pytest.raises(grpc.RpcError) as e:
            _replace(srv.target, "shop", "v2.tsv")
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--catalog-dir" in e.value.details()
    finally:
        srv.stop()


def test_a_current_file_in_the_catalog_dir_is_served_from_the_start(shop, tmp_path):
    """--catalog-dir DIR with DIR/NAME.tsv: the server starts with that file as catalog NAME (a
    replacement made before a restart is not lost when the file is where the operator put it); one
    that cannot replace it stops the start in one line."""
    art = shop.arts["v1"]
    (tmp_path / "shop.tsv").write_bytes((shop.dir / "v2.tsv").read_bytes())
    config = ServerConfig(host="127.0.0.1", port=0, grace_s=5, metrics_port=None, trace_sample_rate=0.0,
                          catalog_dir=str(tmp_path))
    runtime = PythonRuntime(load_artifact(art.path), catalog_headroom=2.0)
    srv = ServerThread(RankerServer(config, lambda: Model(runtime.artifact, runtime,
                                                          load_tokenizer(art.tokenizer_dir))), wait_ready=True)
    try:
        with RankerClient(srv.target, timeout_s=30) as c:
            info = {cat.name: cat.version for cat in c.model_info().catalogs}
            assert info == {"shop": shop.versions["v2"], "other": art.catalogs[1].version}
            resp = c.beam([1, 2, 3], 8, 3, catalog="shop")
            assert resp.catalog_version == shop.versions["v2"]
            assert all(b.item_id in shop.items["v2"] for b in resp.beams)
    finally:
        srv.stop()
    (tmp_path / "shop.tsv").write_bytes((shop.dir / "short.tsv").read_bytes())
    with pytest.raises(RuntimeError, match="shop.tsv: its items have 2 tokens"):
        ServerThread(RankerServer(config, lambda: Model(runtime.artifact, PythonRuntime(runtime.artifact),
                                                        load_tokenizer(art.tokenizer_dir))), wait_ready=True)
