"""The float64 truth: an artifact's weights upcast to float64 and run by a plain decoder written
here, every operation in float64 (`slmrank evaluate --truth float64`).

Neither runtime can give it: both follow Hugging Face's numerics (service/model/layers.py), which
take RMSNorm's variance, RoPE's tables, attention's scores and the log-softmax in float32 whatever
the weights' dtype, so a float64 run of them is float32 where it matters. This module is a second,
independent decoder of the same artifact layout (fused wqkv/bqkv, wgu; q/k norms for Qwen3; a tied
or own LM head, or a classification head), run one request at a time with a K/V cache:

  Score       the prefix once, then each sample after it (positions from the prefix's length, as
              service/runtime/batch.py packs them), the label log-probs at its last token (or the
              classification head's outputs)
  BeamSearch  the prompt once, then each step's beams over the shared prompt K/V and their own
              suffix K/V: top-B of the first distribution, then top-B of B x V cumulative scores a
              step (no length penalty, every beam exactly new_tokens long), masked to the catalog's
              trie where the request names one; beams left at -inf are dropped

It is slow (float64, no batching across requests) and meant for acceptance runs, on the CPU or a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..artifact.artifact import Artifact
from ..artifact.catalog import Catalog
from ..model.checkpoint import fp8_weight_names
from ..runtime.requests import Beam, BeamRequest, BeamResult, ScoreRequest, ScoreResult

F64 = torch.float64
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [..., S, G, E]


class Float64Model:
    def __init__(self, artifact: Artifact, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg = artifact.config
        self.device = torch.device(device)
        self.w = artifact.load_weights(self.device, F64)
        for name in fp8_weight_names(cfg, artifact.fp8):  # e4m3 weights (`build --fp8`): dequantized, exactly,
            scale = self.w.pop(name + ".scale").to(F64).unsqueeze(1)  # or their model-dtype copies where kept
            full, _ = self.w.pop(name + ".full", None), self.w.pop(name + ".min_rows", None)
            self.w[name] = full if full is not None else self.w[name].to(F64) * scale
        self.catalogs = {c.name: c for c in artifact.catalogs}
        e = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, e, 2, dtype=F64, device=self.device) / e))
        self.head = self.w.get("lm_head", self.w["embed"]) if not cfg.has_cls_head else self.w["cls_head"]

    # ---- the decoder ----------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [B, N, heads, E]; positions [N]: HF's half-split rotation, in float64
        freqs = positions.to(F64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def _forward(self, tokens: torch.Tensor, start: int, shared: KV | None, own: KV | None
                 ) -> tuple[torch.Tensor, KV]:
        """tokens [B, N] at positions start.. start+N-1. Each row sees all of `shared` (one K/V for
        every row: a prefix or prompt, [S, G, E]), its own earlier K/V `own` ([B, S', G, E]) and its
        new tokens causally. Returns (the final-normed hidden states [B, N, D], each layer's own K/V
        with the new tokens appended)."""
        cfg, w = self.cfg, self.w
        b, n = tokens.shape
        h, g, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rep = h // g
        scale = 1.0 / math.sqrt(e)
        positions = torch.arange(start, start + n, device=self.device)
        x = w["embed"][tokens]  # [B, N, D]
        out_kv: KV = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            a = self._norm(x, w[p + "attn_norm"])
            qkv = F.linear(a, w[p + "wqkv"], w.get(p + "bqkv"))
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q, k, v = q.reshape(b, n, h, e), k.reshape(b, n, g, e), v.reshape(b, n, g, e)
            if cfg.qk_norm:
                q, k = self._norm(q, w[p + "q_norm"]), self._norm(k, w[p + "k_norm"])
            q, k = self._rope(q, positions), self._rope(k, positions)
            if own is not None:
                k, v = torch.cat((own[i][0], k), dim=1), torch.cat((own[i][1], v), dim=1)
            out_kv.append((k, v))
            # own keys: S' earlier ones, then the N new ones causally
            s_own = k.shape[1]
            query_at = s_own - n + torch.arange(n, device=self.device)  # each new token's place among the own keys
            visible = torch.arange(s_own, device=self.device)[None, :] <= query_at[:, None]
            kr, vr = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # [B, S', H, E]
            s2 = torch.einsum("bnhe,bshe->bhns", q, kr) * scale
            s2 = s2.masked_fill(~visible, -math.inf)
            if shared is not None:
                ks, vs = (t.repeat_interleave(rep, dim=1) for t in shared[i])  # [S, H, E]
                s1 = torch.einsum("bnhe,she->bhns", q, ks) * scale
                probs = torch.softmax(torch.cat((s1, s2), dim=-1), dim=-1)
                p1, p2 = probs.split([s1.shape[-1], s2.shape[-1]], dim=-1)
                attn = torch.einsum("bhns,she->bnhe", p1, vs) + torch.einsum("bhns,bshe->bnhe", p2, vr)
            else:
                attn = torch.einsum("bhns,bshe->bnhe", torch.softmax(s2, dim=-1), vr)
            x = x + F.linear(attn.reshape(b, n, cfg.q_size), w[p + "wo"])
            m = self._norm(x, w[p + "mlp_norm"])
            gate, up = F.linear(m, w[p + "wgu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "wdown"])
        return self._norm(x, w["final_norm"]), out_kv

    def _prefix(self, ids: tuple[int, ...]) -> KV | None:
        """The K/V of a prefix ([S, G, E] a layer), None for none."""
        if not ids:
            return None
        _, kv = self._forward(self._tokens(ids)[None], 0, None, None)
        return [(k[0], v[0]) for k, v in kv]

    def _tokens(self, ids: tuple[int, ...] | list[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

    # ---- requests -------------------------------------------------------------------------------

    @torch.inference_mode()
    def score(self, req: ScoreRequest) -> ScoreResult:
        shared = self._prefix(req.prefix_ids)
        start = len(req.prefix_ids)
        rows = []
        for sample in req.samples:
            hidden, _ = self._forward(self._tokens(sample)[None], start, shared, None)
            out = F.linear(hidden[0, -1], self.head)
            if not self.cfg.has_cls_head:
                out = torch.log_softmax(out, dim=-1)[self._tokens(req.label_ids)]
            rows.append(out.tolist())
        return ScoreResult(rows)

    @torch.inference_mode()
    def beam(self, req: BeamRequest) -> BeamResult:
        width, steps = req.beam_width, req.new_tokens
        catalog = self.catalogs.get(req.catalog) if req.catalog else None
        prompt = req.prompt_ids
        hidden, kv = self._forward(self._tokens(prompt)[None], 0, None, None)
        shared = [(k[0], v[0]) for k, v in kv]  # the prompt's K/V, one copy for every beam
        logp = torch.log_softmax(F.linear(hidden[:, -1], self.head), dim=-1)  # [1, V]
        own: KV | None = None  # each beam's suffix K/V, in the order of logp's rows
        nodes = torch.zeros(1, dtype=torch.int64)  # each row's trie node (a catalog's root: 0)
        seqs = torch.zeros(1, 0, dtype=torch.int64, device=self.device)
        scores = torch.zeros(1, dtype=F64, device=self.device)
        for t in range(steps):
            if catalog is not None:
                logp = _mask(logp, catalog, nodes)
            vocab = logp.shape[-1]
            cand = (scores[:, None] + logp).reshape(-1)  # [rows x V], parent-major
            scores, flat = cand.topk(min(width, cand.numel()))
            parents, tokens = flat // vocab, flat % vocab
            seqs = torch.cat((seqs[parents], tokens[:, None]), dim=1)
            if catalog is not None:
                nodes = _advance(catalog, nodes[parents.cpu()], tokens.cpu())
            if t + 1 == steps:
                break
            if own is not None:
                own = [(k[parents], v[parents]) for k, v in own]
            hidden, own = self._forward(tokens[:, None], len(prompt) + t, shared, own)
            logp = torch.log_softmax(F.linear(hidden[:, -1], self.head), dim=-1)
        keep = torch.isfinite(scores)
        item_ids = catalog.item_of(seqs[keep].cpu().numpy()) if catalog is not None else None
        return BeamResult([Beam(ids, lp, item_ids[i] if item_ids else None) for i, (ids, lp) in
                           enumerate(zip(seqs[keep].tolist(), scores[keep].tolist()))])


def _mask(logp: torch.Tensor, catalog: Catalog, nodes: torch.Tensor) -> torch.Tensor:
    """Each beam's log-probs outside its trie node's children -inf (a node < 0: a dead beam, all -inf)."""
    allowed = torch.zeros(logp.shape, dtype=torch.bool)
    for row, node in enumerate(nodes.tolist()):
        if node >= 0:
            lo, hi = int(catalog.offsets[node]), int(catalog.offsets[node + 1])
            allowed[row, torch.from_numpy(catalog.tokens[lo:hi].astype("int64"))] = True
    return logp.masked_fill(~allowed.to(logp.device), -math.inf)


def _advance(catalog: Catalog, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The child of each node along its token (edge e's child is node e + 1), -1 where there is none."""
    out = []
    for node, tok in zip(nodes.tolist(), tokens.tolist()):
        nxt = -1
        if node >= 0:
            lo, hi = int(catalog.offsets[node]), int(catalog.offsets[node + 1])
            edges = (catalog.tokens[lo:hi] == tok).nonzero()[0]
            nxt = lo + int(edges[0]) + 1 if len(edges) else -1
        out.append(nxt)
    return torch.tensor(out, dtype=torch.int64)
