"""`slmrank traffic LOG`: the request distribution of a server's JSON access log.

The log is what `slmrank serve --access-log --log-format json` writes to stderr: one JSON object a
line. The access records (logger slmrank.access) of Score and BeamSearch give each request's
kind, arrival (wall clock), latency, status code and, once it was decoded and valid, its shape
(never its content); the server's "model loaded" record gives the model and its limits. Other
lines (other loggers, other methods) are skipped; a line that is not a JSON object, or an access
record with a bad field, is reported with its line number and left out.

Per kind the report gives p50/p95/p99/max of every shape dimension, arrivals per second over time
(as text, and as a PNG with --png), the requests and tokens in flight as each request arrives
(from arrival and latency), and the padding each bucket table would add to exactly those
requests, each alone in its smallest bucket (`table_padding`: the default table of the logged
model's limits, or the tables of `--bucket-table` artifacts or models). torch loads only for the
padding (the packer's bucket choice).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..observe.logs import ACCESS

SERVER_LOGGER = "slmrank.server"
METHOD_KINDS = {"Score": "score", "BeamSearch": "beam"}  # a record without `kind`: its method's
KINDS = ("score", "beam")
QUANTILES = (50, 95, 99)
# the shape dimensions, in report order: (key, what)
DIMS = {"score": (("samples", "samples / request"), ("sample_tokens", "tokens / sample"),
                  ("tokens", "tokens / request"), ("prefix_tokens", "prefix tokens / request"),
                  ("labels", "labels / request")),
        "beam": (("prompt_tokens", "prompt tokens"), ("beam_width", "beam width"), ("new_tokens", "new tokens"),
                 ("beam_rows", "beam rows (width x new tokens)"))}
SCORE_SHAPE = ("samples", "sample_tokens", "prefix_tokens", "labels")  # KindLog.shape's columns
BEAM_SHAPE = ("prompt_tokens", "beam_width", "new_tokens")
MAX_MALFORMED_SHOWN = 10
SPARK = " ▁▂▃▄▅▆▇█"


class TrafficError(ValueError):
    """The log has nothing to report (no access records): one line, exit 2."""


@dataclass
class KindLog:
    """One kind's requests, as columns. `arrival_s`/`codes` cover every record of the kind; the
    shape columns (and `valid_arrival_s`, `valid_latency_ms`) only those decoded and valid."""

    arrival_s: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    codes: Counter = field(default_factory=Counter)
    valid_arrival_s: list[float] = field(default_factory=list)
    valid_latency_ms: list[float] = field(default_factory=list)
    # score: samples, sample_tokens (a list each), prefix_tokens, labels; beam: prompt_tokens, beam_width, new_tokens
    shape: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def num_valid(self) -> int:
        return len(self.valid_arrival_s)


@dataclass
class TrafficLog:
    path: str
    num_lines: int = 0
    malformed: list[tuple[int, str]] = field(default_factory=list)  # (line number, why)
    kinds: dict[str, KindLog] = field(default_factory=lambda: {k: KindLog() for k in KINDS})
    other: Counter = field(default_factory=Counter)  # access records of other methods
    model: str | None = None  # of the last "model loaded" record
    limits: dict[str, int] | None = None
    num_starts: int = 0  # "model loaded" records
    sha256: str = ""  # of the file's bytes (read_log)

    @property
    def num_requests(self) -> int:
        return sum(len(k.arrival_s) for k in self.kinds.values())


# ---- reading -------------------------------------------------------------------------------------

class _Bad(Exception):
    pass


def _number(rec: dict[str, Any], key: str) -> float:
    v = rec.get(key)
    if type(v) not in (int, float) or not math.isfinite(v):
        raise _Bad(f"{key}: {'missing' if v is None else f'{v!r} is not a number'}")
    return float(v)


def _count(rec: dict[str, Any], key: str, lo: int, default: int | None = None) -> int:
    v = rec.get(key, default)
    if type(v) is not int or v < lo:
        raise _Bad(f"{key}: {'missing' if v is None else f'{v!r} is not an integer >= {lo}'}")
    return v


def _add_access(log: TrafficLog, rec: dict[str, Any]) -> None:
    kind = rec.get("kind")
    if kind is None:
        kind = METHOD_KINDS.get(rec.get("method"))  # type: ignore[arg-type]
        if kind is None:
            log.other[str(rec.get("method"))] += 1
            return
    if kind not in KINDS:
        raise _Bad(f"kind: {kind!r} is not one of {', '.join(KINDS)}")
    arrival, latency = _number(rec, "arrival_s"), _number(rec, "latency_ms")
    if latency < 0:
        raise _Bad(f"latency_ms: {latency!r} is negative")
    col = log.kinds[kind]
    if kind == "score" and "samples" in rec:
        samples = _count(rec, "samples", 1)
        lens = rec.get("sample_tokens")
        # (C-level checks: this runs for every Score line)
        if type(lens) is not list or len(lens) != samples or set(map(type, lens)) != {int} or min(lens) < 0:
            raise _Bad(f"sample_tokens: {'missing' if lens is None else 'not'} a list of {samples} token counts")
        shape = (samples, lens, _count(rec, "prefix_tokens", 0), _count(rec, "labels", 0, 0))
    elif kind == "beam" and "prompt_tokens" in rec:
        shape = (_count(rec, "prompt_tokens", 1), _count(rec, "beam_width", 1), _count(rec, "new_tokens", 1))
    else:
        shape = None  # refused or invalid before it was decoded: counted in arrivals and codes only
    code = rec.get("code")
    col.arrival_s.append(arrival)
    col.latency_ms.append(latency)
    col.codes[code if isinstance(code, str) else "?"] += 1
    if shape is not None:
        col.valid_arrival_s.append(arrival)
        col.valid_latency_ms.append(latency)
        if not col.shape:
            col.shape = {k: [] for k in (SCORE_SHAPE if kind == "score" else BEAM_SHAPE)}
        for values, v in zip(col.shape.values(), shape):
            values.append(v)


def parse_lines(lines: Sequence[bytes | str], path: str = "-") -> TrafficLog:
    """The records of a log's lines (numbered from 1)."""
    log = TrafficLog(path)
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        log.num_lines += 1
        try:
            rec = json.loads(line)
        except ValueError as e:  # also bytes that are not UTF-8
            log.malformed.append((n, f"not JSON ({e})"))
            continue
        if type(rec) is not dict:
            log.malformed.append((n, "not a JSON object"))
            continue
        logger = rec.get("logger")
        if logger == ACCESS:
            try:
                _add_access(log, rec)
            except _Bad as e:
                log.malformed.append((n, str(e)))
        elif logger == SERVER_LOGGER and isinstance(rec.get("limits"), dict):
            log.model, log.limits = str(rec.get("model") or ""), rec["limits"]
            log.num_starts += 1
    return log


