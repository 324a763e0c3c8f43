"""The benchmark's peer: Hugging Face transformers behind the same `slmrank.v1.Ranker` gRPC API.

What a Python user would build without slmrank (BENCHMARKS.md), in two strengths:
- naive (`--max-batch 1`, the default): one request at a time;
- strong (`--max-batch N --compile`): up to N whole requests that are waiting go into one batched
  call (Score: every sample of every request in one forward, the LM head only at each sample's last
  position, under torch.compile in its default mode, shapes padded to a few sizes so it compiles a
  handful of times (PADDINGS); BeamSearch: one batched `generate` over requests of the same beam
  width and new tokens, prompts left-padded with an attention mask).
The model runs in one worker thread so the event loop keeps answering; token-id segments only
(text -> INVALID_ARGUMENT "the peer takes ids"; no tokenizer is loaded).

- Score: log_softmax(model(prefix + sample).logits[last])[label_ids] per sample; the samples of
  one request go through ONE forward, right-padded with an attention mask, the logits read at
  each sample's own last position.
- BeamSearch: generate(num_beams=B, num_return_sequences=B, max_new_tokens=T, min_new_tokens=T,
  do_sample=False, length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0),
  beams best first with sequences_scores (B=1, greedy: the sum of the log-softmax of the chosen
  tokens). Beam.text is left empty.

    python -m ops.bench.hf_peer --checkpoint DIR [--host 127.0.0.1] [--port 0] [--device cpu|cuda]
                                [--max-batch N] [--compile] [--warm-score SAMPLES:LEN:PREFIX]
                                [--warm-mix MAX_SAMPLES:MAX_TOKENS]

prints "listening on HOST:PORT" once the model is loaded and health says SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.serving.proto_gen import load as load_stubs

RANKER = "slmrank.v1.Ranker"
# How a compiled Score forward pads [rows, width] (each new shape compiles: tens of seconds on the
# H200 host). "fixed", for one request shape (W1..W6, custom; as first measured): rows to a power
# of two >= 8, width to a multiple of 32. "mix", for requests of varied lengths (where multiples of
# 32 would be up to 13 widths for score-mix): rows and width to powers of two, >= 8 and >= 64.
PADDINGS = ("none", "fixed", "mix")
MAX_COMPILED_SHAPES = 64  # torch._dynamo's recompile limit (8 by default) for the mix's shapes


def pad_shape(rows: int, width: int, padding: str) -> tuple[int, int]:
    """The [rows, width] a Score forward of `rows` sequences, the longest `width` tokens, runs at."""
    if padding == "none":
        return rows, width
    rows = max(8, _pow2(rows))
    return (rows, -(-width // 32) * 32) if padding == "fixed" else (rows, max(64, _pow2(width)))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def mix_score_shapes(max_batch: int, max_samples: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every padded shape ("mix") that 1..max_batch Score requests of at most max_samples samples
    and max_tokens tokens a sample (prefix included) can take: rows 8, 16, ... x width 64, 128, ..."""
    top_rows, top_width = pad_shape(max_batch * max_samples, max_tokens, "mix")
    rows = [r for r in (8 << i for i in range(top_rows.bit_length())) if r <= top_rows]
    widths = [w for w in (64 << i for i in range(top_width.bit_length())) if w <= top_width]
    return [(r, w) for r in rows for w in widths]


class PeerError(ValueError):
    """A request the peer cannot serve: INVALID_ARGUMENT."""


def _ids(segment: Any, what: str) -> list[int]:
    if segment.text:
        raise PeerError(f"{what}: the peer takes ids, not text")
    return list(segment.ids)


