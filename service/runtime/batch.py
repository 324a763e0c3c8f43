"""Packing whole requests into one bucket's static input buffers, and unpacking the results.

Host-side and shared by both runtimes, so they see the very same buffers.
Padding tokens get seg = -1 (they attend only to each other) and never reach a result.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..artifact.buckets import ANY_STEPS, BeamBucket, Bucket, BucketTable, CodesBucket, Fill, ScoreBucket, codes_kind
from ..artifact.catalog import Catalog
from .requests import Beam, BeamRequest, BeamResult, ScoreRequest, ScoreResult

NO_CONTEXT = -2  # ctx of a token that has no shared prefix (never equal to any seg)


def _i64(values: list[int]) -> torch.Tensor:
    # ~3x faster than torch.tensor(list): this runs on the event loop for every batch
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


@dataclass
class ScoreBatch:
    requests: list[ScoreRequest]
    bucket: ScoreBucket
    num_labels: int  # padded label columns
    inputs: dict[str, torch.Tensor]


@dataclass
class BeamBatch:
    requests: list[BeamRequest]
    bucket: BeamBucket
    inputs: dict[str, torch.Tensor]
    catalogs: Sequence[Catalog] = ()  # the artifact's: beam_catalog indexes them, unpack names the items


def dims(req: ScoreRequest | BeamRequest) -> tuple[int, ...]:
    """What a request adds to a batch's totals (buckets.Fill): (tokens, samples) of a Score
    request; (prompt tokens, beam width, new tokens, steps) of a BeamSearch one, steps its new
    tokens where the bucket must run exactly those (a catalog: its trie ends there), else
    ANY_STEPS."""
    if isinstance(req, ScoreRequest):
        return req.num_tokens, req.num_samples
    return len(req.prompt_ids), req.beam_width, req.new_tokens, req.new_tokens if req.catalog else ANY_STEPS


def kind(req: ScoreRequest | BeamRequest) -> str:
    """Requests of one kind may share a batch: "score", "beam" (any new_tokens), or for a request
    normalised over a catalog's codes "beam.n<new_tokens>.codes-<catalog>" (buckets.kind_of)."""
    if isinstance(req, ScoreRequest):
        return "score"
    if req.normalization == "codes":
        return codes_kind(req.new_tokens, req.catalog)
    return "beam"


def pick_bucket(table: BucketTable, requests: Sequence[ScoreRequest | BeamRequest]) -> Bucket | None:
    """The bucket a batch of these requests runs in (buckets.Fill, the one answer); None if they
    are not of one kind or no bucket holds them."""
    if not requests or any(kind(r) != kind(requests[0]) for r in requests):
        return None
    fill = Fill(table.of_kind(kind(requests[0])))
    for req in requests:
        if fill.add(*dims(req)) is None:
            return None
    return fill.bucket


def pick_score_bucket(table: BucketTable, requests: Sequence[ScoreRequest]) -> ScoreBucket | None:
    return pick_bucket(table, requests)  # type: ignore[return-value]


def pick_beam_bucket(table: BucketTable, requests: Sequence[BeamRequest]) -> BeamBucket | None:
    return pick_bucket(table, requests)  # type: ignore[return-value]