def read_log(path: str | Path) -> TrafficLog:
    """Reads a JSON-lines log (OSError: unreadable); TrafficError when it has no Score or
    BeamSearch access record."""
    raw = Path(path).read_bytes()
    log = parse_lines(raw.split(b"\n"), str(path))
    log.sha256 = hashlib.sha256(raw).hexdigest()
    if not log.num_requests:
        shown = "; ".join(f"line {n}: {why}" for n, why in log.malformed[:1])
        raise TrafficError(f"{path}: no Score or BeamSearch access records in {log.num_lines} lines"
                           f"{f' ({shown})' if shown else ''}: the server writes them with --access-log "
                           "--log-format json")
    return log


# ---- statistics ----------------------------------------------------------------------------------

def percentiles(values: Any) -> dict[str, float | int]:
    """p50/p95/p99 (nearest rank: a value that occurred), max and mean; {} for none."""
    a = np.asarray(values)
    if not a.size:
        return {"n": 0}
    qs = np.percentile(a, QUANTILES, method="inverted_cdf")
    out: dict[str, float | int] = {"n": int(a.size)}
    as_int = a.dtype.kind in "iu"
    for q, v in zip(QUANTILES, qs):
        out[f"p{q}"] = int(v) if as_int else float(v)
    out["max"] = int(a.max()) if as_int else float(a.max())
    out["mean"] = round(float(a.mean()), 3)
    return out


