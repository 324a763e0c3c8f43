"""The workloads, one definition for every load generator and benchmark (docs/benchmarks.md's
tables): W1..W8's fixed shapes (W7u, W8u: W7, W8 unconstrained; W7c, W8c: over the codes), a custom shape from its text, the seeded variable-shape mixes, a
`slmrank run` request file; their requests as slmrank.v1 messages; a request's logical FLOPs
(service/model/flops.py, the numerator of effective MFU).

  W1  Score       15 samples x 64 tokens, 2 labels                      qwen3-0.6b
  W2  BeamSearch  prompt 128, beam 100, 5 new tokens                    qwen2.5-0.5b
  W3  BeamSearch  prompt 480, beam 100, 5 new tokens                    qwen2.5-0.5b
  W4  Score       a 384-token prefix, 15 samples x 24 tokens, 2 labels  qwen3-0.6b
  W5  BeamSearch  prompt 480, beam 400, 5 new tokens                    qwen3-0.6b
  W6  BeamSearch  prompt 1000, beam 256, 3 new tokens (one at a time)   qwen3-1.7b
  W7  BeamSearch  prompt 128, beam 100, 3 new tokens, catalog sid-1m    qwen2.5-0.5b
  W8  BeamSearch  prompt 128, beam 400, 3 new tokens, catalog sid-1m    qwen3-0.6b
  W7u, W8u        W7, W8 without the catalog (any tokens): the unconstrained run of the same shape
  W7c, W8c        W7, W8 normalised over the catalog's code tokens (normalization "codes": the
                  code-vocabulary LM head; its logical FLOPs count the head over the 768 codes)

  sid-1m: 1M random 3-token semantic-ID items over 3 x 256 code tokens (service/loadgen/catalogs.py,
  seeded); a catalog workload runs against an artifact built with it (the benches build it).

  score-mix  Score: 5-30 samples, each 8-160 tokens; half the requests with a prefix of 32-256 tokens; 2 labels
  beam-mix   BeamSearch: prompt 32-480 tokens, beam 20-200, 3-5 new tokens
  mixed      3 Score (score-mix) : 1 BeamSearch (beam-mix), drawn per request

Every range is inclusive and uniform, every draw from one seeded generator (numpy's). A mix's
request that would break the server's limits (ModelInfo's: a Score's prefix + samples over
max_score_tokens, say) is drawn again, so the mix served is the distribution within those limits.

Only numpy and the generated stubs here: `slmrank bench` ships in the wheel and runs no model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..model.flops import beam_flops, score_flops
from .catalogs import num_codes

NORMALIZATION_CODES = 1  # slmrank.v1.Normalization's NORMALIZATION_CODES (the stubs load only to build messages)

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
    # generative retrieval (issue 28): beams held to a catalog (catalogs.CATALOGS), new = its code length
    "W7": dict(kind="beam", prompt=128, beam=100, new=3, model="embedded:qwen2.5-0.5b", catalog="sid-1m"),
    "W7u": dict(kind="beam", prompt=128, beam=100, new=3, model="embedded:qwen2.5-0.5b"),
    "W8": dict(kind="beam", prompt=128, beam=400, new=3, model="embedded:qwen3-0.6b", catalog="sid-1m"),
    "W8u": dict(kind="beam", prompt=128, beam=400, new=3, model="embedded:qwen3-0.6b"),
    "W7c": dict(kind="beam", prompt=128, beam=100, new=3, model="embedded:qwen2.5-0.5b", catalog="sid-1m",
                normalization="codes"),
    "W8c": dict(kind="beam", prompt=128, beam=400, new=3, model="embedded:qwen3-0.6b", catalog="sid-1m",
                normalization="codes"),
}

# the variable shapes: (low, high) inclusive ranges; prefix_share: the share of Score requests with a prefix
SCORE_MIX: dict[str, Any] = dict(samples=(5, 30), len=(8, 160), prefix_share=0.5, prefix=(32, 256), labels=2)
BEAM_MIX: dict[str, Any] = dict(prompt=(32, 480), beam=(20, 200), new=(3, 5))
# each mix's weights of Score and BeamSearch requests
MIXES: dict[str, dict[str, int]] = {"score-mix": {"score": 1}, "beam-mix": {"beam": 1},
                                    "mixed": {"score": 3, "beam": 1}}
MAX_REDRAWS = 1000  # a mix that cannot fit the server's limits in this many draws is refused


class WorkloadError(ValueError):
    """A workload text or request file that cannot be used; str(e) names the option."""


def parse_workload(text: str) -> dict[str, Any]:
    """W1..W8 (W7u, W8u), a mix (score-mix, beam-mix, mixed), or a custom shape:
    "score,prefix=0,samples=3,len=8,labels=2" / "beam,prompt=16,beam=4,new=3" (keys left out take
    W1's / W2's values). The shape's dict, with its name."""
    if text in WORKLOADS:
        return dict(WORKLOADS[text], name=text)
    if text in MIXES:
        return dict(kind="mix", weights=MIXES[text], name=text)
    kind, *parts = text.split(",")
    if kind not in ("score", "beam"):
        raise WorkloadError(f"--workload: {text!r} is not W1..W8, W7u, W8u, W7c, W8c, {', '.join(MIXES)}, nor "
                            "'score,...' / 'beam,...'")
    w: dict[str, Any] = dict(kind="score", prefix=0, samples=15, len=64, labels=2) if kind == "score" \
        else dict(kind="beam", prompt=128, beam=100, new=5)
    for part in parts:
        key, _, value = part.partition("=")
        if key not in w or key == "kind":
            raise WorkloadError(f"--workload: unknown key {key!r} for {kind}")
        try:
            w[key] = int(value)
        except ValueError:
            raise WorkloadError(f"--workload: {key}={value!r} is not an integer") from None
        if w[key] < (0 if key == "prefix" else 1):
            raise WorkloadError(f"--workload: {key} must be >= {0 if key == 'prefix' else 1}, got {w[key]}")
    w["name"] = text
    return w


