"""service/loadgen without a server: the capacity at the SLO on synthetic levels, the Poisson
arrivals, the workloads' mixes and request files, the shape for the FLOPs, the flags' checks, the
report's files and the PNG writer."""

from __future__ import annotations

import csv
import json
import math
import random
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from service.loadgen import loop, png, report
from service.loadgen.command import check, model_config, served_config
from service.loadgen.workloads import (BEAM_MIX, SCORE_MIX, Requests, WorkloadError, file_requests,
                                       message_flops, parse_workload)
from service.model.checkpoint import EMBEDDED
from service.model.flops import beam_flops, score_flops


def row(level: int, qps: float, mean: float, p99: float, errors: int = 0, completed: int = 100) -> dict:
    return {"mode": "closed", "level": level, "rate": None, "qps": qps, "mean_ms": mean, "p99_ms": p99,
            "completed": completed, "num_errors": errors}


# ---- the capacity at the SLO ----------------------------------------------------------------------------

def test_capacity_is_the_highest_qps_of_a_level_within_the_slo() -> None:
    levels = [row(1, 100, 5, 10), row(2, 180, 9, 30), row(4, 300, 19.9, 79.9), row(8, 400, 25, 60),
              row(16, 420, 15, 95), row(32, 500, 15, 50, errors=50)]
    cap = loop.capacity(levels)
    # level 8 (mean over), 16 (P99 over), 32 (errors) have more QPS: none of them is the capacity
    assert cap is not None and cap["level"] == 4 and cap["qps"] == 300
    assert loop.capacity(levels, slo_mean_ms=30, slo_p99_ms=100)["level"] == 16  # the SLO is the flags'
    assert loop.capacity(levels, max_error_share=0.5)["level"] == 32
    # the bounds are strict; NaN (nothing completed) never holds; nothing within: None
    assert loop.capacity([row(1, 50, 20.0, 10), row(2, 60, 10, 80.0)]) is None
    assert loop.capacity([row(1, 0, math.nan, math.nan, completed=0)]) is None
    assert loop.capacity([]) is None


def test_a_level_over_the_slo_is_never_the_capacity() -> None:
    rng = random.Random(5)
    for _ in range(300):
        levels = [row(2 ** i, rng.uniform(0, 1000), rng.uniform(0, 40), rng.uniform(0, 160),
                      errors=rng.choice([0, 0, 0, 1, 30])) for i in range(rng.randint(1, 8))]
        cap = loop.capacity(levels)
        ok = [r for r in levels if r["mean_ms"] < 20 and r["p99_ms"] < 80
              and r["num_errors"] <= 0.001 * (r["completed"] + r["num_errors"])]
        if not ok:
            assert cap is None
        else:
            best = next(r for r in levels if r["level"] == cap["level"])
            assert best in ok and cap["qps"] == max(r["qps"] for r in ok)


# ---- Poisson arrivals -----------------------------------------------------------------------------------

def test_poisson_gaps_are_seeded_with_the_rates_mean() -> None:
    take = lambda it, n: [next(it) for _ in range(n)]  # noqa: E731
    gaps = np.array(take(loop.arrivals(50.0, seed=(7, 0)), 40000))
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.02)
    # exponential: its standard deviation equals its mean (evenly spaced arrivals would have none),
    # and P(gap > mean) = 1/e
    assert gaps.std() == pytest.approx(1 / 50, rel=0.03)
    assert (gaps > 1 / 50).mean() == pytest.approx(math.exp(-1), abs=0.01)
    assert take(loop.arrivals(50.0, (7, 0)), 5000) == gaps[:5000].tolist()  # the same seed: the same gaps
    assert take(loop.arrivals(50.0, (7, 1)), 10) != gaps[:10].tolist()
    assert np.mean(take(loop.arrivals(2.0, 1), 20000)) == pytest.approx(0.5, rel=0.03)


# ---- workloads ------------------------------------------------------------------------------------------

LIMITS = SimpleNamespace(max_prompt_tokens=1024, max_beam_width=400, max_new_tokens=5, max_samples=64,
                         max_score_tokens=2048, max_labels=16)