def shape_columns(kind: str, col: KindLog) -> dict[str, np.ndarray]:
    """Every shape dimension of a kind's valid requests, as arrays (sample_tokens: one per sample)."""
    s = col.shape
    if kind == "score":
        samples = np.asarray(s.get("samples", []), dtype=np.int64)
        flat = np.fromiter(chain.from_iterable(s.get("sample_tokens", [])), dtype=np.int64, count=int(samples.sum()))
        prefix = np.asarray(s.get("prefix_tokens", []), dtype=np.int64)
        per_request = np.add.reduceat(flat, np.concatenate(([0], np.cumsum(samples)[:-1]))) if samples.size else \
            np.zeros(0, np.int64)
        return {"samples": samples, "sample_tokens": flat, "tokens": prefix + per_request, "prefix_tokens": prefix,
                "labels": np.asarray(s.get("labels", []), dtype=np.int64)}
    width = np.asarray(s.get("beam_width", []), dtype=np.int64)
    new = np.asarray(s.get("new_tokens", []), dtype=np.int64)
    return {"prompt_tokens": np.asarray(s.get("prompt_tokens", []), dtype=np.int64), "beam_width": width,
            "new_tokens": new, "beam_rows": width * new}


def _flight(arrival_s: np.ndarray, latency_ms: np.ndarray) -> tuple[np.ndarray, ...]:
    """(by arrival, by end, per request how many arrived by its arrival, how many ended by then)."""
    end_s = arrival_s + latency_ms / 1e3
    by_arrival, by_end = np.argsort(arrival_s, kind="stable"), np.argsort(end_s, kind="stable")
    arrived = np.searchsorted(arrival_s[by_arrival], arrival_s, side="right")  # j with arrival_j <= t
    ended = np.searchsorted(end_s[by_end], arrival_s, side="right")  # j with end_j <= t
    return by_arrival, by_end, arrived, ended


def requests_in_flight(arrival_s: np.ndarray, latency_ms: np.ndarray) -> np.ndarray:
    """As each request arrives, the requests in flight, itself included (in_flight)."""
    _, _, arrived, ended = _flight(arrival_s, latency_ms)
    return arrived - ended


def in_flight(arrival_s: np.ndarray, latency_ms: np.ndarray, weights: dict[str, np.ndarray]) -> dict[str, Any]:
    """What is in flight as each request arrives, itself included: request j is in flight at t
    when arrival_j <= t < arrival_j + latency_j. Per weight (requests: 1 each; tokens, ...), the
    sum over those requests, as percentiles over the arrivals."""
    if not arrival_s.size:
        return {}
    by_arrival, by_end, arrived, ended = _flight(arrival_s, latency_ms)
    out = {"requests": percentiles(arrived - ended)}
    for name, w in weights.items():
        cum_a = np.concatenate(([0], np.cumsum(w[by_arrival])))
        cum_e = np.concatenate(([0], np.cumsum(w[by_end])))
        out[name] = percentiles(cum_a[arrived] - cum_e[ended])
    return out


def arrivals_per_second(arrival_s: Sequence[float], origin: int, seconds: int) -> np.ndarray:
    """Requests arriving in each second [origin + i, origin + i + 1), i < seconds."""
    a = np.asarray(arrival_s, dtype=np.float64)
    idx = np.floor(a - origin).astype(np.int64)
    return np.bincount(idx, minlength=seconds)[:seconds]


# ---- padding -------------------------------------------------------------------------------------

