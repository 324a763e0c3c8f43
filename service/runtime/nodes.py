"""Node implementations of the Python artifact runtime: one function per DAG node type.

Each takes (ctx, node, env) and writes its outputs into env; env maps buffer names to tensors and
admits only the buffers the node declares (service/runtime/env.py).
The C++ runtime implements the same node types with the same ATen ops in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..model.config import ModelConfig
from ..artifact.dag import Node
from ..model.layers import (LayerWeights, Quantized, attention_output_and_mlp, blockwise_self_attention, fp8_in_kernel,
                            gemm_weight, linear, qkv_projection, residual_rms_norm, residual_rms_norm_for,
                            two_part_attention, two_part_attention_by_runs)
from ..siblings import sibling

# kernels/ under this install's name (service/siblings.py): checkout and wheel name it differently
_attention = sibling("kernels.attention")
masked_attention_ref, segment_bounds = _attention.masked_attention_ref, _attention.segment_bounds
segment_key_ranges, varlen_attention = _attention.segment_key_ranges, _attention.varlen_attention
_trie = sibling("kernels.trie")
trie_children_ref, trie_advance_ref = _trie.trie_children_ref, _trie.trie_advance_ref

Env = MutableMapping[str, torch.Tensor]


@dataclass
class NodeContext:
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    layers: list[LayerWeights]
    rope_cos: torch.Tensor  # [P, E] in the compute dtype
    rope_sin: torch.Tensor
    fused: Any = None  # fused Triton kernels (service.runtime.fused), or None: the plain-torch ops
    # e4m3 weights' row floors (checkpoint.fp8_min_rows): below one, a GEMM takes NAME.full
    fp8_min_rows: dict[str, int] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.cfg.head_dim ** -0.5


def _causal_within(pos: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    # [..., N] -> [..., N, N]: same segment and key position <= query position
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
    return same & (pos.unsqueeze(-2) <= pos.unsqueeze(-1))


def _uses_varlen(ctx: NodeContext, seg: torch.Tensor) -> bool:
    # FlashAttention takes 16-bit inputs only: float32 on CUDA keeps the dense-mask reference path
    return seg.is_cuda and ctx.rope_cos.dtype in (torch.float16, torch.bfloat16)


def score_masks(ctx: NodeContext, node: Node, env: Env) -> None:
    pos, seg, prefix, request_rows, prefix_rows, last = (env[n] for n in node.inputs)
    if ctx.fused is not None:  # the fused segment attention (kernels/segment_attention.py): each row's key ranges
        env["key_ranges"] = segment_key_ranges(seg, prefix, request_rows, prefix_rows)
        return
    if _uses_varlen(ctx, seg):  # varlen attention: segment bounds, and each request's prefix (the shared K/V)
        r, s, chunk = prefix_rows.shape[0], last.shape[0], node.attrs["max_rows"]
        # runs: the prefixes and samples, and the padding in chunks of at most max_rows
        env["cu_self"] = segment_bounds(seg, s + r + seg.shape[0] // chunk + 1, chunk)
        env["cu_blocks"] = request_rows.to(torch.int32)  # [R+1]: each request's rows
        env["prefix_len"] = prefix_rows.to(torch.int32)  # [R]
        env["has_ctx"] = prefix.ge(0).unsqueeze(1)  # [T, 1]: a sample after a prefix
        return
    env["mask_self"] = _causal_within(pos, seg)  # [T, T]: causal within a segment
    env["mask_ctx"] = prefix.unsqueeze(1) == seg.unsqueeze(0)  # a sample sees its whole prefix


def beam_masks(ctx: NodeContext, node: Node, env: Env) -> None:
    pos, seg, beam_req, plen, last = (env[n] for n in node.inputs)
    if ctx.fused is not None:  # the fused segment attention: each row's key ranges, one causal segment per prompt
        env["key_ranges"] = segment_key_ranges(seg)
    elif _uses_varlen(ctx, seg):  # varlen prefill attention: one causal segment per prompt (+ the padding run)
        env["cu_self"] = segment_bounds(seg, last.shape[0] + 1)
    else:
        env["mask_self"] = _causal_within(pos, seg)  # causal within a prompt
    # a beam row sees its request's prompt; a padding row (request R) no prompt token (seg < R)
    env["mask_beam"] = beam_req.unsqueeze(1) == seg.unsqueeze(0)
    if ctx.fused is not None:  # the fused decode attention reads each beam row's prompt range instead of mask_beam
        env["kv_len"] = plen  # 0 for a padding row: no prompt key
        env["kv_start"] = last.index_select(0, beam_req.clamp_max(last.shape[0] - 1)) - plen + 1


def embedding(ctx: NodeContext, node: Node, env: Env) -> None:
    env[node.outputs[0]] = F.embedding(env[node.inputs[0]].reshape(-1), ctx.weights["embed"])


def decoder_layer(ctx: NodeContext, node: Node, env: Env) -> None:
    cfg, i, mode = ctx.cfg, node.attrs["layer"], node.attrs["mode"]
    w = ctx.layers[i].at_rows(env["x"].shape[0])  # the weights a GEMM of this many rows takes (fp8 row floors)
    pending = env["mlp_out"] if "mlp_out" in node.inputs else None  # the previous layer's MLP output
    # the first norm quantizes its output for an FP8 q/k/v GEMM on the fused path
    x, h = residual_rms_norm_for(env["x"], pending, w.attn_norm, cfg.rms_norm_eps, ctx.fused, w.wqkv, w.wqkv_scale)
    if mode in ("score", "prefill"):
        q, k, v = qkv_projection(cfg, w, h, env["positions"], 0, ctx.rope_cos, ctx.rope_sin, ctx.fused)
        if ctx.fused is not None:  # one kernel: each row's prefix and own-segment keys (the masks node's key_ranges)
            attn = ctx.fused.segment_attention(q, k, v, env["key_ranges"], ctx.scale)
        elif "cu_self" in env:  # on CUDA: varlen flash attention over the packed segments
            attn = varlen_layer_attention(q, k, v, env, mode, ctx.scale, node.attrs.get("max_rows", 0))
        elif q.device.type == "cpu":  # a block (request) at a time: the same bytes packed as alone
            attn = blockwise_self_attention(q, k, v, env["mask_self"], env["mask_ctx"] if mode == "score" else None,
                                            ctx.scale)
        elif mode == "score":
            attn = two_part_attention(q, k, v, env["mask_ctx"], k, v, env["mask_self"], ctx.scale)
        else:
            attn, _ = masked_attention_ref(q, k, v, env["mask_self"], ctx.scale)
        if mode == "prefill":  # the prompt K/V every beam shares
            env[f"prompt_k.{i}"], env[f"prompt_v.{i}"] = k, v
    else:  # decode step t: this token's K/V goes to suffix slot t-1, then prompt part + suffix part
        t = node.step
        suffix_k, suffix_v = env[f"suffix_k.{i}"], env[f"suffix_v.{i}"]  # [R*B, n-1, G, E]
        if ctx.fused is not None:
            # one kernel: q/k norm + RoPE of the GEMM's output, this token's k/v into suffix slot t-1, then
            # the row's own prompt range (beam_masks) + its first t suffix slots
            norms = (w.q_norm, w.k_norm) if cfg.qk_norm else (None, None)
            attn = ctx.fused.decode_attention_qkv(
                linear(h, w.wqkv, w.bqkv, w.wqkv_scale), env["beam_pos"], t - 1, ctx.rope_cos, ctx.rope_sin,
                cfg.num_heads, *norms, cfg.rms_norm_eps, env[f"prompt_k.{i}"], env[f"prompt_v.{i}"], env["kv_start"],
                env["kv_len"], suffix_k, suffix_v, t, ctx.scale, suffix_rows=env["suffix_rows"])
        else:  # this token's k and v go straight into suffix slot t-1, then the two parts
            q, _, _ = qkv_projection(cfg, w, h, env["beam_pos"], t - 1, ctx.rope_cos, ctx.rope_sin, None,
                                     k_out=suffix_k[:, t - 1], v_out=suffix_v[:, t - 1])
            if q.device.type == "cpu":  # the prompt part a request's rows at a time: the same bytes packed as alone
                attn = two_part_attention_by_runs(q, env[f"prompt_k.{i}"], env[f"prompt_v.{i}"], env["mask_beam"],
                                                  suffix_k[:, :t], suffix_v[:, :t], ctx.scale)
            else:
                attn = two_part_attention(q, env[f"prompt_k.{i}"], env[f"prompt_v.{i}"], env["mask_beam"],
                                          suffix_k[:, :t], suffix_v[:, :t], None, ctx.scale)
    x, mlp_out = attention_output_and_mlp(cfg, w, x, attn, ctx.fused)
    if "mlp_out" in node.outputs:  # the next layer's (or the final) norm adds it, in the same kernel
        env["x"], env["mlp_out"] = x, mlp_out
    else:  # a DAG without the pending buffer
        env["x"] = x + mlp_out


def varlen_layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, env: Env, mode: str,
                            scale: float, max_rows: int) -> torch.Tensor:
    cu_self = env["cu_self"]
    if mode == "prefill":
        t = q.shape[0]
        return varlen_attention(q, k, v, cu_self, cu_self, t, t, True, scale)[0]
    # each sample's segment (no longer than max_rows, the padding chunked to it), causal
    out_self, lse_self = varlen_attention(q, k, v, cu_self, cu_self, max_rows, max_rows, True, scale)
    # every row of a request (the last slot: up to T, with the padding) against the request's prefix;
    # only samples after a prefix keep it
    t = q.shape[0]
    out_ctx, lse_ctx = varlen_attention(q, k, v, env["cu_blocks"], env["cu_blocks"], t, t, False, scale,
                                        env["prefix_len"])
    lse_ctx = lse_ctx.masked_fill(env["has_ctx"].logical_not(), float("-inf"))
    # the log-sum-exp merge as one interpolation: out_self + sigmoid(lse_ctx - lse_self) * (out_ctx - out_self),
    # exact algebra (a row without a prefix gets weight 0); one pass over [T, H, E] instead of a float32 merge
    weight = torch.sigmoid(lse_ctx - lse_self).to(out_self.dtype).unsqueeze(-1)  # [T, H, 1]
    return torch.lerp(out_self, out_ctx, weight)


def rms_norm_node(ctx: NodeContext, node: Node, env: Env) -> None:
    pending = env[node.inputs[1]] if len(node.inputs) > 1 else None  # the last layer's MLP output
    _, env[node.outputs[0]] = residual_rms_norm(env[node.inputs[0]], pending, ctx.weights[node.attrs["weight"]],
                                                ctx.cfg.rms_norm_eps, ctx.fused)


def gather_rows(ctx: NodeContext, node: Node, env: Env) -> None:
    x, rows = (env[n] for n in node.inputs)
    env[node.outputs[0]] = x.index_select(0, rows)


def lm_head(ctx: NodeContext, node: Node, env: Env) -> None:
    x = env[node.inputs[0]]
    if "lm_head" in ctx.weights:  # tied embeddings share the table (unless the head is fp8)
        w, scale = gemm_weight(ctx.weights, ctx.fp8_min_rows, "lm_head", x.shape[0])
    else:
        w, scale = ctx.weights["embed"], None
    codes = optional_input(node, env, "beam_codes")
    if codes is not None:  # a batch normalised over a catalog's code tokens: their rows only, -inf past them
        rows = codes.clamp_min(0)
        w, scale = w.index_select(0, rows), None if scale is None else scale.index_select(0, rows)
    if fp8_in_kernel(ctx.fused, x, w, scale):  # the final norm's rows, quantized in one kernel
        x = Quantized(*ctx.fused.quantize_rows(x))
    logits = linear(x, w, None, scale)
    if codes is not None:
        logits = logits.masked_fill(codes.lt(0), float("-inf"))
    # the fused beam step reads the model-dtype logits once, computing in float32 (no float32
    # [rows, V] copy); the consumers on the ATen path upcast as before
    env[node.outputs[0]] = logits if ctx.fused is not None else logits.float()


def cls_head(ctx: NodeContext, node: Node, env: Env) -> None:
    x = env[node.inputs[0]]
    w, scale = gemm_weight(ctx.weights, ctx.fp8_min_rows, "cls_head", x.shape[0])
    logits = linear(x, w, None, scale)
    env[node.outputs[0]] = logits.float()


def label_logprobs(ctx: NodeContext, node: Node, env: Env) -> None:
    logits, labels = (env[n] for n in node.inputs)
    env[node.outputs[0]] = torch.log_softmax(logits.float(), dim=-1).gather(1, labels)


def _mask_extra_beams(scores: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    # scores: [R, B]; ranks >= the request's own beam width are dead (-inf), so a bucket's wider
    # beam never changes a narrower request's search.
    rank = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0)
    return scores.masked_fill(rank >= widths.unsqueeze(1), float("-inf"))


def beam_state(ctx: NodeContext, node: Node, env: Env) -> None:
    """The per-beam suffix K/V, one slot per decode step, one row per packed beam row (beam_slot
    [N]), slots from beam_seqs [R, B, n]: suffix_k.{i} / suffix_v.{i} [N, max(n-1, 1), G, E]. With
    the fused kernels they are views of one buffer suffix_kv [layers, 2, N, slots, G, E], never
    reordered: suffix_rows [N, slots] names the row that holds each slot of a row's beam
    (kernels/decode_attention.py), every row's own to begin with (cpp_dag/node_beam.cpp alike)."""
    cfg = ctx.cfg
    seqs, slot = (env[n] for n in node.inputs)
    shape = (slot.shape[0], max(seqs.shape[2] - 1, 1), cfg.num_kv_heads, cfg.head_dim)
    if ctx.fused is None:
        for i in range(cfg.num_layers):
            for kv in "kv":
                env[f"suffix_{kv}.{i}"] = torch.zeros(shape, dtype=ctx.rope_cos.dtype, device=seqs.device)
        return
    set_beam_suffix(env, torch.zeros((cfg.num_layers, 2, *shape), dtype=ctx.rope_cos.dtype, device=seqs.device))
    # plain torch, as cpp_dag/node_beam.cpp writes it: ctx.fused is the extension's TritonKernels on a GPU
    rows = torch.arange(shape[0], dtype=torch.int64, device=seqs.device)
    env["suffix_rows"] = rows.unsqueeze(1).expand(shape[0], shape[1]).contiguous()