def test_the_score_mix_draws_within_its_ranges() -> None:
    reqs = Requests(parse_workload("score-mix"), 1000, seed=1)
    msgs = [reqs.next() for _ in range(600)]
    counts = [len(m.samples) for m in msgs]
    lens = [len(s.ids) for m in msgs for s in m.samples]
    prefixes = [len(m.prefix.ids) for m in msgs if m.prefix.ids]
    assert min(counts) == SCORE_MIX["samples"][0] and max(counts) == SCORE_MIX["samples"][1]
    assert min(lens) == SCORE_MIX["len"][0] and max(lens) == SCORE_MIX["len"][1]
    assert SCORE_MIX["prefix"][0] <= min(prefixes) and max(prefixes) <= SCORE_MIX["prefix"][1]
    assert len(prefixes) / len(msgs) == pytest.approx(0.5, abs=0.07)
    assert all(list(m.label_ids) == list(msgs[0].label_ids) and len(m.label_ids) == 2 for m in msgs)
    assert all(0 <= i < 1000 for m in msgs[:20] for s in m.samples for i in s.ids)
    again = Requests(parse_workload("score-mix"), 1000, seed=1)
    assert [again.next().SerializeToString() for _ in range(20)] == [m.SerializeToString() for m in msgs[:20]]


def test_a_mix_keeps_to_the_servers_limits() -> None:
    reqs = Requests(parse_workload("score-mix"), 1000, seed=2, limits=LIMITS)
    msgs = [reqs.next() for _ in range(300)]
    totals = [len(m.prefix.ids) + sum(len(s.ids) for s in m.samples) for m in msgs]
    assert max(totals) <= 2048 and max(totals) > 1500  # drawn again when over, not clipped to short ones
    tight = SimpleNamespace(**{**vars(LIMITS), "max_beam_width": 50, "max_prompt_tokens": 100})
    beams = Requests(parse_workload("beam-mix"), 1000, seed=2, limits=tight)
    got = [beams.next() for _ in range(200)]
    assert max(m.beam_width for m in got) <= 50 and max(len(m.prompt.ids) for m in got) <= 100
    impossible = SimpleNamespace(**{**vars(LIMITS), "max_new_tokens": 2})  # beam-mix asks 3..5
    with pytest.raises(WorkloadError, match="beam-mix.*limits"):
        Requests(parse_workload("beam-mix"), 1000, seed=2, limits=impossible).next()


def test_the_beam_and_mixed_mixes() -> None:
    reqs = Requests(parse_workload("beam-mix"), 1000, seed=3)
    msgs = [reqs.next() for _ in range(400)]
    for field, key in ((lambda m: len(m.prompt.ids), "prompt"), (lambda m: m.beam_width, "beam"),
                       (lambda m: m.new_tokens, "new")):
        values = [field(m) for m in msgs]
        lo, hi = BEAM_MIX[key]
        assert lo <= min(values) < lo + 0.05 * (hi - lo) + 1 and hi - 0.05 * (hi - lo) - 1 < max(values) <= hi, key
    mixed = Requests(parse_workload("mixed"), 1000, seed=3)
    kinds = [hasattr(mixed.next(), "samples") for _ in range(2000)]
    assert np.mean(kinds) == pytest.approx(0.75, abs=0.03)  # 3 Score : 1 BeamSearch


def test_parse_workload_names_the_mistake() -> None:
    assert parse_workload("W5")["beam"] == 400 and parse_workload("mixed")["kind"] == "mix"
    assert parse_workload("beam,prompt=16")["beam"] == 100
    for bad, what in (("W9", "is not W1..W8, W7u, W8u, W7c, W8c"), ("score,foo=1", "unknown key 'foo'"), ("beam,beam=x", "not an integer"),
                      ("score,samples=0", "samples must be >= 1")):
        with pytest.raises(WorkloadError, match=what):
            parse_workload(bad)