def logged_requests(kind: str, col: KindLog) -> list[Any]:
    """The kind's valid requests in log order as ScoreRequest / BeamRequest objects with dummy token
    ids (what the packer and the buckets see of a request is its shape); one object per distinct
    shape, shared by the requests of that shape."""
    from ..runtime.requests import BeamRequest, ScoreRequest

    zeros: dict[int, tuple[int, ...]] = {}

    def z(n: int) -> tuple[int, ...]:
        t = zeros.get(n)
        if t is None:
            t = zeros[n] = (0,) * n
        return t

    cache: dict[Any, Any] = {}
    out = []
    s = col.shape
    if kind == "score":
        keys: Any = zip(s.get("prefix_tokens", []), map(tuple, s.get("sample_tokens", [])), s.get("labels", []))
    else:
        keys = zip(s.get("prompt_tokens", []), s.get("beam_width", []), s.get("new_tokens", []))
    for key in keys:
        req = cache.get(key)
        if req is None:
            if kind == "score":
                prefix, lens, labels = key
                req = ScoreRequest(tuple(z(n) for n in lens), z(labels), z(prefix))
            else:
                prompt, width, new = key
                req = BeamRequest(z(prompt), width, new)
            cache[key] = req
        out.append(req)
    return out


def table_padding(table: Any, kind: str, col: KindLog, cfg: Any = None) -> dict[str, Any]:
    """The padding `table` adds to these requests, each alone in its smallest bucket (the packer's
    choice: service.runtime.batch.pick_bucket of the one request, built from the logged shape with
    dummy token ids; cached by shape), and packed as the server would batch them.

    Score: token rows (the bucket's rows against the request's tokens) and LM-head rows (the
    bucket's max_samples against its samples). BeamSearch: beam rows over its steps (the bucket's
    rows x its new_tokens against beam width x new tokens) and prompt tokens (the bucket's
    max_prompt_tokens against the prompt's). `not_held`: requests no bucket holds alone.

    `packed`: the requests in arrival order, as many a batch as some bucket holds and as were in
    flight of this kind as its first arrived (packing.pack, the replay `slmrank build --traffic`
    minimises over, there in FLOPs): the batches' padded work (Score: token rows; BeamSearch: beam rows x steps, a batch
    running its longest request's steps) against the requests' own. Alone a request pads only to
    its bucket's tiers; in a batch it also pads to the bucket the whole batch needs. With the
    model's config (cfg), `packed.flops`: the same batches' padded FLOPs against the requests' own,
    the measure `slmrank build --traffic` minimises (packing.work_of: the prefill's prompt tier
    counted, a forward pass of at least packing.FLOOR_ROWS rows)."""
    from ..runtime.batch import dims, pick_bucket
    from .packing import pack, padding_of, work_of

    cache: dict[int, tuple[int, int, int, int, tuple[int, ...]] | None] = {}
    padded = real = padded_aux = real_aux = not_held = 0
    reqs = logged_requests(kind, col)
    held: list[tuple[tuple[int, ...], int] | None] = []  # per request: (dims, real rows), None if held by no bucket
    for req in reqs:
        hit = cache.get(id(req), False)
        if hit is False:
            b: Any = pick_bucket(table, [req])
            if b is None:
                hit = None
            elif kind == "score":
                hit = (b.rows, req.num_tokens, b.max_samples, req.num_samples, dims(req))
            else:
                hit = (b.rows * b.new_tokens, req.beam_width * req.new_tokens, b.max_prompt_tokens,
                       len(req.prompt_ids), dims(req))
            cache[id(req)] = hit
        if hit is None:
            not_held += 1
            held.append(None)
        else:
            padded += hit[0]
            real += hit[1]
            padded_aux += hit[2]
            real_aux += hit[3]
            held.append((hit[4], hit[1]))
    names = ("token_rows", "head_rows") if kind == "score" else ("beam_rows", "prompt_tokens")
    out: dict[str, Any] = {"requests": col.num_valid - not_held, "not_held": not_held, "shapes": len(cache)}
    for name, p, r in zip(names, (padded, padded_aux), (real, real_aux)):
        out[name] = {"padded": p, "real": r, "ratio": round(p / r, 4) if r else None}
    # packed: in arrival order (the log is written as requests end), with the requests in flight
    arrival = np.asarray(col.valid_arrival_s, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    flight = requests_in_flight(arrival[order], np.asarray(col.valid_latency_ms, dtype=np.float64)[order])
    packable = [(*h, n) for h, n in zip((held[i] for i in order.tolist()), flight.tolist()) if h is not None]
    batches = pack(table.of_kind(kind), packable) if packable else None
    p = padding_of(batches) if batches is not None else None
    out["packed"] = None if p is None else {
        "padded": p["padded"], "real": p["real"],
        "ratio": round(p["padded"] / p["real"], 4) if p["real"] else None,
        "batches": p["batches"], "in_flight_p50": int(np.percentile(flight, 50, method="inverted_cdf"))}
    if batches is not None and cfg is not None:
        work, real_work = work_of(kind, cfg)
        real_flops = sum(real_work(d) for d, _, _ in packable)
        padded_flops = sum(b.count * work(b.bucket) for b in batches.values())
        out["packed"]["flops"] = {"padded": padded_flops, "real": real_flops,
                                  "ratio": round(padded_flops / real_flops, 4) if real_flops else None}
    return out


def load_table(source: str) -> tuple[str, Any]:
    """(label, BucketTable) of a built artifact directory (its own table) or of a model (an
    embedded spec or a local Hugging Face checkpoint: the default table of its default limits)."""
    from ..artifact.buckets import default_bucket_table
    from ..model.config import ServingLimits

    if (Path(source) / "manifest.msgpack").is_file():
        from ..artifact.artifact import load_artifact

        return f"artifact {source}", load_artifact(source, verify=False).buckets
    from ..model.checkpoint import weight_source

    cfg, _, _ = weight_source(source)  # ValueError / FileNotFoundError: neither
    return f"default table of {source}", default_bucket_table(ServingLimits.for_model(cfg))


def default_table(log: TrafficLog) -> tuple[str, Any] | None:
    """The default table of the limits in the log's last "model loaded" record, if it has one."""
    if log.limits is None:
        return None
    from ..artifact.buckets import default_bucket_table
    from ..model.config import ServingLimits

    return f"default table of the logged limits ({log.model or 'model'})", \
        default_bucket_table(ServingLimits.from_dict(log.limits))


# ---- the report ----------------------------------------------------------------------------------

def analyze(log: TrafficLog, tables: Sequence[tuple[str, Any]] = (), cfg: Any = None) -> dict[str, Any]:
    """The report as a JSON-safe dict: per kind its codes, dimensions, arrivals per second, in
    flight and padding per table (in FLOPs too, packed, given the model's config)."""
    firsts = [min(k.arrival_s) for k in log.kinds.values() if k.arrival_s]
    lasts = [max(k.arrival_s) for k in log.kinds.values() if k.arrival_s]
    origin = math.floor(min(firsts))
    seconds = math.floor(max(lasts)) - origin + 1
    out: dict[str, Any] = {
        "log": log.path, "lines": log.num_lines, "requests": log.num_requests,
        "malformed": [{"line": n, "error": why} for n, why in log.malformed],
        "other_methods": dict(log.other), "model": log.model, "limits": log.limits, "server_starts": log.num_starts,
        "origin_s": origin, "seconds": seconds, "tables": [name for name, _ in tables], "kinds": {}}
    for kind, col in log.kinds.items():
        if not col.arrival_s:
            continue
        dims = shape_columns(kind, col)
        per_second = arrivals_per_second(col.arrival_s, origin, seconds)
        lat = np.asarray(col.valid_latency_ms, dtype=np.float64)
        weights = {"tokens": dims["tokens"]} if kind == "score" else \
            {"prompt_tokens": dims["prompt_tokens"], "beam_width": dims["beam_width"]}
        out["kinds"][kind] = {
            "requests": len(col.arrival_s), "valid": col.num_valid, "codes": dict(col.codes.most_common()),
            "latency_ms": percentiles(np.asarray(col.latency_ms, dtype=np.float64)),
            "dims": {name: percentiles(dims[name]) for name, _ in DIMS[kind]},
            "arrivals_per_second": {"counts": per_second.tolist(), **percentiles(per_second)},
            "in_flight": in_flight(np.asarray(col.valid_arrival_s, dtype=np.float64), lat, weights),
            "padding": {name: table_padding(table, kind, col, cfg) for name, table in tables},
        }
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def _big(n: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def sparkline(counts: Sequence[int], width: int = 60) -> tuple[str, int]:
    """(line, seconds a character): the mean of each group of seconds, scaled to the highest."""
    n = len(counts)
    step = max(1, math.ceil(n / width))
    groups = [sum(counts[i:i + step]) / len(counts[i:i + step]) for i in range(0, n, step)]
    top = max(groups, default=0) or 1
    return "".join(SPARK[min(len(SPARK) - 1, math.ceil(g / top * (len(SPARK) - 1)))] for g in groups), step


def _arrival_table(report: dict[str, Any], rows: int = 12) -> list[str]:
    kinds = list(report["kinds"])
    seconds = report["seconds"]
    step = max(1, math.ceil(seconds / rows))
    head = f"  {'from s':>8} {'to s':>8}" + "".join(f" {k + ' req/s':>12} {'max/s':>6}" for k in kinds)
    lines = [head]
    for start in range(0, seconds, step):
        cells = ""
        for k in kinds:
            part = report["kinds"][k]["arrivals_per_second"]["counts"][start:start + step]
            cells += f" {sum(part) / len(part):>12.1f} {max(part):>6}"
        lines.append(f"  {start:>8} {min(start + step, seconds):>8}" + cells)
    return lines


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['log']}: {report['lines']} lines, {report['requests']} Score/BeamSearch requests over "
             f"{report['seconds']} s from {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(report['origin_s']))}"
             + (f", {len(report['malformed'])} malformed lines left out" if report["malformed"] else "")]
    if report["model"] is not None:
        starts = f" ({report['server_starts']} server starts: the last)" if report["server_starts"] > 1 else ""
        lines.append(f"model {report['model'] or '?'}{starts}, limits {report['limits']}")
    for kind, k in report["kinds"].items():
        codes = ", ".join(f"{c} {n}" for c, n in k["codes"].items())
        lines += ["", f"{'Score' if kind == 'score' else 'BeamSearch'}: {k['requests']} requests, "
                      f"{k['valid']} valid (codes: {codes})"]
        lines.append(f"  {'dimension':<32}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}{'mean':>10}")
        rows = [(what, k["dims"][name]) for name, what in DIMS[kind]] + [("latency ms", k["latency_ms"])]
        for what, st in rows:
            if st.get("n"):
                lines.append(f"  {what:<32}" + "".join(f"{_fmt(st[q]):>9}" for q in ("p50", "p95", "p99", "max"))
                             + f"{_fmt(st['mean']):>10}")
        aps = k["arrivals_per_second"]
        spark, step = sparkline(aps["counts"])
        lines.append(f"  arrivals/s: mean {_fmt(aps['mean'])}, p50 {aps['p50']}, p95 {aps['p95']}, max {aps['max']}"
                     f"  |{spark}| ({step} s a character)")
        if k["in_flight"]:
            fl = k["in_flight"]
            parts = [f"{name.replace('_', ' ')} p50 {_fmt(st['p50'])} p95 {_fmt(st['p95'])} max {_fmt(st['max'])}"
                     for name, st in fl.items()]
            lines.append("  in flight as a request arrives: " + "; ".join(parts))
        if k["padding"]:
            a, b = ("token rows", "head rows") if kind == "score" else ("beam rows", "prompt tokens")
            lines.append(f"  padding, each request alone in its smallest bucket ({a} and {b}: padded / real):")
            for name, p in k["padding"].items():
                cells = []
                for key in p:
                    if isinstance(p[key], dict) and key != "packed":
                        ratio = "-" if p[key]["ratio"] is None else f"{p[key]['ratio']:.3f}x"
                        cells.append(f"{key.replace('_', ' ')} {_big(p[key]['padded'])} / {_big(p[key]['real'])} "
                                     f"= {ratio}")
                held = f"; {p['not_held']} held by no bucket" if p["not_held"] else ""
                lines.append(f"    {name}: " + ", ".join(cells) + f" ({p['shapes']} shapes{held})")
            what = "token rows" if kind == "score" else "beam rows x steps"
            lines.append(f"  padding, packed in arrival order as many a batch as were in flight ({what}: padded / real):")
            for name, p in k["padding"].items():
                q = p.get("packed")
                if q is not None:
                    ratio = "-" if q["ratio"] is None else f"{q['ratio']:.3f}x"
                    f = q.get("flops")
                    flops = "" if f is None or f["ratio"] is None else \
                        f"; FLOPs {f['padded'] / 1e12:,.1f} / {f['real'] / 1e12:,.1f} T = {f['ratio']:.3f}x"
                    lines.append(f"    {name}: {_big(q['padded'])} / {_big(q['real'])} = {ratio} in {q['batches']:,} "
                                 f"batches (in flight p50 {q['in_flight_p50']}){flops}")
    if not report["tables"]:
        lines += ["", "padding: no bucket table (the log has no 'model loaded' record with the limits): "
                      "name one with --bucket-table ARTIFACT_DIR_OR_MODEL"]
    if len(report["kinds"]) > 0:
        lines += ["", "arrivals per second over time:", *_arrival_table(report)]
    if report["malformed"]:
        lines += ["", f"malformed lines ({len(report['malformed'])}, left out):"]
        lines += [f"  line {m['line']}: {m['error']}" for m in report["malformed"][:MAX_MALFORMED_SHOWN]]
        if len(report["malformed"]) > MAX_MALFORMED_SHOWN:
            lines.append(f"  ... and {len(report['malformed']) - MAX_MALFORMED_SHOWN} more (all in --json)")
    return "\n".join(lines)


