"""`slmrank build --traffic LOG` (service/loadgen/tiers.py): the table chosen for a synthetic log,
its reported padding recounted by a plain loop over the requests and buckets; a narrow traffic
gets a table that pads it less than the default; the budgets hold; the artifact records the table
and ModelInfo reports it; a bad log is one line and exit 2."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from service.artifact.artifact import load_artifact
from service.artifact.buckets import BeamBucket, ScoreBucket, default_bucket_table
from service.cli import main as cli_main
from service.loadgen import packing, tiers, traffic
from service.model.checkpoint import weight_source
from service.runtime.batch import pick_bucket
from service.runtime.requests import BeamRequest, ScoreRequest
from tests.service.test_traffic import LIMITS, T0, synthetic_records, write_log

CFG = weight_source("embedded:qwen3-0.6b")[0]


def in_flight_brute(rs: list[dict]) -> list[int]:
    return [sum(o["arrival_s"] <= r["arrival_s"] < o["arrival_s"] + o["latency_ms"] / 1e3 for o in rs) for r in rs]


def holds(b, batch: list[dict]) -> bool:
    """A bucket's fields against a batch, by hand."""
    if isinstance(b, ScoreBucket):
        return (len(batch) <= b.max_requests and sum(r["tokens"] for r in batch) <= b.max_tokens
                and sum(r["samples"] for r in batch) <= b.max_samples)
    return (max(r["new_tokens"] for r in batch) <= b.new_tokens and len(batch) <= b.max_requests
            and sum(r["prompt_tokens"] for r in batch) <= b.max_prompt_tokens
            and max(r["beam_width"] for r in batch) <= b.beam_width
            and sum(r["beam_width"] for r in batch) <= b.max_rows)


def rows(b) -> int:
    """A bucket's padded rows (what `slmrank traffic` counts): token rows; beam rows times decode steps."""
    return b.max_tokens if isinstance(b, ScoreBucket) else b.max_rows * b.new_tokens


def real_rows(r: dict) -> int:
    return r["tokens"] if "samples" in r else r["beam_width"] * r["new_tokens"]


# FLOPs of one token row through a layer stack's linear maps and of one LM-head row, from CFG's sizes
D, Q, KV = CFG.hidden_size, CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
TOKEN = CFG.num_layers * 2 * (D * Q + 2 * D * KV + Q * D + 3 * D * CFG.intermediate_size)
HEAD = 2 * D * CFG.vocab_size


def flops(b) -> int:
    """A bucket's padded work (what `slmrank build --traffic` minimises): Score its tokens and
    LM-head rows; BeamSearch its prefill, one head row a request, and n - 1 decode steps of its
    rows; a forward pass of fewer than packing.FLOOR_ROWS rows counted as one of that many."""
    f = packing.FLOOR_ROWS
    if isinstance(b, ScoreBucket):
        return max(b.max_tokens, f) * TOKEN + b.max_samples * HEAD
    return (max(b.max_prompt_tokens, f) * TOKEN + b.max_requests * HEAD
            + max(b.max_rows, f) * (b.new_tokens - 1) * (TOKEN + HEAD))


def real_flops(r: dict) -> int:
    if "samples" in r:
        return r["tokens"] * TOKEN + r["samples"] * HEAD
    return r["prompt_tokens"] * TOKEN + HEAD + r["beam_width"] * (r["new_tokens"] - 1) * (TOKEN + HEAD)


def order(b) -> tuple[int, ...]:
    """The order the server tries buckets in, as the docs state it: fewest padded rows (times steps)
    first; then Score samples; BeamSearch rows, prompt tokens, width, requests."""
    if isinstance(b, ScoreBucket):
        return b.max_tokens, b.max_samples
    return rows(b), b.max_rows, b.max_prompt_tokens, b.beam_width, b.max_requests