def test_a_request_file_becomes_messages_and_a_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"id": 1, "kind": "score", "prefix_ids": [4], "samples": [[1, 2], [3]], "label_ids": [9]}\n\n'
                    '{"kind": "beam", "prompt_ids": [5, 6, 7], "beam_width": 3, "new_tokens": 2}\n')
    score, beam = file_requests(path)
    assert [list(s.ids) for s in score.samples] == [[1, 2], [3]] and list(score.prefix.ids) == [4]
    assert list(score.label_ids) == [9]
    assert list(beam.prompt.ids) == [5, 6, 7] and (beam.beam_width, beam.new_tokens) == (3, 2)
    # label texts as slmrank run takes them: sent as the message's label_texts, for the server to tokenize
    path.write_text('{"kind": "score", "samples": [[1, 2]], "label_texts": [" yes", " no"]}\n'
                    '{"kind": "score", "samples": [[3]], "label_ids": [7]}\n')
    texts, ids = file_requests(path)
    assert list(texts.label_texts) == [" yes", " no"] and list(texts.label_ids) == []
    assert list(ids.label_ids) == [7] and list(ids.label_texts) == []  # a line's texts do not carry to the next
    for bad, what in (('"label_texts": [" yes"], "label_ids": [1]', "line 1: label_texts: both"),
                      ('"label_texts": [1]', "line 1: label_texts: must be a list of strings")):
        path.write_text('{"kind": "score", "samples": [[1]], ' + bad + '}\n')
        with pytest.raises(WorkloadError, match=what):
            file_requests(path)
    path.write_text('{"kind": "score", "samples": [[1]]}\n{"kind": "score", "samples": [["x"]]}\n')
    with pytest.raises(WorkloadError, match=r"line 2: samples\[0\]\[0\]"):
        file_requests(path)
    path.write_text('{"kind": "beam", "prompt_ids": [1], "beam_width": 2}\n')
    with pytest.raises(WorkloadError, match="line 1: new_tokens: must be an integer"):
        file_requests(path)
    path.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no request"):
        file_requests(path)
    with pytest.raises(WorkloadError, match="cannot read"):
        file_requests(tmp_path / "missing.jsonl")


def test_a_pool_counts_each_requests_flops() -> None:
    cfg = EMBEDDED["qwen3-0.6b"].config
    reqs = Requests(parse_workload("mixed"), 1000, seed=4)
    msgs = [reqs.next() for _ in range(40)]
    pool = loop.Pool(msgs, cfg, priority="online")
    for entry, msg in zip(pool.entries, msgs):
        want = (score_flops(cfg, len(msg.prefix.ids), [len(s.ids) for s in msg.samples]) if entry.method == "Score"
                else beam_flops(cfg, len(msg.prompt.ids), msg.beam_width, msg.new_tokens))
        assert entry.flops == want == message_flops(cfg, msg)
        assert type(msg).FromString(entry.payload).priority == 1  # ONLINE
    assert [pool.next() for _ in range(41)][40] is pool.entries[0]  # cycled
    assert loop.Pool(msgs).describe()["mean_flops"] is None  # no shape: no FLOPs
    with pytest.raises(ValueError, match="--priority"):
        loop.Pool(msgs, priority="urgent")


# ---- the model's shape for the FLOPs --------------------------------------------------------------------

def info(**kw):
    base = dict(model="/models/on/the/server", arch="qwen3", num_layers=28, hidden_size=1024, vocab_size=151669,
                num_labels=0)
    return SimpleNamespace(**{**base, **kw})


def test_the_served_shape_from_model_info() -> None:
    cfg, where = served_config(info(model="embedded:tiny", arch="qwen2", num_layers=2, hidden_size=128), None)
    assert cfg == EMBEDDED["tiny"].config and "ModelInfo.model" in where
    # a path only the server has: the embedded spec of the same architecture, layers and width
    cfg, where = served_config(info(num_labels=3), None)
    assert (cfg.num_heads, cfg.intermediate_size, cfg.vocab_size, cfg.num_labels) == (16, 3072, 151669, 3)
    assert "embedded:qwen3-0.6b" in where
    cfg, where = served_config(info(hidden_size=999), None)
    assert cfg is None and "--model" in where
    cfg, where = served_config(info(hidden_size=999), "embedded:qwen3-1.7b")
    assert cfg.hidden_size == 2048 and where == "--model embedded:qwen3-1.7b"
    with pytest.raises(ValueError, match="--model"):
        served_config(info(), "/no/such/dir")


