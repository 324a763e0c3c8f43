"""`slmrank traffic LOG` (service/loadgen/traffic.py) on synthetic access logs: its percentiles,
arrivals per second, requests and tokens in flight and padding against counts made here another
way; malformed lines named by number; an unreadable log one line and exit 2; 100,000 requests
read and reported within 10 s on the CI machine."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest

from service.artifact.buckets import default_bucket_table
from service.cli import main as cli_main
from service.loadgen import traffic
from service.loadgen.png import read_png
from service.model.config import ServingLimits

LIMITS = ServingLimits()
T0 = 1_790_000_000.0


def synthetic_records(n: int, seed: int = 0, rate: float = 250.0) -> list[dict]:
    """Access records of n requests, half Score (5-30 samples of 8-160 tokens, half with a prefix of
    32-256 tokens, within the limits), half BeamSearch (prompt 32-480, a common beam width of
    20-200, 3-5 new tokens), Poisson arrivals at `rate`, latencies of 2-60 ms; some refused
    before decoding (no shape)."""
    rng = random.Random(seed)
    t, out = T0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        rec = {"ts": "2026-09-21T14:13:20.000Z", "level": "info", "logger": "slmrank.access", "msg": "m",
               "code": "OK", "arrival_s": round(t, 3), "latency_ms": round(rng.uniform(2, 60), 3), "priority": "NORMAL",
               "peer": "ipv4:127.0.0.1:5000"}
        score = rng.random() < 0.5
        rec.update(method="Score", kind="score") if score else rec.update(method="BeamSearch", kind="beam")
        if rng.random() < 0.03:
            rec["code"] = "UNAVAILABLE"  # refused on its shape before decoding: no dims
        elif score:
            while True:
                lens = [rng.randint(8, 160) for _ in range(rng.randint(5, 30))]
                prefix = rng.randint(32, 256) if rng.random() < 0.5 else 0
                if prefix + sum(lens) <= LIMITS.max_score_tokens:
                    break
            rec.update(samples=len(lens), sample_tokens=lens, prefix_tokens=prefix, tokens=prefix + sum(lens), labels=2)
        else:
            p = rng.randint(32, 480)
            rec.update(prompt_tokens=p, beam_width=rng.choice((20, 32, 50, 64, 100, 128, 200)),
                       new_tokens=rng.randint(3, 5), tokens=p)
        out.append(rec)
    return out


def write_log(path: Path, records: list[dict], limits: ServingLimits | None = LIMITS) -> Path:
    with path.open("w") as fh:
        if limits is not None:
            fh.write(json.dumps({"ts": "x", "level": "info", "logger": "slmrank.server", "msg": "model loaded in 1.0 s: "
                                 "SERVING", "model": "embedded:qwen3-0.6b", "limits": limits.to_dict()}) + "\n")
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    return path


def nearest_rank(values: list, q: float):
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    records = synthetic_records(600, seed=3, rate=40.0)
    path = write_log(tmp_path_factory.mktemp("traffic") / "log.jsonl", records)
    return records, traffic.run(str(path))


def test_percentiles_equal_numpy_and_the_nearest_rank(small) -> None:
    records, report = small
    valid = {"score": [r for r in records if r["kind"] == "score" and "samples" in r],
             "beam": [r for r in records if r["kind"] == "beam" and "prompt_tokens" in r]}
    expected = {
        "score": {"samples": [r["samples"] for r in valid["score"]],
                  "sample_tokens": [n for r in valid["score"] for n in r["sample_tokens"]],
                  "tokens": [r["prefix_tokens"] + sum(r["sample_tokens"]) for r in valid["score"]],
                  "prefix_tokens": [r["prefix_tokens"] for r in valid["score"]],
                  "labels": [r["labels"] for r in valid["score"]]},
        "beam": {"prompt_tokens": [r["prompt_tokens"] for r in valid["beam"]],
                 "beam_width": [r["beam_width"] for r in valid["beam"]],
                 "new_tokens": [r["new_tokens"] for r in valid["beam"]],
                 "beam_rows": [r["beam_width"] * r["new_tokens"] for r in valid["beam"]]}}
    for kind, dims in expected.items():
        k = report["kinds"][kind]
        assert k["valid"] == len(valid[kind]) and k["requests"] == sum(r["kind"] == kind for r in records)
        assert k["codes"]["UNAVAILABLE"] == k["requests"] - k["valid"] > 0
        for name, values in dims.items():
            got = k["dims"][name]
            want = np.percentile(np.asarray(values), [50, 95, 99], method="inverted_cdf")
            assert [got["p50"], got["p95"], got["p99"]] == want.tolist(), (kind, name)
            assert [got[f"p{q}"] for q in (50, 95, 99)] == [nearest_rank(values, q) for q in (50, 95, 99)]
            assert (got["max"], got["n"]) == (max(values), len(values)), (kind, name)
        assert len(set(dims[next(iter(dims))])) > 1, "the log's shapes do not vary"


def test_arrivals_per_second_equal_a_count_of_each_second(small) -> None:
    records, report = small
    origin = math.floor(min(r["arrival_s"] for r in records))
    assert report["origin_s"] == origin
    for kind in ("score", "beam"):
        counts = report["kinds"][kind]["arrivals_per_second"]["counts"]
        brute = [0] * report["seconds"]
        for r in records:
            if r["kind"] == kind:
                brute[int(math.floor(r["arrival_s"])) - origin] += 1
        assert counts == brute and sum(counts) == report["kinds"][kind]["requests"]
        assert max(counts) == report["kinds"][kind]["arrivals_per_second"]["max"]


def test_in_flight_equals_a_count_over_every_pair(small) -> None:
    records, report = small
    for kind, weight in (("score", "tokens"), ("beam", "prompt_tokens")):
        rs = [r for r in records if r["kind"] == kind and "tokens" in r]
        requests, tokens = [], []
        for r in rs:
            live = [o for o in rs if o["arrival_s"] <= r["arrival_s"] < o["arrival_s"] + o["latency_ms"] / 1e3]
            requests.append(len(live))
            tokens.append(sum(o["tokens"] for o in live))
        got = report["kinds"][kind]["in_flight"]
        for name, values in (("requests", requests), (weight, tokens)):
            assert [got[name][q] for q in ("p50", "p95", "max")] == \
                [nearest_rank(values, 50), nearest_rank(values, 95), max(values)], (kind, name)
        assert max(requests) > 1, "nothing overlapped: the check checks nothing"


def test_padding_equals_the_packed_buffers_of_each_request_alone(small, tmp_path: Path) -> None:
    """Brute force: each request alone, in the bucket the packer picks, packed: the rows of its
    packed buffers against its own tokens and beam rows."""
    from service.runtime.batch import pack_beam, pack_score, pick_beam_bucket, pick_score_bucket
    from service.runtime.requests import BeamRequest, ScoreRequest

    records, report = small
    table = default_bucket_table(LIMITS)
    rng = random.Random(5)
    score = {"token_rows": [0, 0], "head_rows": [0, 0]}
    beam = {"beam_rows": [0, 0], "prompt_tokens": [0, 0]}
    for r in records:
        if r["kind"] == "score" and "samples" in r:
            req = ScoreRequest(tuple(tuple(rng.randrange(1000) for _ in range(n)) for n in r["sample_tokens"]),
                               (1, 2), tuple(rng.randrange(1000) for _ in range(r["prefix_tokens"])))
            inputs = pack_score([req], pick_score_bucket(table, [req]), 2).inputs
            seg = inputs["seg"]
            score["token_rows"][0] += seg.numel()
            score["token_rows"][1] += int((seg >= 0).sum())
            score["head_rows"][0] += inputs["last"].numel()
            score["head_rows"][1] += len(r["sample_tokens"])
        elif r["kind"] == "beam" and "prompt_tokens" in r:
            req = BeamRequest(tuple(rng.randrange(1000) for _ in range(r["prompt_tokens"])), r["beam_width"],
                              r["new_tokens"])
            inputs = pack_beam([req], pick_beam_bucket(table, [req])).inputs
            beam["beam_rows"][0] += inputs["beam_pos"].numel() * r["new_tokens"]  # packed beam rows, every step
            beam["beam_rows"][1] += r["beam_width"] * r["new_tokens"]
            beam["prompt_tokens"][0] += inputs["tokens"].numel()
            beam["prompt_tokens"][1] += r["prompt_tokens"]
    for kind, brute in (("score", score), ("beam", beam)):
        (got,) = report["kinds"][kind]["padding"].values()
        assert got["not_held"] == 0 and got["requests"] == report["kinds"][kind]["valid"]
        for name, (padded, real) in brute.items():
            assert (got[name]["padded"], got[name]["real"]) == (padded, real), (kind, name)
            assert padded > real, (kind, name)
    # the same table named as a model: the default table of its default limits, the same padding
    path = write_log(tmp_path / "log.jsonl", records, limits=None)
    again = traffic.run(str(path), ["embedded:qwen3-0.6b"])
    assert again["tables"] == ["default table of embedded:qwen3-0.6b"]
    for kind in ("score", "beam"):
        assert list(again["kinds"][kind]["padding"].values()) == list(report["kinds"][kind]["padding"].values())


def test_the_command_prints_the_report_and_writes_json_and_png(tmp_path: Path, capsys) -> None:
    path = write_log(tmp_path / "log.jsonl", synthetic_records(200, seed=9, rate=20.0))
    rc = cli_main(["traffic", str(path), "--json", str(tmp_path / "r.json"), "--png", str(tmp_path / "a.png")])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["requests"] == 200 and set(report["kinds"]) == {"score", "beam"}
    for text in ("Score:", "BeamSearch:", "tokens / sample", "beam width", "arrivals/s", "in flight",
                 "padding, each request alone", "arrivals per second over time"):
        assert text in out, text
    png = read_png((tmp_path / "a.png").read_bytes())
    assert (png.width, png.height) == (900, 540)


def test_malformed_lines_are_named_by_number_and_left_out(tmp_path: Path, capsys) -> None:
    good = synthetic_records(4, seed=1)
    for r in good:
        r["code"] = "OK"
        r.update(kind="beam", method="BeamSearch", prompt_tokens=40, beam_width=8, new_tokens=2)
    lines = [json.dumps(good[0]), '{"logger": "slmrank.access", "kind": "score", "arrival',  # line 2: cut short
             json.dumps(good[1]), json.dumps({**good[2], "beam_width": "wide"}),  # line 4: a bad field
             "2026-12-01T03:40:50.123Z INFO slmrank.access: Score OK 1.0 ms",  # line 5: a text line
             json.dumps({"logger": "slmrank.access", "method": "ModelInfo", "code": "OK", "arrival_s": T0,
                         "latency_ms": 1.0}),  # another method: skipped, not malformed
             json.dumps(good[3])]
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n")
    assert cli_main(["traffic", str(tmp_path / "log.jsonl"), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "r.json").read_text())
    assert [m["line"] for m in report["malformed"]] == [2, 4, 5]
    assert report["malformed"][1]["error"].startswith("beam_width:")
    assert "line 2: not JSON" in out and "line 4: beam_width" in out and "3 malformed lines left out" in out
    assert report["kinds"]["beam"]["valid"] == 3 and report["other_methods"] == {"ModelInfo": 1}
    assert "no bucket table" in out  # the log has no "model loaded" record


@pytest.mark.parametrize("what", ["missing", "directory", "text format"])
def test_an_unreadable_log_is_one_line_and_exit_2(tmp_path: Path, capsys, what: str) -> None:
    path = tmp_path / "log.jsonl"
    if what == "directory":
        path.mkdir()
    elif what == "text format":
        path.write_text("2026-12-01T03:40:50.123Z INFO slmrank.access: Score OK 1.0 ms method=Score\n")
    assert cli_main(["traffic", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("slmrank traffic: error: ") and "Traceback" not in err, err
    if what == "text format":
        assert "--log-format json" in err and "line 1" in err


def test_reads_100000_requests_within_10_s(tmp_path: Path) -> None:
    """The CI machine (2 cores, shared): the whole command but printing, torch already loaded."""
    import service.runtime.batch  # noqa: F401 -- the import is not the report's time

    records = synthetic_records(100_000, seed=7)
    path = write_log(tmp_path / "log.jsonl", records)
    start = time.monotonic()
    report = traffic.run(str(path))
    text = traffic.format_report(report)
    elapsed = time.monotonic() - start
    assert report["requests"] == 100_000 and not report["malformed"] and "BeamSearch:" in text
    valid = sum(k["valid"] for k in report["kinds"].values())
    assert valid == sum("tokens" in r for r in records)
    padding = [p for k in report["kinds"].values() for p in k["padding"].values()]
    assert len(padding) == 2 and sum(p["requests"] for p in padding) == valid
    assert elapsed <= 10.0, f"{elapsed:.1f} s for 100,000 requests"