def pack_score(requests: list[ScoreRequest], bucket: ScoreBucket, num_labels: int) -> ScoreBatch:
    """tokens/positions/seg/ctx [T]; request_rows [R+1]; prefix_rows [R]; last [S]; labels [S, L].

    The requests lie back to back from row 0, each its prefix (a segment, optional) then its
    samples (a segment each); the rows after the last request are padding (seg -1). A sample's ctx
    is its request's prefix segment (the shared prefix K/V it attends to). request_rows[i] is
    request i's first row and request_rows[R] = T: the bucket's unused request slots are empty,
    the last one holding the padding. prefix_rows[i] is request i's prefix length (0: none).

    This runs on the event loop for every batch (8 W1 requests are 7,680 rows): Python walks the
    segments, never the tokens. The rows are runs (a segment, or the padding) and the per-row
    columns are each run's value repeated over its rows, positions counting up inside a segment
    and 0 in padding."""
    r_max, s_max = bucket.max_requests, bucket.max_samples
    if len(requests) > r_max:
        raise ValueError(f"batch of {len(requests)} requests does not fit {bucket.key}")
    tokens: list[int] = []  # converted to int64 once at the end (array.extend per segment is ~2x slower)
    run_len: list[int] = []  # per run: rows, the position of its first row (0 for padding), seg, ctx
    run_pos0: list[int] = []
    run_seg: list[int] = []
    run_ctx: list[int] = []
    last: list[int] = []
    labels: list[int] = []
    request_rows: list[int] = []
    prefix_rows: list[int] = []
    num_segs = 0
    for req in requests:
        request_rows.append(len(tokens))
        prefix_seg = NO_CONTEXT
        n_prefix = len(req.prefix_ids)
        prefix_rows.append(n_prefix)
        if n_prefix:
            prefix_seg, num_segs = num_segs, num_segs + 1
            tokens += req.prefix_ids
            run_len.append(n_prefix)
            run_pos0.append(0)
            run_seg.append(prefix_seg)
            run_ctx.append(NO_CONTEXT)
        row_labels = list(req.label_ids) + [0] * (num_labels - len(req.label_ids))
        for sample in req.samples:
            tokens += sample
            run_len.append(len(sample))
            run_pos0.append(n_prefix)
            run_seg.append(num_segs)
            run_ctx.append(prefix_seg)
            num_segs += 1
            last.append(len(tokens) - 1)
            labels += row_labels
    used = len(tokens)
    if used > bucket.max_tokens:
        raise ValueError(f"batch of {used} tokens does not fit {bucket.key}")
    if len(last) > s_max:
        raise ValueError(f"batch of {len(last)} samples does not fit {bucket.key}")
    _pad_run(tokens, bucket.max_tokens - used, run_len, run_pos0, run_seg, run_ctx)
    pad_s = s_max - len(last)
    labels.extend([0] * (num_labels * pad_s))
    positions, seg, ctx = _expand_runs(run_len, run_pos0, run_seg, run_ctx, bucket.max_tokens)
    pad_r = r_max - len(requests)
    inputs = {
        "tokens": _i64(tokens),
        "positions": positions,
        "seg": seg,
        "ctx": ctx,
        "request_rows": _i64(request_rows + [used] * pad_r + [bucket.max_tokens]),
        "prefix_rows": _i64(prefix_rows + [0] * pad_r),
        "last": _i64(last + [0] * pad_s),
        "labels": _i64(labels).reshape(s_max, num_labels),
    }
    return ScoreBatch(requests, bucket, num_labels, inputs)


def _pad_run(tokens: list[int], n: int, run_len: list[int], run_pos0: list[int], run_seg: list[int],
             run_ctx: list[int]) -> None:
    """n padding rows: token 0, position 0, seg -1, ctx NO_CONTEXT."""
    if n > 0:
        tokens += [0] * n
        run_len.append(n)
        run_pos0.append(0)
        run_seg.append(-1)
        run_ctx.append(NO_CONTEXT)