def test_check_names_the_flag() -> None:
    def args(**kw) -> Namespace:
        base = dict(measure_s=10.0, warmup_s=2.0, slo_mean_ms=20.0, slo_p99_ms=80.0, rpc_timeout_s=60.0,
                    stop_above_ms=2000.0, peak_tflops=989.0, connections=4, pool=512, levels=None, rate=None,
                    refine=0)
        return Namespace(**{**base, **kw})

    ok = args()
    check(ok)
    assert ok.level_list == [1, 2, 4, 8, 16, 32, 64] and ok.rate_list is None
    ok = args(rate="5,10.5")
    check(ok)
    assert ok.rate_list == [5.0, 10.5] and ok.level_list is None
    for kw, flag in ((dict(levels="1,x"), "--levels"), (dict(levels="0"), "--levels"), (dict(rate="-1"), "--rate"),
                     (dict(measure_s=0), "--measure-s"), (dict(warmup_s=-1), "--warmup-s"),
                     (dict(connections=0), "--connections"), (dict(slo_p99_ms=0), "--slo-p99-ms"),
                     (dict(refine=-1), "--refine"), (dict(refine=2, rate="5"), "--refine")):
        with pytest.raises(ValueError, match=flag):
            check(args(**kw))


def test_refine_bisects_between_the_last_level_held_and_the_first_over() -> None:
    holds = lambda r: loop.within_slo(r, 20.0, 80.0, loop.MAX_ERROR_SHARE)  # noqa: E731
    rows = [row(4, 300, 12.0, 20.0), row(8, 350, 23.0, 34.0), row(16, 370, 43.0, 58.0)]
    assert loop.refine_level(rows, holds) == 6
    assert loop.refine_level(rows + [row(6, 340, 19.0, 30.0)], holds) == 7
    assert loop.refine_level(rows + [row(6, 340, 21.0, 30.0)], holds) == 5
    assert loop.refine_level(rows + [row(6, 340, 21.0, 30.0), row(5, 330, 19.9, 30.0)], holds) is None
    assert loop.refine_level([row(4, 300, 12.0, 20.0), row(8, 350, 18.0, 90.0)], holds) == 6  # P99 over at 8
    assert loop.refine_level([row(1, 30, 12.0, 20.0), row(2, 60, 15.0, 20.0)], holds) is None  # all held
    assert loop.refine_level([row(4, 300, 25.0, 40.0)], holds) == 2  # none held: below the first level
    assert loop.refine_level([row(1, 300, 25.0, 40.0)], holds) is None


def test_a_refined_sweep_measures_the_bisected_levels_and_returns_them_in_order(monkeypatch) -> None:
    """sweep(refine=2) over a server whose mean latency is 2.6 ms a request in flight (fake levels):
    levels 4, 8, 16 then 6 (held: 15.6 ms) and 7 (held: 18.2 ms); the capacity is level 7's."""
    import asyncio

    measured: list[int] = []

    async def fake_level(channels, pool, level, *args) -> dict:
        measured.append(level)
        return row(level, 100.0 * level, 2.6 * level, 3.0 * level)

    monkeypatch.setattr(loop, "open_channels", lambda *a: [])
    monkeypatch.setattr(loop, "closed_level", fake_level)
    holds = lambda r: loop.within_slo(r, 20.0, 80.0, loop.MAX_ERROR_SHARE)  # noqa: E731
    seen: list[int] = []
    out = asyncio.run(loop.sweep("x", None, levels=[4, 8, 16], refine=2, holds=holds,
                                 on_level=lambda r: seen.append(r["level"])))
    assert measured == seen == [4, 8, 16, 6, 7]
    assert [r["level"] for r in out["levels"]] == [4, 6, 7, 8, 16]
    assert loop.capacity(out["levels"])["level"] == 7
    with pytest.raises(ValueError, match="refine"):
        asyncio.run(loop.sweep("x", None, rates=[5.0], refine=1, holds=holds))


# ---- the report and the PNGs ----------------------------------------------------------------------------

