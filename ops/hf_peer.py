"""The benchmark's peer: Hugging Face transformers behind the same `slmrank.v1.Ranker` gRPC API.

What a Python user would build without slmrank (BENCHMARKS.md): one request at a time (an
asyncio.Lock; the model runs in a worker thread so the event loop keeps answering), token-id
segments only (text -> INVALID_ARGUMENT "the peer takes ids"; no tokenizer is loaded).

- Score: log_softmax(model(prefix + sample).logits[last])[label_ids] per sample; the samples of
  one request go through ONE forward, right-padded with an attention mask, the logits read at
  each sample's own last position.
- BeamSearch: generate(num_beams=B, num_return_sequences=B, max_new_tokens=T, min_new_tokens=T,
  do_sample=False, length_penalty=0.0, early_stopping=False, eos_token_id=None, pad_token_id=0),
  beams best first with sequences_scores (B=1, greedy: the sum of the log-softmax of the chosen
  tokens). Beam.text is left empty.

    python ops/hf_peer.py --checkpoint DIR [--host 127.0.0.1] [--port 0] [--device cpu|cuda]

prints "listening on HOST:PORT" once the model is loaded and health says SERVING.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.serving.proto_gen import load as load_stubs  # noqa: E402

RANKER = "slmrank.v1.Ranker"


class PeerError(ValueError):
    """A request the peer cannot serve: INVALID_ARGUMENT."""


def _ids(segment: Any, what: str) -> list[int]:
    if segment.text:
        raise PeerError(f"{what}: the peer takes ids, not text")
    return list(segment.ids)


class HFModel:
    """The transformers model and the two operations, synchronous (run them in a thread)."""

    def __init__(self, checkpoint_dir: str, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=dtype).to(device).eval()
        self.vocab_size = self.model.config.vocab_size

    def _check(self, ids: list[int], what: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise PeerError(f"{what}: id {bad[0]} is outside [0, {self.vocab_size})")

    def score(self, prefix: list[int], samples: list[list[int]], label_ids: list[int]) -> list[list[float]]:
        torch = self.torch
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
        width = max(map(len, seqs))
        x = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding
            x[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        last = torch.tensor([len(s) - 1 for s in seqs])
        with torch.inference_mode():
            logits = self.model(input_ids=x.to(self.device), attention_mask=mask.to(self.device)).logits
            picked = logits[torch.arange(len(seqs), device=logits.device), last.to(logits.device)].float()
            out = torch.log_softmax(picked, -1)[:, label_ids]
        return out.cpu().tolist()

    def beam(self, prompt: list[int], beam_width: int, new_tokens: int) -> list[tuple[list[int], float]]:
        torch = self.torch
        if not prompt:
            raise PeerError("prompt: empty")
        if beam_width < 1 or new_tokens < 1:
            raise PeerError(f"beam_width and new_tokens must be >= 1, got {beam_width} and {new_tokens}")
        self._check(prompt, "prompt")
        x = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            gen = self.model.generate(
                x, attention_mask=torch.ones_like(x), num_beams=beam_width, num_return_sequences=beam_width,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, length_penalty=0.0,
                early_stopping=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                return_dict_in_generate=True)
        seqs = gen.sequences[:, len(prompt):].cpu().tolist()
        if beam_width > 1:
            scores = gen.sequences_scores.float().cpu().tolist()
        else:
            scores = [sum(torch.log_softmax(sc[0].float(), -1)[tok].item() for sc, tok in zip(gen.scores, seqs[0]))]
        return list(zip(seqs, scores))  # generate returns the beams best first


class PeerServicer:
    """slmrank.v1.Ranker on HFModel, one request at a time."""

    def __init__(self, model: HFModel) -> None:
        self.model = model
        self.pb2 = load_stubs().pb2
        self.lock = asyncio.Lock()

    async def _run(self, context: grpc.aio.ServicerContext, fn: Any, *args: Any) -> Any:
        try:
            async with self.lock:
                return await asyncio.to_thread(fn, *args)
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Score(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            prefix = _ids(request.prefix, "prefix") if request.HasField("prefix") else []
            samples = [_ids(s, f"samples[{i}]") for i, s in enumerate(request.samples)]
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rows = await self._run(context, self.model.score, prefix, samples, list(request.label_ids))
        return self.pb2.ScoreResponse(samples=[self.pb2.SampleScore(logprobs=r) for r in rows])

    async def BeamSearch(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            prompt = _ids(request.prompt, "prompt")
        except PeerError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        beams = await self._run(context, self.model.beam, prompt, request.beam_width, request.new_tokens)
        return self.pb2.BeamSearchResponse(beams=[self.pb2.Beam(ids=ids, logprob=lp) for ids, lp in beams])


async def start_peer(checkpoint_dir: str, host: str = "127.0.0.1", port: int = 0,
                     device: str = "cpu") -> tuple[grpc.aio.Server, int]:
    """Loads the checkpoint, binds, starts, health SERVING. Call inside the event loop that serves it."""
    model = await asyncio.to_thread(HFModel, checkpoint_dir, device)
    stubs = load_stubs()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20),
                                      ("grpc.max_send_message_length", 64 << 20)])
    stubs.pb2_grpc.add_RankerServicer_to_server(PeerServicer(model), server)
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
    server, port = await start_peer(args.checkpoint, args.host, args.port, args.device)
    print(f"[hf-peer] listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="a local Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    asyncio.run(_main(p.parse_args(argv)))


if __name__ == "__main__":
    main()