class Requests:
    """A workload's requests as slmrank.v1 messages, every one different: ids uniform in [0, high)
    from one seeded generator. A fixed shape (W1..W8, custom; W7/W8's name their catalog) or a mix; limits: the server's
    (a ModelInfoResponse's Limits, or any object with its fields), which a mix's draws keep to."""

    def __init__(self, w: dict[str, Any], high: int, seed: int = 7, limits: Any = None) -> None:
        from ..serving.proto_gen import load as load_stubs

        self.w, self.high, self.limits = w, high, limits
        self.rng = np.random.default_rng(seed)
        self.pb2 = load_stubs().pb2
        # label ids: fixed per run, as a ranking task's " yes"/" no" would be
        labels = w.get("labels", SCORE_MIX["labels"] if w["kind"] == "mix" else 0)
        self.label_ids = self.ids(labels) if w["kind"] in ("score", "mix") else []
        if w["kind"] == "mix":
            kinds = sorted(w["weights"])
            weights = np.array([w["weights"][k] for k in kinds], dtype=float)
            self.kinds, self.p = kinds, weights / weights.sum()

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(0, self.high, n).tolist()

    def _uniform(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    def score(self, prefix: int, lens: Iterable[int]) -> Any:
        pb2 = self.pb2
        msg = pb2.ScoreRequest(samples=[pb2.Segment(ids=self.ids(n)) for n in lens], label_ids=self.label_ids)
        if prefix:
            msg.prefix.CopyFrom(pb2.Segment(ids=self.ids(prefix)))
        return msg

    def beam(self, prompt: int, beam: int, new: int, catalog: str = "", normalization: str = "vocab") -> Any:
        return self.pb2.BeamSearchRequest(prompt=self.pb2.Segment(ids=self.ids(prompt)), beam_width=beam,
                                          new_tokens=new, catalog=catalog,
                                          normalization=self.pb2.NORMALIZATION_CODES if normalization == "codes"
                                          else self.pb2.NORMALIZATION_VOCABULARY)

    def next(self) -> Any:
        w = self.w
        if w["kind"] == "score":
            return self.score(w["prefix"], [w["len"]] * w["samples"])
        if w["kind"] == "beam":
            return self.beam(w["prompt"], w["beam"], w["new"], w.get("catalog", ""), w.get("normalization", "vocab"))
        kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.p))] if len(self.kinds) > 1 else self.kinds[0]
        for _ in range(MAX_REDRAWS):
            shape = self._draw_score() if kind == "score" else self._draw_beam()
            if self._fits(kind, shape):
                return self.score(*shape) if kind == "score" else self.beam(*shape)
        raise WorkloadError(f"--workload {w['name']}: no {kind} request within the server's limits in "
                            f"{MAX_REDRAWS} draws ({self.limits})")

    def _draw_score(self) -> tuple[int, list[int]]:
        m = SCORE_MIX
        lens = [self._uniform(m["len"]) for _ in range(self._uniform(m["samples"]))]
        prefix = self._uniform(m["prefix"]) if self.rng.random() < m["prefix_share"] else 0
        return prefix, lens

    def _draw_beam(self) -> tuple[int, int, int]:
        m = BEAM_MIX
        return self._uniform(m["prompt"]), self._uniform(m["beam"]), self._uniform(m["new"])

    def _fits(self, kind: str, shape: tuple) -> bool:
        lim = self.limits
        if lim is None:
            return True
        if kind == "score":
            prefix, lens = shape
            return len(lens) <= lim.max_samples and prefix + sum(lens) <= lim.max_score_tokens
        prompt, beam, new = shape
        return prompt <= lim.max_prompt_tokens and beam <= lim.max_beam_width and new <= lim.max_new_tokens