def synthetic_result() -> dict:
    levels = []
    for level, qps, mean, p99 in ((1, 100.0, 5.0, 9.0), (2, 190.0, 8.0, 30.0), (4, 230.0, 30.0, 120.0)):
        lat = list(np.random.default_rng(level).gamma(4.0, mean / 4, 500))
        r = {"mode": "closed", "level": level, "rate": None, "qps": qps, "completed": 500,
             **loop.latency_summary(lat), "errors": {"UNAVAILABLE": 3} if level == 4 else {},
             "num_errors": 3 if level == 4 else 0, "sent": 510, "not_sent": 0, "flops_per_s": qps * 1e12,
             "client_cpu": 0.3, "histogram": loop.histogram(sorted(lat)), "server": None}
        r["mean_ms"], r["p99_ms"] = mean, p99
        r["within_slo"] = loop.within_slo(r, 20, 80, 0.001)
        levels.append(r)
    levels.append({**levels[-1], "level": 8, "completed": 0, "qps": 0.0, **loop.latency_summary([]),
                   "histogram": loop.histogram([]), "within_slo": False})
    cap = loop.capacity(levels)
    return {"workload": {"name": "W1"}, "mode": "closed", "levels": levels, "skipped_levels": [16],
            "stop_above_ms": 2000.0, "capacity": cap, "slo": {"mean_ms": 20.0, "p99_ms": 80.0},
            "peak_flops": 989e12, "eff_mfu": cap["flops_per_s"] / 989e12}


