"""The benchmarks' workloads (BENCHMARKS.md's table), one definition for every bench: W1..W6's
shapes and models, a custom shape from its text, the requests of a shape from a seed (as gRPC
messages for the benches that call a server, as the runtime's requests for those that run the
executor), and a request's logical FLOPs (service/model/flops.py, the numerator of effective MFU).

  W1  Score       15 samples x 64 tokens, 2 labels                      qwen3-0.6b
  W2  BeamSearch  prompt 128, beam 100, 5 new tokens                    qwen2.5-0.5b
  W3  BeamSearch  prompt 480, beam 100, 5 new tokens                    qwen2.5-0.5b
  W4  Score       a 384-token prefix, 15 samples x 24 tokens, 2 labels  qwen3-0.6b
  W5  BeamSearch  prompt 480, beam 400, 5 new tokens                    qwen3-0.6b
  W6  BeamSearch  prompt 1000, beam 256, 3 new tokens (one at a time)   qwen3-1.7b
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.model.flops import beam_flops, score_flops

ID_HIGH = 150000  # token ids are uniform in [0, min(ID_HIGH, the vocabulary))

# kind "score": prefix, samples, len (tokens a sample), labels; kind "beam": prompt, beam, new (tokens);
# model: the embedded spec it runs on; levels: bench_grpc's default closed-loop levels, where not 1..64
WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": dict(kind="score", prefix=0, samples=15, len=64, labels=2, model="embedded:qwen3-0.6b"),
    "W2": dict(kind="beam", prompt=128, beam=100, new=5, model="embedded:qwen2.5-0.5b"),
    "W3": dict(kind="beam", prompt=480, beam=100, new=5, model="embedded:qwen2.5-0.5b"),
    "W4": dict(kind="score", prefix=384, samples=15, len=24, labels=2, model="embedded:qwen3-0.6b"),
    "W5": dict(kind="beam", prompt=480, beam=400, new=5, model="embedded:qwen3-0.6b"),
    "W6": dict(kind="beam", prompt=1000, beam=256, new=3, model="embedded:qwen3-1.7b", levels="1"),
}

# requests per batch where the executor is driven directly (bench_executor): W6 is one request at
# a time (latency)
EXECUTOR_BATCH = {"W1": 8, "W2": 8, "W3": 4, "W4": 8, "W5": 2, "W6": 1}


def parse_workload(text: str) -> dict[str, Any]:
    """W1..W6, or a custom shape: "score,prefix=0,samples=3,len=8,labels=2" / "beam,prompt=16,beam=4,new=3"
    (keys left out take W1's / W2's values). The shape's dict, with its name."""
    if text in WORKLOADS:
        return dict(WORKLOADS[text], name=text)
    kind, *parts = text.split(",")
    if kind not in ("score", "beam"):
        raise SystemExit(f"--workload: {text!r} is not W1..W6 nor 'score,...' / 'beam,...'")
    w: dict[str, Any] = dict(kind="score", prefix=0, samples=15, len=64, labels=2) if kind == "score" \
        else dict(kind="beam", prompt=128, beam=100, new=5)
    for part in parts:
        key, _, value = part.partition("=")
        if key not in w or key == "kind":
            raise SystemExit(f"--workload: unknown key {key!r} for {kind}")
        w[key] = int(value)
    w["name"] = text
    return w


class Requests:
    """A shape's requests as slmrank.v1 messages, every one different: ids uniform in [0, high)
    from one seeded generator (numpy's)."""

    def __init__(self, w: dict[str, Any], high: int, seed: int = 7) -> None:
        from service.serving.proto_gen import load as load_stubs

        self.w, self.high = w, high
        self.rng = np.random.default_rng(seed)
        self.pb2 = load_stubs().pb2
        # label ids: fixed per run, as a ranking task's " yes"/" no" would be
        self.label_ids = self.ids(w["labels"]) if w["kind"] == "score" else []

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.high, n).tolist()

    def next(self) -> Any:
        w, pb2 = self.w, self.pb2
        if w["kind"] == "score":
            msg = pb2.ScoreRequest(samples=[pb2.Segment(ids=self.ids(w["len"])) for _ in range(w["samples"])],
                                   label_ids=self.label_ids)
            if w["prefix"]:
                msg.prefix.CopyFrom(pb2.Segment(ids=self.ids(w["prefix"])))
            return msg
        return pb2.BeamSearchRequest(prompt=pb2.Segment(ids=self.ids(w["prompt"])), beam_width=w["beam"],
                                     new_tokens=w["new"])


def runtime_request(w: dict[str, Any], g: Any) -> Any:
    """One request of the shape as the runtime takes it (a ScoreRequest / BeamRequest), its ids
    uniform in [0, ID_HIGH) from the torch.Generator g (the samples before the prefix); a Score's
    label ids are 1000, 2000, ..."""
    import torch

    from service.runtime.requests import BeamRequest, ScoreRequest

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, ID_HIGH, (n,), generator=g).tolist())

    if w["kind"] == "score":
        samples = tuple(ids(w["len"]) for _ in range(w["samples"]))
        labels = tuple(1000 * (i + 1) for i in range(w["labels"]))
        return ScoreRequest(samples=samples, label_ids=labels, prefix_ids=ids(w["prefix"]) if w["prefix"] else ())
    return BeamRequest(prompt_ids=ids(w["prompt"]), beam_width=w["beam"], new_tokens=w["new"])


def flops_per_request(cfg: Any, w: dict[str, Any]) -> int:
    """The logical FLOPs of one request of the shape on the model of config cfg."""
    if w["kind"] == "score":
        return score_flops(cfg, w["prefix"], [w["len"]] * w["samples"])
    return beam_flops(cfg, w["prompt"], w["beam"], w["new"])


def request_flops(cfg: Any, req: Any) -> int:
    """The logical FLOPs of a runtime request (ScoreRequest / BeamRequest), whatever its shape."""
    from service.runtime.requests import ScoreRequest

    if isinstance(req, ScoreRequest):
        return score_flops(cfg, len(req.prefix_ids), [len(s) for s in req.samples])
    return beam_flops(cfg, len(req.prompt_ids), req.beam_width, req.new_tokens)