def file_requests(path: str | Path) -> list[Any]:
    """The requests of a `slmrank run` JSONL file (README.md; service/runtime/jsonl.py parses each
    line) as slmrank.v1 messages, in file order, with label_ids or label_texts as the line gives
    them. A bad line is a WorkloadError naming the line and the field; an empty file is one too."""
    from ..runtime.jsonl import parse_request
    from ..runtime.requests import RequestError, ScoreRequest
    from ..serving.proto_gen import load as load_stubs

    pb2 = load_stubs().pb2
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"--requests: cannot read {path}: {e.strerror}") from None
    out: list[Any] = []
    texts: list[str] = []

    def keep_texts(labels: Sequence[str]) -> tuple[int, ...]:
        # label_texts go to the server as they are (ScoreRequest.label_texts): its tokenizer is the
        # one that counts, and tokenizing them is part of the request's cost being measured
        texts[:] = labels
        return ()

    for n, line in enumerate(text.split("\n"), 1):  # "\n" only: U+2028 is legal inside JSON strings
        if not line.strip():
            continue
        texts.clear()
        try:
            r = parse_request(line, labels_of=keep_texts)
        except RequestError as e:
            raise WorkloadError(f"--requests: {path} line {n}: {e}") from None
        if isinstance(r, ScoreRequest):
            msg = pb2.ScoreRequest(samples=[pb2.Segment(ids=list(s)) for s in r.samples], label_ids=list(r.label_ids),
                                   label_texts=texts)
            if r.prefix_ids:
                msg.prefix.CopyFrom(pb2.Segment(ids=list(r.prefix_ids)))
        else:
            for field in ("beam_width", "new_tokens"):
                value = getattr(r, field)
                if isinstance(value, bool) or not isinstance(value, int):
                    raise WorkloadError(f"--requests: {path} line {n}: {field}: must be an integer, got {value!r}")
            msg = pb2.BeamSearchRequest(prompt=pb2.Segment(ids=list(r.prompt_ids)), beam_width=r.beam_width,
                                        new_tokens=r.new_tokens)
        out.append(msg)
    if not out:
        raise WorkloadError(f"--requests: {path} holds no request")
    return out


def flops_per_request(cfg: Any, w: dict[str, Any]) -> int:
    """The logical FLOPs of one request of the fixed shape w on the model of config cfg (W7c/W8c:
    the LM head over the generated catalog's code tokens)."""
    if w["kind"] == "score":
        return score_flops(cfg, w["prefix"], [w["len"]] * w["samples"])
    width = num_codes(w["catalog"]) if w.get("normalization") == "codes" else None
    return beam_flops(cfg, w["prompt"], w["beam"], w["new"], width)


def message_flops(cfg: Any, msg: Any, codes: Mapping[str, int] | None = None) -> int:
    """The logical FLOPs of a ScoreRequest / BeamSearchRequest message of token ids. codes: each
    catalog's code tokens (ModelInfo's num_codes), for a request normalised over them (else a
    generated catalog's, else the vocabulary's head is counted)."""
    if hasattr(msg, "samples"):
        return score_flops(cfg, len(msg.prefix.ids), [len(s.ids) for s in msg.samples])
    width = None
    if msg.normalization == NORMALIZATION_CODES:
        width = (codes or {}).get(msg.catalog) or num_codes(msg.catalog)
    return beam_flops(cfg, len(msg.prompt.ids), msg.beam_width, msg.new_tokens, width)