def plot_arrivals(path: str | Path, report: dict[str, Any], max_points: int = 900) -> None:
    """Arrivals per second over time, a line a kind (seconds grouped to at most max_points)."""
    from .png import line_chart

    seconds = report["seconds"]
    step = max(1, math.ceil(seconds / max_points))
    series = []
    for kind, k in report["kinds"].items():
        counts = k["arrivals_per_second"]["counts"]
        series.append((kind, [(float(i), sum(counts[i:i + step]) / len(counts[i:i + step]))
                              for i in range(0, seconds, step)]))
    per = "" if step == 1 else f" (mean of {step} s)"
    line_chart(path, f"arrivals per second{per}", "seconds from the first arrival", "requests/s", series, steps=True)


def config_of(source: str | None) -> Any:
    """The model config of an artifact directory, an embedded spec or a local checkpoint; None for
    anything else (a log's model that is not on this machine): the FLOPs are then left out."""
    if not source:
        return None
    try:
        if (Path(source) / "manifest.msgpack").is_file():
            from ..artifact.artifact import load_artifact

            return load_artifact(source, verify=False).config
        from ..model.checkpoint import weight_source

        return weight_source(source)[0]
    except (OSError, ValueError):
        return None


def run(log_path: str, tables_from: Sequence[str] = ()) -> dict[str, Any]:
    """The command's core: read the log, the tables (--bucket-table, else the logged default), the
    model that prices their padding in FLOPs (the first --bucket-table's, else the log's), analyze."""
    log = read_log(log_path)
    tables = [load_table(s) for s in tables_from]
    if not tables and (default := default_table(log)) is not None:
        tables = [default]
    cfg = next((c for c in map(config_of, tables_from) if c is not None), None) or config_of(log.model)
    return analyze(log, tables, cfg)


def main(args: Any) -> int:
    report = run(args.log, args.bucket_table or ())
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report) + "\n")
    if args.png:
        plot_arrivals(args.png, report)
    return 0