def test_the_report_files_and_table(tmp_path: Path) -> None:
    result = synthetic_result()
    written = report.write(tmp_path / "out", result)
    assert [p.name for p in written] == ["bench.json", "bench.csv", "latency_vs_load.png", "latency_histogram.png"]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())  # strict JSON: NaN as null
    assert data["levels"][3]["mean_ms"] is None and data["capacity"]["level"] == 2
    with (tmp_path / "out" / "bench.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["level"] for r in rows] == ["1", "2", "4", "8"] and rows[2]["errors"] == "UNAVAILABLE=3"
    assert float(rows[1]["eff_mfu"]) == pytest.approx(190e12 / 989e12)
    assert [r["within_slo"] for r in rows] == ["True", "True", "False", "False"]
    text = report.table(result)
    assert "capacity at mean < 20 ms, P99 < 80 ms: 190.0 req/s at level 2" in text
    assert "effective MFU 19.21% of 989 TFLOPS" in text
    assert "errors at 4: UNAVAILABLE 3" in text and "skipped" in text and "16" in text
    assert report.table({**result, "capacity": None, "eff_mfu": None}).count("none within the SLO") == 1

    chart = png.read_png((tmp_path / "out" / "latency_vs_load.png").read_bytes())
    colors = set(chart.get(x, y) for x in range(0, chart.width, 2) for y in range(0, chart.height, 2))
    assert set(png.PALETTE[:4]) <= colors  # mean, P50, P90, P99 drawn
    hist = png.read_png((tmp_path / "out" / "latency_histogram.png").read_bytes())
    colors = set(hist.get(x, y) for x in range(hist.width) for y in range(hist.height))
    assert set(png.PALETTE[:3]) <= colors and png.PALETTE[3] not in colors  # the 3 levels that completed RPCs


def test_histogram_buckets() -> None:
    h = loop.histogram([0.05, 1.0, 1.1, 50.0, 1e7])
    assert sum(h["counts"]) == 5 and len(h["edges_ms"]) == len(h["counts"]) + 1
    assert h["counts"][0] == 1 and h["counts"][-1] == 1  # the ends catch what is outside
    i = next(k for k, e in enumerate(h["edges_ms"]) if e > 1.1) - 1
    assert h["edges_ms"][i] <= 1.0 and h["counts"][i] == 2


def test_png_writer_round_trips_and_draws_text(tmp_path: Path) -> None:
    c = png.Canvas(40, 20)
    c.rect(2, 2, 5, 4, (1, 2, 3))
    c.text(10, 5, "P99", (200, 0, 0))
    back = png.read_png(c.png())
    assert (back.width, back.height) == (40, 20) and back.pixels == c.pixels
    assert back.get(3, 3) == (1, 2, 3) and back.get(0, 0) == png.WHITE
    inked = [(x, y) for x in range(40) for y in range(20) if back.get(x, y) == (200, 0, 0)]
    assert inked and min(x for x, _ in inked) >= 10 and max(x for x, _ in inked) < 10 + png.text_width("P99")
    assert all(len(rows) == 7 and all(len(r) == 5 for r in rows) for rows in png.FONT.values())
    assert png.linear_ticks(0, 1000) == [0, 200, 400, 600, 800, 1000]
    assert png.log_ticks(1, 100) == [1, 2, 5, 10, 20, 50, 100]


def test_a_mixed_level_reports_each_kind_on_its_own() -> None:
    """A mix's level keeps each method's latencies apart (one kind starving the other shows), and
    the table prints them only where a level saw more than one kind."""
    window = loop.Window("level 2", warmup_s=0.0, measure_s=1e6)
    score, beam = loop.Entry("Score", b"", 10), loop.Entry("BeamSearch", b"", 30)
    t0 = window.t_start
    for i in range(30):
        window.record(score, t0, t0 + 0.005 + i * 1e-4, "OK")
    for i in range(10):
        window.record(beam, t0, t0 + 0.050 + i * 1e-3, "OK")
    window.record(beam, t0, t0 + 0.5, "UNAVAILABLE")
    measured = {"client_cpu": 0.1, "scraped": (None, None)}
    r = loop._result(window, measured, 2.0, 0.0, 0.0, mode="closed", level=2, rate=None)
    kinds = r["by_method"]
    assert set(kinds) == {"Score", "BeamSearch"} and kinds["Score"]["completed"] == 30
    assert kinds["BeamSearch"]["completed"] == 10 and kinds["BeamSearch"]["qps"] == 5.0
    assert kinds["Score"]["max_ms"] < 10 < 50 <= kinds["BeamSearch"]["mean_ms"]  # each its own, not the mix's
    assert r["completed"] == 40 and r["num_errors"] == 1
    r["within_slo"] = loop.within_slo(r, 20, 80, 0.001)
    result = {**synthetic_result(), "levels": [r]}
    assert "by kind at 2: BeamSearch 5.0 req/s, mean 54.50 / P99" in report.table(result)
    one_kind = synthetic_result()
    assert "by kind" not in report.table(one_kind)


def test_the_table_shows_the_server_s_view_of_a_level() -> None:
    """With --metrics, a level's line of the server's own view: requests per batch (what issue 27 asks
    at each level) and each stage's mean; without it, no such line."""
    from service.loadgen.server_view import server_breakdown

    stage = 'slmrank_request_stage_seconds_{}'
    before = {("slmrank_node_batches_total", 'node="beam"'): 10.0, ("slmrank_event_loop_cpu_seconds_total", ""): 1.0}
    after = {("slmrank_node_batches_total", 'node="beam"'): 30.0, ("slmrank_event_loop_cpu_seconds_total", ""): 2.5,
             (stage.format("sum"), 'stage="queue"'): 0.3, (stage.format("count"), 'stage="queue"'): 60.0,
             (stage.format("sum"), 'stage="execute"'): 0.9, (stage.format("count"), 'stage="execute"'): 60.0}
    result = synthetic_result()
    result["levels"][1]["server"] = server_breakdown(before, after, requests=60, window_s=3.0)
    text = report.table(result)
    assert "server at 2: 3.0 requests/batch (20 batches), queue 5.00, execute 15.00 ms a request; event loop busy 50%" in text
    assert text.count("server at") == 1 and "server at" not in report.table(synthetic_result())


def test_a_checkpoints_config_is_read_within_its_bound(tmp_path: Path) -> None:
    """`slmrank bench --model DIR` reads config.json as the server does: a valid one is the model's
    config; one larger than a config can be is refused unread."""
    from service.model.config import ConfigError
    from service.model.files import MAX_JSON_BYTES

    hf = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert model_config(str(tmp_path)).vocab_size == 512
    (tmp_path / "config.json").write_text(json.dumps({**hf, "padding": " " * MAX_JSON_BYTES}))
    with pytest.raises(ConfigError, match="bytes is more than such a file can be"):
        model_config(str(tmp_path))