def brute_padding(records: list[dict], buckets: list, alone: bool = False, work=rows, real_work=real_rows) -> dict:
    """One kind's requests in arrival order, a batch as long as a bucket holds it and it has fewer
    requests than were in flight when its first arrived; each batch in the first bucket in that order that holds it; the
    work of the batches' buckets and of their requests (work, real_work: rows, or flops)."""
    rs = sorted(records, key=lambda r: r["arrival_s"])
    caps = [1] * len(rs) if alone else in_flight_brute(rs)
    batches, batch, cap = [], [], 1
    for r, n in zip(rs, caps):
        if batch and (len(batch) >= cap or not any(holds(b, batch + [r]) for b in buckets)):
            batches.append(batch)
            batch = []
        if not batch:
            cap = n
        batch.append(r)
    batches.append(batch)
    real = padded = 0
    per: dict[str, list[int]] = {}
    for batch in batches:
        b = min((b for b in buckets if holds(b, batch)), key=order)
        mine = sum(real_work(r) for r in batch)
        real += mine
        padded += work(b)
        slot = per.setdefault(b.key, [0, 0, 0])
        slot[0] += 1
        slot[1] += mine
        slot[2] += work(b)
    return {"batches": len(batches), "real": real, "padded": padded, "per": per}


def kinds_of(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        if "samples" in r:
            out.setdefault("score", []).append(r)
        elif "prompt_tokens" in r:
            out.setdefault("beam", []).append(r)  # any new_tokens share a batch
    return out


@pytest.fixture(scope="module")
def chosen(tmp_path_factory: pytest.TempPathFactory):
    records = synthetic_records(700, seed=4, rate=60.0)
    path = write_log(tmp_path_factory.mktemp("tiers") / "log.jsonl", records)
    table, origin = tiers.choose_from_log(str(path), CFG, LIMITS, quiet=True)
    return records, table, origin


def test_reported_padding_equals_a_brute_force_count(chosen) -> None:
    records, table, origin = chosen
    default = default_bucket_table(LIMITS)
    by_kind = kinds_of(records)
    assert set(origin["kinds"]) == set(by_kind) == {"score", "beam"}
    assert len({r["new_tokens"] for r in by_kind["beam"]}) == 3  # batches that mix new_tokens are replayed
    for kind, rs in by_kind.items():
        got = origin["kinds"][kind]
        mine = [b for b in (*table.score, *table.beam) if (kind == "score") == isinstance(b, ScoreBucket)]
        brute = brute_padding(rs, mine, work=flops, real_work=real_flops)
        assert got["requests"] == len(rs) and got["unit"] == "flops"
        packed = got["packed"]
        assert (packed["batches"], packed["real"], packed["padded"]) == \
            (brute["batches"], brute["real"], brute["padded"]), kind
        assert {p["key"]: [p["batches"], p["real"], p["padded"]] for p in packed["buckets"]} == brute["per"], kind
        assert packed["padding"] == round((brute["padded"] - brute["real"]) / brute["real"], 4)
        assert brute["batches"] < len(rs), "no batch of two: the replay checks no packing"
        alone = brute_padding(rs, mine, alone=True, work=flops, real_work=real_flops)
        assert (got["alone"]["batches"], got["alone"]["padded"]) == (len(rs), alone["padded"]), kind
        theirs = [b for b in (*default.score, *default.beam) if (kind == "score") == isinstance(b, ScoreBucket)]
        for name, is_alone in (("default_packed", False), ("default_alone", True)):
            brute_default = brute_padding(rs, theirs, alone=is_alone, work=flops, real_work=real_flops)
            assert (got[name]["batches"], got[name]["padded"]) == (brute_default["batches"], brute_default["padded"])
        # what it minimises it does no worse on than the default
        assert packed["padding"] <= got["default_packed"]["padding"], kind


def test_the_holds_matrix_is_each_buckets_holds(chosen) -> None:
    """The chooser's [buckets, batches] holds, computed a count at a time, against Bucket.holds one
    pair at a time: every default bucket of each kind against the totals of the log's batches."""
    records, _, _ = chosen
    log = traffic.parse_lines([json.dumps(r) for r in records], "log")
    default = default_bucket_table(LIMITS)
    for kind, kt in tiers.kinds_of_log(log, CFG, LIMITS).items():
        buckets = list(default.of_kind(kind))
        totals = list(packing.pack(buckets, kt.requests))
        got = tiers.holds_matrix(buckets, totals)
        want = [[b.holds(*t) for t in totals] for b in buckets]
        assert got.tolist() == want, kind
        assert 0 < got.sum() < got.size, kind  # both answers occur


def test_the_chosen_prompt_tiers_pad_the_prefill_less_than_the_default(chosen) -> None:
    """The prompt tier is work (the prefill runs all its rows): replayed as the server packs them,
    the log's BeamSearch batches run in prompt tiers no wider than the default table's, and in
    no more beam rows (each counted from packing.FLOOR_ROWS up). (A choice on beam rows alone put every batch in the widest prompt tier:
    1.75x the prompts against the default's 1.46x on a beam-mix log.)"""
    records, table, _ = chosen
    rs = kinds_of(records)["beam"]
    f = packing.FLOOR_ROWS  # rows below it cost nothing more: they are no padding the GPU pays
    prompts = dict(work=lambda b: max(b.max_prompt_tokens, f), real_work=lambda r: r["prompt_tokens"])
    beam_rows = dict(work=lambda b: max(b.max_rows, f) * (b.new_tokens - 1),
                     real_work=lambda r: r["beam_width"] * (r["new_tokens"] - 1))
    for what in (prompts, beam_rows):
        mine = brute_padding(rs, list(table.beam), **what)
        default = brute_padding(rs, list(default_bucket_table(LIMITS).beam), **what)
        assert mine["real"] == default["real"]
        assert mine["padded"] <= default["padded"], (mine["padded"] / mine["real"], default["padded"] / default["real"])


def test_the_chosen_table_pads_another_log_of_the_same_traffic_less_than_the_default(chosen, tmp_path: Path) -> None:
    """Chosen on one log, the table is no fit to that log alone: on a second log drawn from the same
    distribution (another seed) it still pads less than the default table, per kind."""
    _, table, _ = chosen
    other = synthetic_records(700, seed=5, rate=60.0)
    log = traffic.read_log(write_log(tmp_path / "other.jsonl", other))
    report = traffic.analyze(log, [("built", table), ("default", default_bucket_table(LIMITS))], CFG)
    for kind in ("score", "beam"):
        pads = {name: p["packed"]["flops"]["ratio"] for name, p in report["kinds"][kind]["padding"].items()}
        assert pads["built"] < pads["default"], (kind, pads)


def test_the_traffic_report_packs_the_log_as_the_build_does(chosen, tmp_path: Path) -> None:
    """`slmrank traffic`'s padding packed as the server batches: the same replay, recounted by the
    plain loop above, for the log's own table and the default; replayed in arrival order whichever
    order the log's lines come in (a server writes a request's record as it ends)."""
    records, table, origin = chosen
    ended = sorted(records, key=lambda r: r["arrival_s"] + r["latency_ms"] / 1e3)
    assert ended != records
    for art_table, source in ((table, "built"), (default_bucket_table(LIMITS), "default")):
        buckets = (*art_table.score, *art_table.beam)
        for name, recs in (("arrival", records), ("ended", ended)):
            log = traffic.parse_lines([json.dumps(r) for r in recs], f"{source}-{name}")
            report = traffic.analyze(log, [(source, art_table)], CFG)
            # (arrivals are logged to the millisecond: requests of one arrival keep the log's order)
            for kind, rs in kinds_of(recs).items():
                mine = [b for b in buckets if (kind == "score") == isinstance(b, ScoreBucket)]
                brute = brute_padding(rs, mine)
                packed = report["kinds"][kind]["padding"][source]["packed"]
                assert (packed["batches"], packed["real"], packed["padded"]) == \
                    (brute["batches"], brute["real"], brute["padded"]), (source, name, kind)
                assert brute["batches"] < len(rs), "no batch of two: the replay checks no packing"
                # and in FLOPs, the unit the build minimises: the same count as the build's report
                brute = brute_padding(rs, mine, work=flops, real_work=real_flops)
                assert (packed["flops"]["padded"], packed["flops"]["real"]) == (brute["padded"], brute["real"])
                if (source, name) == ("built", "arrival"):  # the build's own log
                    assert packed["flops"]["padded"] == origin["kinds"][kind]["packed"]["padded"]
            assert "; FLOPs " in traffic.format_report(report)
    assert "flops" not in traffic.analyze(log, [("built", table)])["kinds"]["beam"]["padding"]["built"]["packed"]


def test_the_table_serves_every_request_of_the_limits_within_the_budgets(chosen) -> None:
    _, table, origin = chosen
    table.fits_one(LIMITS)
    largest = [ScoreRequest(((0,) * 1985,) + ((0,),) * 63)] + \
        [BeamRequest((0,) * LIMITS.max_prompt_tokens, LIMITS.max_beam_width, n) for n in (1, 2, 3, 4, 5)]
    assert all(pick_bucket(table, [r]) is not None for r in largest)
    budget = origin["budget"]
    buckets = (*table.score, *table.beam)
    assert origin["graphs"] == len(buckets) <= budget["max_graphs"] == len(default_bucket_table(LIMITS).score) + \
        len(default_bucket_table(LIMITS).beam)
    assert max(tiers.activation_bytes(b, CFG, LIMITS) for b in buckets) == origin["max_activation_bytes"] \
        <= budget["max_activation_bytes"]


def test_tight_budgets_bound_the_table_and_too_tight_ones_are_named(chosen, tmp_path: Path) -> None:
    records, _, origin = chosen
    path = write_log(tmp_path / "log.jsonl", records)
    log = traffic.read_log(path)
    small = tiers.Budget(30, 900 << 20)
    table, tight = tiers.choose_table(log, CFG, LIMITS, small, quiet=True)
    buckets = (*table.score, *table.beam)
    assert len(buckets) == 30 and all(tiers.activation_bytes(b, CFG, LIMITS) <= 900 << 20 for b in buckets)
    table.fits_one(LIMITS)
    assert tight["kinds"]["score"]["packed"]["padded"] >= origin["kinds"]["score"]["packed"]["padded"]
    with pytest.raises(ValueError, match="--max-graphs 3: a table needs at least"):
        tiers.choose_table(log, CFG, LIMITS, tiers.Budget(3, 900 << 20), quiet=True)
    with pytest.raises(ValueError, match="--max-activation-mib 10: no score bucket within it holds one request"):
        tiers.choose_table(log, CFG, LIMITS, tiers.Budget(400, 10 << 20), quiet=True)


def narrow_records(n: int, seed: int = 0) -> list[dict]:
    """Score only: 3-4 samples of 60-70 tokens after a 180-200-token prefix, one or two in flight."""
    rng = random.Random(seed)
    out, t = [], T0
    for _ in range(n):
        t += rng.expovariate(50.0)
        lens = [rng.randint(60, 70) for _ in range(rng.randint(3, 4))]
        prefix = rng.randint(180, 200)
        out.append({"logger": "slmrank.access", "method": "Score", "kind": "score", "code": "OK",
                    "arrival_s": round(t, 4), "latency_ms": round(rng.uniform(5, 30), 3), "samples": len(lens),
                    "sample_tokens": lens, "prefix_tokens": prefix, "tokens": prefix + sum(lens), "labels": 2})
    return out


def test_a_narrow_traffic_gets_a_table_that_pads_it_less_than_the_default(tmp_path: Path) -> None:
    path = write_log(tmp_path / "log.jsonl", narrow_records(1500))
    table, origin = tiers.choose_from_log(str(path), CFG, LIMITS, quiet=True)
    score = origin["kinds"]["score"]
    assert set(origin["kinds"]) == {"score"}  # BeamSearch: one bucket a new_tokens, for a request of the limits
    assert len(table.beam) == LIMITS.max_new_tokens and len(table.score) < len(default_bucket_table(LIMITS).score)
    # each request alone pads ~7.9% either way: 370-480 tokens in 64-row tiers; packed, the default's
    # eighth-octave tiers pad ~5.4%, the chosen table less, with fewer buckets
    assert score["packed"]["padding"] < score["default_packed"]["padding"], score
    assert score["alone"]["padding"] <= score["default_alone"]["padding"], score


def test_the_default_table_does_well_on_varied_traffic(chosen) -> None:
    """Eighth-octave token tiers: a Score batch pads under an eighth of its rows, ~1/16 on average,
    whether the requests come alone or packed: within 10 points of a table chosen for this very log."""
    _, _, origin = chosen
    score = origin["kinds"]["score"]
    for name in ("default_packed", "default_alone"):
        assert score[name]["padding"] < 0.15, (name, score[name])
        assert score[name]["padding"] - score[name.removeprefix("default_")]["padding"] < 0.10, score


def test_build_records_the_table_and_model_info_reports_it(tmp_path: Path, capsys) -> None:
    from service.serving import proto_gen
    from service.serving.client import info_summary
    from service.serving.model_info import model_info

    records = synthetic_records(300, seed=6, rate=40.0)
    path = write_log(tmp_path / "log.jsonl", records)
    out = tmp_path / "art"
    assert cli_main(["build", "--model", "embedded:tiny", "--out", str(out), "--traffic", str(path), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "bucket table from log.jsonl" in printed and "expected padding (FLOPs): packed" in printed
    art = load_artifact(out)
    origin = art.manifest["bucket_origin"]
    assert origin["source"] == "traffic log" and origin["log_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert origin["log_requests"] == sum("tokens" in r for r in records)
    keys = {p["key"] for k in origin["kinds"].values() for p in k["packed"]["buckets"]}
    assert keys <= {b.key for b in (*art.buckets.score, *art.buckets.beam)}
    for kind, k in origin["kinds"].items():
        assert f"{kind}: {k['requests']:,} requests" in printed
    assert art.buckets != default_bucket_table(art.limits)

    class Runtime:
        name = "python"

    pb2 = proto_gen.load().pb2
    info = model_info(pb2, str(out), art, Runtime())
    assert info.bucket_origin.source == "traffic log" and info.bucket_origin.log_sha256 == origin["log_sha256"]
    assert {p.kind: (p.requests, p.batches, round(p.packed, 4)) for p in info.bucket_origin.padding} == \
        {kind: (k["requests"], k["packed"]["batches"], k["packed"]["padding"]) for kind, k in origin["kinds"].items()}
    summary = info_summary(info)
    assert "chosen for a traffic log: sha256 " + origin["log_sha256"][:16] in summary
    assert f"score {100 * origin['kinds']['score']['packed']['padding']:.1f}%" in summary
    assert [b.max_tokens for b in info.score_buckets] == [b.max_tokens for b in art.buckets.score]
    # a build without a log: the default table, and ModelInfo says so
    plain = load_artifact(cli_main(["build", "--model", "embedded:tiny", "--out", str(tmp_path / "d"), "--quiet"])
                          or tmp_path / "d")
    assert plain.manifest["bucket_origin"] == {"source": "default"}
    assert model_info(pb2, "d", plain, Runtime()).bucket_origin.source == "default"


@pytest.mark.parametrize("what, words", [
    ("missing", "cannot read it"),
    ("empty", "no Score or BeamSearch access records in 0 lines"),
    ("refused only", "no request of the log has its shape"),
    ("other limits", "max_beam_width 200 (this build: 400)"),
    ("over the limits", "requests of the log break this build's limits"),
    ("budget without a log", "bound a table chosen with --traffic"),
])
def test_a_bad_log_is_one_line_naming_it_and_exit_2(tmp_path: Path, capsys, what: str, words: str) -> None:
    path = tmp_path / "log.jsonl"
    records = synthetic_records(20, seed=1)
    if what == "empty":
        path.write_text("")
    elif what == "refused only":
        write_log(path, [{k: v for k, v in r.items() if k in ("logger", "method", "kind", "code", "arrival_s",
                                                              "latency_ms")} for r in records])
    elif what == "other limits":
        import dataclasses
        write_log(path, records, dataclasses.replace(LIMITS, max_beam_width=200))
    elif what == "over the limits":
        big = dict(records[0], kind="score", method="Score", samples=70, sample_tokens=[2] * 70, prefix_tokens=0,
                   tokens=140, labels=2)
        write_log(path, records + [big], limits=None)
    elif what != "missing":
        write_log(path, records)
    flags = ["--max-graphs", "20"] if what == "budget without a log" else ["--traffic", str(path)]
    rc = cli_main(["build", "--model", "embedded:tiny", "--out", str(tmp_path / "o"), "--quiet", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith("slmrank build: error: "), err
    if what != "budget without a log":
        assert str(path) in err and not (tmp_path / "o" / "manifest.msgpack").exists()
    if what == "other limits":
        assert "--max-beam-width 200" in err