def to_rows(rect: torch.Tensor, slot: torch.Tensor, pad: float) -> torch.Tensor:
    """[R, B] bookkeeping -> [N] packed beam rows: row i takes rect.view(-1)[slot[i]]; a padding row
    (slot R*B, one past the end) takes pad."""
    return torch.constant_pad_nd(rect.reshape(-1), [0, 1], pad).index_select(0, slot)


def beam_allowed(ctx: NodeContext, node: Node, env: Env) -> None:
    """Each row's allowed next tokens from the catalogs' trie (catalog.py trie_forest): the children
    of the row's trie node; every token for an unconstrained row (node -1). Static shapes, no host
    sync. Step 0: a row per request, at its catalog's root (beam_trie [R, 1]); step t: the N packed
    rows, each at its beam's node (beam_trie [R, B] through beam_slot). allowed: bool [rows, V]
    (ATen path) or kernels/beam_topk.py's int32 bitmask [rows, ceil(V / 32)] (fused path)."""
    w = ctx.weights
    if node.step == 0:
        cat = env["beam_catalog"]
        roots = w["catalog.roots"]  # [C + 1]: the last is -1, unconstrained
        trie = roots.index_select(0, torch.where(cat >= 0, cat, roots.shape[0] - 1))  # [R]
        env["beam_trie"] = trie.unsqueeze(1)
    else:
        trie = to_rows(env["beam_trie"], env["beam_slot"], -1)  # [N]
    vocab, cols = ctx.cfg.vocab_size, None
    if (codes := optional_input(node, env, "beam_codes")) is not None:  # the columns: the catalog's code tokens
        cols, vocab = code_columns_of(codes, vocab), codes.shape[0]
    if ctx.fused is not None:  # kernels/trie.py: kernels/beam_topk.py's int32 bitmask in one kernel
        env["allowed"] = ctx.fused.trie_allowed(trie.contiguous(), w["catalog.offsets"], w["catalog.tokens"], cols,
                                                (vocab + 31) // 32)
        return
    tokens, _, valid = trie_children(w, trie)
    if cols is not None:
        tokens = cols.index_select(0, tokens.reshape(-1)).view_as(tokens)
    cols_or_pad = torch.where(valid, tokens, vocab)  # a column past the vocabulary takes the window's unused slots
    allowed = torch.zeros(trie.shape[0], vocab + 1, dtype=torch.bool, device=trie.device).scatter_(1, cols_or_pad, True)
    env["allowed"] = allowed[:, :vocab].logical_or(trie.lt(0).unsqueeze(1))


def code_columns_of(codes: torch.Tensor, vocab: int) -> torch.Tensor:
    """beam_codes [C] (a catalog's code tokens, then -1) -> [V]: each token's column among them
    (C for a token that is none: no column; every trie token of the catalog has one)."""
    cols = torch.arange(codes.shape[0], device=codes.device)
    table = torch.full((vocab + 1,), codes.shape[0], dtype=torch.int64, device=codes.device)
    return table.scatter_(0, torch.where(codes.ge(0), codes, vocab), cols)[:vocab]


def to_code_tokens(codes: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """The tokens of a batch's chosen columns: themselves, or through codes (beam_codes; a padding
    column, only ever a dead beam's, becomes token 0)."""
    if codes is None:
        return columns
    return codes.index_select(0, columns.reshape(-1)).clamp_min(0).view_as(columns)


def optional_input(node: Node, env: Env, name: str) -> torch.Tensor | None:
    """An input the node may declare and a batch may leave out (beam_codes): the buffer, else None
    (C++ Node::optional_input)."""
    return env[name] if name in node.inputs and name in env else None


def trie_children(w: dict[str, torch.Tensor], trie: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """trie [X] nodes (-1: none) -> tokens, children, valid [X, K] (kernels/trie.py trie_children_ref
    over the forest's tensors)."""
    return trie_children_ref(w["catalog.offsets"], w["catalog.window"], w["catalog.tokens"], w["catalog.child"], trie)


def advance_trie(ctx: NodeContext, trie: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """trie, tokens [R, B] -> the child of each node along its token; -1 where it has none (an
    unconstrained beam, or a dead one whose -inf candidate took a token no item continues with).
    Fused: kernels/trie.py's one kernel; else its reference's ATen ops."""
    w = ctx.weights
    if ctx.fused is not None:
        return ctx.fused.trie_advance(trie.contiguous(), tokens.contiguous(), w["catalog.offsets"], w["catalog.tokens"],
                                      w["catalog.child"])
    return trie_advance_ref(trie, tokens, w["catalog.offsets"], w["catalog.window"], w["catalog.tokens"],
                            w["catalog.child"])


def _mask_logp(logp: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    # after the log-softmax over the whole vocabulary, as Hugging Face's prefix_allowed_tokens_fn
    return logp if allowed is None else logp.masked_fill(allowed.logical_not(), float("-inf"))


def beam_init(ctx: NodeContext, node: Node, env: Env) -> None:
    """First generated token: top-B of the prompt's next-token distribution (every beam equal);
    with a catalog, of the tokens that begin an item (beam_allowed)."""
    # [R, V] (float32; model dtype when fused), [R], [R, B, n], [N]
    logits, widths, seqs, slot = (env[n] for n in node.inputs[:4])
    num_beams = seqs.shape[1]
    allowed = env["allowed"] if "allowed" in node.inputs else None
    codes = optional_input(node, env, "beam_codes")
    if ctx.fused is not None:  # kernels/beam_topk.py: a parent row a request, score 0; the bookkeeping: one kernel
        r, vocab = logits.shape
        ranks = torch.arange(r, device=logits.device)
        keys = ctx.fused.beam_candidates(logits, torch.zeros(r, dtype=torch.float32, device=logits.device), num_beams,
                                         1, allowed, ranks, ranks)
        # keys [R, B]: one parent a request, so each request's B best already
        seqs, scores, parents, tokens, row_tokens, _, _ = ctx.fused.beam_commit(keys, seqs, widths, slot, vocab, 0,
                                                                                None, codes)
    else:
        logp = _mask_logp(torch.log_softmax(logits, dim=-1), allowed)
        scores, tokens = logp.topk(num_beams, dim=-1)  # [R, B], sorted best first
        tokens = to_code_tokens(codes, tokens)
        seqs = seqs.clone()  # the batch's input buffer stays as the caller made it
        seqs[:, :, 0] = tokens
        scores, parents = _mask_extra_beams(scores, widths), torch.zeros_like(tokens)
        row_tokens = to_rows(tokens, slot, 0)
    if allowed is not None:
        env["beam_trie"] = advance_trie(ctx, env["beam_trie"].expand_as(tokens), tokens)
    env["beam_seqs"] = seqs
    env["beam_scores"] = scores
    env["beam_tokens"] = row_tokens  # [N]: the next step's input, per packed row
    env["beam_parents"] = parents


def beam_step(ctx: NodeContext, node: Node, env: Env) -> None:
    """log-softmax + add beam score + top-B over B x V + parent gather + suffix K/V reorder. The
    candidates come from the N packed rows and are merged per request in the [R, B] bookkeeping
    (beam_src: each rank's row; the ranks a request does not have hold no candidate); the new beams
    go back to packed rows (beam_slot), each taking its parent's suffix K/V: on the ATen path a copy
    of it, with the fused kernels its suffix_rows (the K/V stays where it was written)."""
    # [N, V], [R, B], [R, B, n], [R], [N], [R*B]
    logits, scores, seqs, widths, slot, src = (env[n] for n in node.inputs[:6])
    r, b = scores.shape
    vocab = logits.shape[-1]
    allowed = env["allowed"] if "allowed" in node.inputs else None
    codes = optional_input(node, env, "beam_codes")
    if ctx.fused is not None:
        # each row's top-B + log-sum-exp in one pass (kernels/beam_topk.py), straight into its rank's place
        # [R*B, B]; top-B of each request's B x B; then the bookkeeping in one kernel
        keys = ctx.fused.beam_candidates(logits, scores.reshape(-1), b, b, allowed, slot, src)
        later = node.step < seqs.shape[2] - 1  # a later decode step reads the suffix
        new_seqs, new_scores, parents, tokens, row_tokens, rows, suffix_rows = ctx.fused.beam_commit(
            ctx.fused.beam_merge(keys, r, b), seqs, widths, slot, vocab, node.step, src, codes,
            env["suffix_rows"] if later else None)
    else:
        row_scores = to_rows(scores, slot, float("-inf"))  # [N]: each row's beam score (padding: dead, never read)
        cand = _mask_logp(torch.log_softmax(logits, dim=-1), allowed) + row_scores.unsqueeze(1)  # [N, V]
        cand = torch.constant_pad_nd(cand, [0, 0, 0, 1], float("-inf")).index_select(0, src)  # [R*B, V]
        top_scores, top_idx = cand.reshape(r, b * vocab).topk(b, dim=-1)  # [R, B]
        parents = torch.div(top_idx, vocab, rounding_mode="floor")
        tokens = to_code_tokens(codes, top_idx - parents * vocab)
        ranks = (parents + torch.arange(r, device=parents.device).unsqueeze(1) * b).reshape(-1)  # [R*B]: parent ranks
        rows = to_rows(src.index_select(0, ranks), slot, 0)  # [N]: each packed row's parent row
        new_seqs = seqs.gather(1, parents.unsqueeze(-1).expand_as(seqs)).clone()
        new_seqs[:, :, node.step] = tokens
        new_scores, row_tokens = _mask_extra_beams(top_scores, widths), to_rows(tokens, slot, 0)
    env["beam_seqs"] = new_seqs
    env["beam_scores"] = new_scores
    env["beam_tokens"] = row_tokens
    env["beam_parents"] = parents
    if allowed is not None:
        env["beam_trie"] = advance_trie(ctx, env["beam_trie"].gather(1, parents), tokens)
    if ctx.fused is None:
        for name in node.inputs[8:]:  # suffix_k.{i} / suffix_v.{i} (inputs[6:8]: the fused path's suffix_kv, suffix_rows)
            if name.startswith("suffix_"):  # (then allowed, beam_trie with a catalog)
                env[name] = env[name].index_select(0, rows)
    elif suffix_rows is not None:
        env["suffix_rows"] = suffix_rows


def beam_hold(ctx: NodeContext, node: Node, env: Env) -> None:
    """The answers of the requests that end at this step: a batch runs its bucket's n steps, and a
    request of fewer new tokens (beam_steps [R]) is answered with its beams as they stand after its
    own last step, here copied into held_scores [R, B] / held_seqs [R, B, n] (the batch's outputs;
    the later steps go on over its rows and change nothing there). After beam_init held starts as a
    copy of the beams."""
    steps, scores, seqs = (env[n] for n in node.inputs[:3])
    if "held_scores" not in node.inputs:
        env["held_scores"], env["held_seqs"] = scores.clone(), seqs.clone()
        return
    ends = steps.eq(node.step + 1)  # [R]
    env["held_scores"] = torch.where(ends.unsqueeze(1), scores, env["held_scores"])
    env["held_seqs"] = torch.where(ends.view(-1, 1, 1), seqs, env["held_seqs"])


def set_beam_suffix(env: Env, suffix_kv: torch.Tensor) -> None:
    env["suffix_kv"] = suffix_kv
    for i in range(suffix_kv.shape[0]):
        env[f"suffix_k.{i}"], env[f"suffix_v.{i}"] = suffix_kv[i, 0], suffix_kv[i, 1]


NODE_FUNCS: dict[str, Callable[[NodeContext, Node, Env], None]] = {
    "score_masks": score_masks,
    "beam_masks": beam_masks,
    "beam_state": beam_state,
    "embedding": embedding,
    "decoder_layer": decoder_layer,
    "rms_norm": rms_norm_node,
    "gather_rows": gather_rows,
    "lm_head": lm_head,
    "cls_head": cls_head,
    "label_logprobs": label_logprobs,
    "beam_init": beam_init,
    "beam_step": beam_step,
    "beam_allowed": beam_allowed,
    "beam_hold": beam_hold,
}