class HFModel:
    """The transformers model and the two operations, synchronous (run them in a thread)."""

    def __init__(self, checkpoint_dir: str, device: str = "cpu", compile: bool = False,
                 padding: str | None = None) -> None:
        """padding: one of PADDINGS; by default "fixed" when compiled, else "none"."""
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).to(device).eval()
        self.vocab_size = self.model.config.vocab_size
        self.compiled = compile
        if padding not in (None, *PADDINGS):
            raise ValueError(f"padding: {padding!r} is not one of {PADDINGS}")
        self.padding = padding
        if compile:  # past the limit, a new shape would silently run eagerly
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MAX_COMPILED_SHAPES)
        # one static graph per padded shape (score_many pads to a few): without dynamic=False the
        # second shape would turn on automatic dynamic shapes and compile a slower, generic graph
        self._last_logprobs = (torch.compile(self._last_logprobs_eager, dynamic=False) if compile
                               else self._last_logprobs_eager)

    def _last_logprobs_eager(self, x, mask, last):
        # x, mask [S, W] (right-padded), last [S] -> log-softmax at each row's last real position [S, V]
        h = self.model.model(input_ids=x, attention_mask=mask).last_hidden_state
        picked = h[self.torch.arange(x.shape[0], device=x.device), last]
        return self.torch.log_softmax(self.model.lm_head(picked).float(), -1)

    def _check(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise PeerError(f"{what}: id {bad[0]} is outside [0, {self.vocab_size})")

    def score(self, prefix: list[int], samples: list[list[int]], label_ids: list[int]) -> list[list[float]]:
        return self.score_many([(prefix, samples, label_ids)])[0]

    def _check_score(self, prefix: list[int], samples: list[list[int]], label_ids: list[int]) -> list[list[int]]:
        if not samples:
            raise PeerError("samples: at least one is needed")
        if not label_ids:
            raise PeerError("label_ids: the peer serves a causal LM; give at least one label id")
        self._check(prefix, "prefix")
        self._check(label_ids, "label_ids")
        seqs = [prefix + s for s in samples]
        for i, s in enumerate(seqs):
            if not s:
                raise PeerError(f"samples[{i}]: empty, and so is the prefix")
            self._check(s, f"samples[{i}]")
        return seqs

    def score_many(self, requests: list[tuple[list[int], list[list[int]], list[int]]]) -> list[list[list[float]]]:
        """Every sample of every request in one forward; the LM head only at each sample's last token."""
        torch = self.torch
        per_request = [self._check_score(*r) for r in requests]
        seqs = [s for rows in per_request for s in rows]
        rows, width = self._padded(len(seqs), max(map(len, seqs)))
        x = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width, dtype=torch.long)
        last = torch.zeros(rows, dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding; padding rows see one token
            x[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
            last[i] = len(s) - 1
        mask[len(seqs):, 0] = 1
        with torch.inference_mode():
            logp = self._last_logprobs(x.to(self.device), mask.to(self.device), last.to(self.device))
            logp = logp[:len(seqs)].cpu()
        out, at = [], 0
        for (_, samples, label_ids) in requests:
            out.append(logp[at:at + len(samples), label_ids].tolist())
            at += len(samples)
        return out

    def _padded(self, rows: int, width: int) -> tuple[int, int]:
        """The shape a Score forward runs at (pad_shape): compiled, a few shapes only; eager, as it is."""
        return pad_shape(rows, width, self.padding or ("fixed" if self.compiled else "none"))

    def warm_score(self, samples: int, length: int, prefix: int, max_batch: int) -> list[dict[str, Any]]:
        """Runs score_many once for each padded shape that batches of 1..max_batch requests of this
        shape take, so that a compiled model compiles them now (tens of seconds each on the H200
        host) rather than inside a benchmark's measured window. What ran: requests, rows, width,
        seconds."""
        ran, seen = [], set()
        for n in range(1, max(1, max_batch) + 1):
            shape = self._padded(n * samples, prefix + length)
            if shape in seen:
                continue
            seen.add(shape)
            req = ([1] * prefix, [[1] * length for _ in range(samples)], [0])
            t = time.perf_counter()
            self.score_many([req] * n)
            ran.append({"requests": n, "rows": shape[0], "width": shape[1],
                        "seconds": round(time.perf_counter() - t, 2)})
        return ran

    def warm_mix(self, max_batch: int, max_samples: int, max_tokens: int) -> list[dict[str, Any]]:
        """Runs score_many once for each of mix_score_shapes (padding "mix"): compiled, each is
        compiled now rather than inside a benchmark's measured window. What ran: rows, width, seconds."""
        ran = []
        for rows, width in mix_score_shapes(max_batch, max_samples, max_tokens):
            t = time.perf_counter()
            self.score_many([([], [[1] * width] + [[1]] * (rows - 1), [0])])  # one row as wide as the shape
            ran.append({"rows": rows, "width": width, "seconds": round(time.perf_counter() - t, 2)})
        return ran

    def beam(self, prompt: list[int], beam_width: int, new_tokens: int) -> list[tuple[list[int], float]]:
        return self.beam_many([prompt], beam_width, new_tokens)[0]

    def beam_many(self, prompts: list[list[int]], beam_width: int,
                  new_tokens: int) -> list[list[tuple[list[int], float]]]:
        """One batched generate over requests of one beam width and length; prompts left-padded."""
        torch = self.torch
        if beam_width < 1 or new_tokens < 1:
            raise PeerError(f"beam_width and new_tokens must be >= 1, got {beam_width} and {new_tokens}")
        for p in prompts:
            if not p:
                raise PeerError("prompt: empty")
            self._check(p, "prompt")
        width = max(map(len, prompts))
        x = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            x[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            gen = self.model.generate(
                x.to(self.device), attention_mask=mask.to(self.device), num_beams=beam_width,
                num_return_sequences=beam_width, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0,
                output_scores=True, return_dict_in_generate=True)
        seqs = gen.sequences[:, width:].cpu().tolist()  # [requests * B, T], each request's beams best first
        if beam_width > 1:
            scores = gen.sequences_scores.float().cpu().tolist()
        else:  # greedy: the sum of the log-softmax of the chosen tokens
            scores = [sum(torch.log_softmax(sc[i].float(), -1)[tok].item() for sc, tok in zip(gen.scores, seqs[i]))
                      for i in range(len(prompts))]
        pairs = list(zip(seqs, scores))
        return [pairs[i * beam_width:(i + 1) * beam_width] for i in range(len(prompts))]


class PeerServicer:
    """slmrank.v1.Ranker on HFModel: one model call at a time over up to max_batch waiting requests
    of one kind (a bad request fails its whole batch's call, so it is retried alone)."""

    def __init__(self, model: HFModel, max_batch: int = 1) -> None:
        self.model, self.max_batch = model, max_batch
        self.pb2 = load_stubs().pb2
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker: asyncio.Task | None = None

    async def _work(self) -> None:
        while True:
            batch = [await self.queue.get()]
            key = batch[0][0]
            held = []
            while len(batch) < self.max_batch and not self.queue.empty():
                item = self.queue.get_nowait()
                (batch if item[0] == key else held).append(item)
            for item in held:
                self.queue.put_nowait(item)
            await self._call(key, batch)

    async def _call(self, key: tuple, batch: list) -> None:
        try:
            if key[0] == "score":
                outs = await asyncio.to_thread(self.model.score_many, [item[1] for item in batch])
            else:
                outs = await asyncio.to_thread(self.model.beam_many, [item[1] for item in batch], key[1], key[2])
        except PeerError as e:
            if len(batch) > 1:  # find the bad one: each alone
                for item in batch:
                    await self._call(key, [item])
                return
            outs = [e]
        except Exception as e:  # noqa: BLE001 - reaches the caller as INTERNAL
            outs = [e] * len(batch)
        for (_, _, future), out in zip(batch, outs):
            if not future.done():
                future.set_exception(out) if isinstance(out, BaseException) else future.set_result(out)

    async def _run(self, context: grpc.aio.ServicerContext, key: tuple, args: Any) -> Any:
        if self.worker is None:
            self.worker = asyncio.get_running_loop().create_task(self._work())
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((key, args, future))
        try:
            return await future
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Score(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            prefix = _ids(request.prefix, "prefix") if request.HasField("prefix") else []
            samples = [_ids(s, f"samples[{i}]") for i, s in enumerate(request.samples)]
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rows = await self._run(context, ("score",), (prefix, samples, list(request.label_ids)))
        return self.pb2.ScoreResponse(samples=[self.pb2.SampleScore(logprobs=r) for r in rows])

    async def BeamSearch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            prompt = _ids(request.prompt, "prompt")
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        beams = await self._run(context, ("beam", request.beam_width, request.new_tokens), prompt)
        return self.pb2.BeamSearchResponse(beams=[self.pb2.Beam(ids=ids, logprob=lp) for ids, lp in beams])

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """What the peer is: transformers on a checkpoint (no artifact, no buckets)."""
        cfg = self.model.model.config
        return self.pb2.ModelInfoResponse(
            model="hf-peer", runtime="transformers", device=str(self.model.device), arch=str(cfg.model_type),
            num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=self.model.vocab_size,
            compute_dtype=str(self.model.model.dtype).removeprefix("torch."))

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Not the peer's: the benchmarks send it token ids (gRPC registers every RPC of the service,
        so the servicer must have it)."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the Hugging Face peer takes token ids: no Tokenize")


async def start_peer(checkpoint_dir: str, host: str = "127.0.0.1", port: int = 0, device: str = "cpu",
                     max_batch: int = 1, compile: bool = False, warm_score: tuple[int, int, int] | None = None,
                     warm_mix: tuple[int, int] | None = None) -> tuple[grpc.aio.Server, int]:
    """Loads the checkpoint, runs each padded Score shape once (warm_score = (samples, length,
    prefix): one request shape, padding "fixed"; warm_mix = (max samples, max tokens a sample):
    varied ones, padding "mix"), binds, starts, health SERVING. Call inside the event loop that serves it."""
    model = await asyncio.to_thread(HFModel, checkpoint_dir, device, compile, "mix" if warm_mix else None)
    warm = (model.warm_score, *warm_score, max_batch) if warm_score else \
        (model.warm_mix, max_batch, *warm_mix) if warm_mix else None
    if warm is not None:
        t = time.perf_counter()
        ran = await asyncio.to_thread(*warm)
        print(f"[hf-peer] warmed {len(ran)} Score shape(s) in {time.perf_counter() - t:.1f} s: {ran}", flush=True)
    stubs = load_stubs()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    stubs.pb2_grpc.add_RankerServicer_to_server(PeerServicer(model, max_batch), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"the peer could not bind {host}:{port}")
    await server.start()
    for service in ("", RANKER):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def _main(args: argparse.Namespace) -> None:
    server, port = await start_peer(args.checkpoint, args.host, args.port, args.device, args.max_batch, args.compile,
                                    args.warm_score, args.warm_mix)
    print(f"[hf-peer] listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def _warm_shape(text: str) -> tuple[int, int, int]:
    try:
        samples, length, prefix = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warm-score: SAMPLES:LEN:PREFIX (three integers), got {text!r}") from None
    if samples < 1 or length < 1 or prefix < 0:
        raise argparse.ArgumentTypeError(f"--warm-score: SAMPLES >= 1, LEN >= 1, PREFIX >= 0, got {text!r}")
    return samples, length, prefix


def _warm_bounds(text: str) -> tuple[int, int]:
    try:
        samples, tokens = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--warm-mix: MAX_SAMPLES:MAX_TOKENS (two integers), got {text!r}") from None
    if samples < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"--warm-mix: MAX_SAMPLES >= 1, MAX_TOKENS >= 1, got {text!r}")
    return samples, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-batch", type=int, default=1,
                   help="whole requests per model call (1: the naive peer, one at a time)")
    p.add_argument("--compile", action="store_true", help="Score forward under torch.compile (default mode)")
    p.add_argument("--warm-score", type=_warm_shape, metavar="SAMPLES:LEN:PREFIX",
                   help="before serving, run each padded shape that 1..max-batch Score requests of this shape "
                        "take (with --compile: compile them at start-up, not in a benchmark's window)")
    p.add_argument("--warm-mix", type=_warm_bounds, metavar="MAX_SAMPLES:MAX_TOKENS",
                   help="varied Score shapes: pad rows and width to powers of two (>= 8, >= 64) and, before "
                        "serving, run each such shape that 1..max-batch requests of at most MAX_SAMPLES samples "
                        "of at most MAX_TOKENS tokens (prefix included) take")
    asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    main()