def _expand_runs(run_len: list[int], run_pos0: list[int], run_seg: list[int], run_ctx: list[int],
                 total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row positions, seg, ctx [total] from the runs: seg and ctx repeat the run's value; a
    segment's positions count up from its first (run_pos0), padding's stay 0.

    numpy, not torch: torch.repeat_interleave on the CPU fans even an 8,192-row expansion out over
    every intra-op thread, and on the 16-core H200 host each call took ~1.4 ms of the event loop
    (3 a batch: half the loop's CPU at W1 in a cProfile of ops/bench/loop_cost.py); numpy's repeat stays
    on the calling thread."""
    lens = np.array(run_len, dtype=np.int64)
    seg = np.repeat(np.array(run_seg, dtype=np.int64), lens)
    ctx = np.repeat(np.array(run_ctx, dtype=np.int64), lens)
    if len(seg) != total:
        raise ValueError(f"runs cover {len(seg)} rows, not {total}")
    # row - (first row of its run - run_pos0), times 0 in padding (seg -1)
    shift = np.repeat(np.cumsum(lens) - lens - np.array(run_pos0, dtype=np.int64), lens)
    positions = (np.arange(total, dtype=np.int64) - shift) * (seg >= 0)
    return torch.from_numpy(positions), torch.from_numpy(seg), torch.from_numpy(ctx)


def unpack_score(batch: ScoreBatch, scores: torch.Tensor) -> list[ScoreResult]:
    """scores: [S, L] float32 on the host."""
    rows = scores.tolist()
    out, i = [], 0
    for req in batch.requests:
        width = len(req.label_ids) or scores.shape[1]  # a classification head returns every output
        out.append(ScoreResult([row[:width] for row in rows[i:i + req.num_samples]]))
        i += req.num_samples
    return out


def pack_beam(requests: list[BeamRequest], bucket: BeamBucket, catalogs: Sequence[Catalog] = ()) -> BeamBatch:
    """The prompts: tokens/positions/seg [P] (packed, seg = request index, padding -1); last and
    beam_width [R]. The decode steps run over N = max_rows packed beam rows: request r's width of
    rows back to back from row 0 (rank p of request r is row first_r + p), padding rows after the
    last. Per row: beam_req [N] (its request; R for a padding row, whose prompt range is empty),
    beam_pos [N] (its prompt's length: the position of the first generated token; 0 for padding)
    and beam_slot [N] (r * B + p: its rank in the rectangular [R, B] bookkeeping, B = the bucket's
    beam_width; R * B for padding: one past the end). beam_src [R * B]: the packed row of each rank
    (N for the ranks a narrower request or an empty slot does not have). beam_seqs [R, B, n] zeros.
    beam_catalog [R]: each request's catalog (its index in catalogs; -1: none, and padding).
    beam_steps [R]: each request's new tokens (the bucket's n for padding): the batch runs n steps
    and answers a request of fewer at its own step (the beam_hold nodes); a request with a catalog
    only in a bucket of its own new_tokens."""
    r_max, b, rows = bucket.max_requests, bucket.beam_width, bucket.max_rows
    tokens, positions, seg, last, widths, prompt_len = [], [], [], [], [], []
    for r, req in enumerate(requests):
        tokens += req.prompt_ids
        positions += range(len(req.prompt_ids))
        seg += [r] * len(req.prompt_ids)
        last.append(len(tokens) - 1)
        widths.append(req.beam_width)
        prompt_len.append(len(req.prompt_ids))
    used = sum(widths)
    steps = [req.new_tokens for req in requests]
    if (len(tokens) > bucket.max_prompt_tokens or len(requests) > r_max or used > rows
            or max(widths, default=0) > b or max(steps, default=0) > bucket.new_tokens
            or any(req.catalog and req.new_tokens != bucket.new_tokens for req in requests)):
        raise ValueError(f"batch of {len(requests)} requests / {len(tokens)} prompt tokens / {used} beam rows "
                         f"(widest {max(widths, default=0)}, new tokens {sorted(set(steps))}) does not fit "
                         f"{bucket.key}")
    pad_n, pad_r = bucket.max_prompt_tokens - len(tokens), r_max - len(requests)
    width = np.array(widths + [0] * pad_r, dtype=np.int64)  # a padding request has no live beam
    first = np.cumsum(width) - width  # [R]: each request's first packed row
    row_req = np.repeat(np.arange(r_max, dtype=np.int64), width)  # [used]
    rank = np.arange(used, dtype=np.int64) - first[row_req]
    ranks = np.arange(b, dtype=np.int64)
    src = np.where(ranks < width[:, None], first[:, None] + ranks, rows)  # [R, B]
    inputs = {
        "tokens": _i64(tokens + [0] * pad_n),
        "positions": _i64(positions + [0] * pad_n),
        "seg": _i64(seg + [-1] * pad_n),
        "last": _i64(last + [0] * pad_r),
        "beam_width": torch.from_numpy(width),
        "beam_req": _padded(row_req, rows, r_max),
        "beam_pos": _padded(np.array(prompt_len + [0] * pad_r, dtype=np.int64)[row_req], rows, 0),
        "beam_slot": _padded(row_req * b + rank, rows, r_max * b),
        "beam_src": torch.from_numpy(src.reshape(-1)),
        "beam_seqs": torch.zeros(r_max, b, bucket.new_tokens, dtype=torch.int64),  # filled step by step
        "beam_catalog": _i64([catalog_index(catalogs, req.catalog) for req in requests] + [-1] * pad_r),
        "beam_steps": _i64(steps + [bucket.new_tokens] * pad_r),
    }
    if isinstance(bucket, CodesBucket):
        if any(req.normalization != "codes" or req.catalog != bucket.catalog for req in requests):
            raise ValueError(f"{bucket.key} holds requests of catalog {bucket.catalog!r} normalised over its codes only")
        inputs["beam_codes"] = code_columns(catalogs[catalog_index(catalogs, bucket.catalog)], bucket.beam_width)
    return BeamBatch(requests, bucket, inputs, catalogs)


CODE_COLUMNS_ALIGN = 128  # a catalog's code columns are padded to a multiple (a replaced catalog's few
# more or fewer codes keep the batch's shapes, and with them its CUDA graphs)


def code_columns(catalog: Catalog, beam_width: int) -> torch.Tensor:
    """beam_codes [C]: the catalog's code tokens ascending (the LM head's rows, the beam step's
    columns of a batch normalised over them), then -1 up to a multiple of CODE_COLUMNS_ALIGN, and to
    beam_width columns at least: each row's beam_width candidates are taken among its columns (a
    catalog of fewer codes than a bucket's beams; its padding columns are never allowed)."""
    codes = catalog.code_tokens
    pad = -max(len(codes), beam_width) % CODE_COLUMNS_ALIGN + max(beam_width - len(codes), 0)
    return torch.from_numpy(np.concatenate([codes, np.full(pad, -1, dtype=np.int64)]))


def catalog_index(catalogs: Sequence[Catalog], name: str) -> int:
    """-1 for no catalog; ValueError for one that is not there (validation refuses it first)."""
    if not name:
        return -1
    for i, cat in enumerate(catalogs):
        if cat.name == name:
            return i
    raise ValueError(f"catalog {name!r} is not one of the artifact's")


def _padded(values: np.ndarray, total: int, pad: int) -> torch.Tensor:
    """values, then pad up to total entries, as int64."""
    return torch.from_numpy(np.concatenate([values, np.full(total - len(values), pad, dtype=np.int64)]))


def unpack_beam(batch: BeamBatch, seqs: torch.Tensor, scores: torch.Tensor) -> list[BeamResult]:
    """seqs: [R, B, n] int64; scores: [R, B] float32, each request's beams best first (a request of
    fewer new tokens than n: its first new_tokens columns, as held at its step). A request with a
    catalog gets its finite beams only (fewer valid items than its width: fewer beams), each with
    its item id."""
    if any(req.catalog for req in batch.requests):
        return _unpack_constrained(batch, seqs.cpu(), scores.cpu())
    # only the live part becomes Python objects (padding requests and beams are most of a wide bucket)
    n, width = len(batch.requests), max((r.beam_width for r in batch.requests), default=0)
    live_seqs, live_scores = seqs[:n, :width], scores[:n, :width]
    if live_seqs.device.type == "cpu" and live_scores.device.type == "cpu":
        # each result's own copy of its rows (the runtime may reuse its output buffers); its beams
        # become Python objects only if asked for (the gRPC codec writes the response from the rows)
        live_seqs, live_scores = live_seqs.clone(), live_scores.clone()
        return [BeamResult(rows=(live_seqs[r, :req.beam_width, :req.new_tokens], live_scores[r, :req.beam_width]))
                for r, req in enumerate(batch.requests)]
    seq_rows, score_rows, steps = live_seqs.tolist(), live_scores.tolist(), seqs.shape[2]
    return [BeamResult(list(map(Beam, seq_rows[r][:req.beam_width] if req.new_tokens == steps else
                                [seq[:req.new_tokens] for seq in seq_rows[r][:req.beam_width]],
                                score_rows[r][:req.beam_width])))
            for r, req in enumerate(batch.requests)]


def _unpack_constrained(batch: BeamBatch, seqs: torch.Tensor, scores: torch.Tensor) -> list[BeamResult]:
    out = []
    for r, req in enumerate(batch.requests):
        width = req.beam_width
        if req.catalog:  # scores are best first: the -inf beams (no valid item left) are the last
            width = int(torch.isfinite(scores[r, :width]).sum())
        rows = (seqs[r, :width, :req.new_tokens].clone(), scores[r, :width].clone())
        items = version = None
        if req.catalog:
            cat = batch.catalogs[catalog_index(batch.catalogs, req.catalog)]
            items, version = cat.item_of(rows[0].numpy()), cat.version
            if None in items:
                raise RuntimeError(f"request {req.id}: a beam is not an item of catalog {req.catalog!r}")
        out.append(BeamResult(rows=rows, item_ids=items, catalog_version=version))  # type: ignore[arg-type]
    return out
