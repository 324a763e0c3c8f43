"""The request DAGs as data: nodes with named inputs/outputs, stored in the artifact manifest.

Both runtimes walk the same node list, and the declarations are the whole data flow: a node reads
only buffers it declares as inputs (or outputs it updates) and writes only its declared outputs;
both runtimes refuse anything else (the Python runtime at each access, the C++ runtime when it
loads the DAG). A declared output may be left unwritten where a device does not need it (the masks
of the dense attention on a GPU in 16 bits). A batch's input buffers are:
  Score: tokens, positions, seg, ctx [T] (the requests back to back, then padding);
         request_rows [R+1] (each request's first row, then T); prefix_rows [R]; last [S]; labels [S, L]
  Beam:  tokens, positions, seg [P] (the prompts back to back, then padding); last, beam_width [R];
         per packed beam row (each request's own width of rows back to back, then padding) beam_req,
         beam_pos (the request's prompt length: the position of the first generated token) and
         beam_slot (its rank r * B + p in the [R, B] bookkeeping) [N]; beam_src [R*B] (each rank's
         packed row); beam_seqs [R, B, n] zeros (the generated tokens, filled step by step);
         beam_catalog [R] (each request's catalog index, -1: unconstrained); beam_steps [R] (each
         request's new tokens: a batch runs its bucket's n steps, and after each step the beam_hold
         node keeps the beams of the requests that end there in held_scores / held_seqs, the answers)
Decode-step nodes carry attrs["step"] = t (1..max_new_tokens-1); a batch generating n tokens
runs the nodes with step < n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model.config import ModelConfig

NODE_TYPES = ("score_masks", "beam_masks", "beam_state", "embedding", "decoder_layer", "rms_norm", "gather_rows",
              "lm_head", "cls_head", "label_logprobs", "beam_init", "beam_step", "beam_allowed", "beam_hold")
SCORE_INPUTS = ("tokens", "positions", "seg", "ctx", "request_rows", "prefix_rows", "last", "labels")
BEAM_INPUTS = ("tokens", "positions", "seg", "last", "beam_width", "beam_req", "beam_pos", "beam_slot", "beam_src",
               "beam_seqs", "beam_catalog", "beam_steps", "beam_codes")  # beam_codes: a batch normalised over a
# catalog's codes only
BEAM_OUTPUTS = ("held_seqs", "held_scores")


class DagError(ValueError):
    """A DAG whose declarations do not hold together."""


def check_dataflow(nodes: list["Node"], batch_inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    """Every input a node declares is a batch input or an output of an earlier node, and the DAG
    produces the batch's outputs."""
    available = set(batch_inputs)
    for node in nodes:
        missing = [name for name in node.inputs if name not in available]
        if missing:
            raise DagError(f"node {node.name} ({node.type}) reads {missing}, which neither the batch nor an "
                           "earlier node provides")
        available.update(node.outputs)
    if nodes and (absent := [name for name in outputs if name not in available]):
        raise DagError(f"the DAG never writes {absent}")


@dataclass(frozen=True)
class Node:
    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.type not in NODE_TYPES:
            raise ValueError(f"node {self.name}: unknown type {self.type!r}")

    @property
    def step(self) -> int:
        return int(self.attrs.get("step", 0))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "inputs": list(self.inputs),
                "outputs": list(self.outputs), "attrs": dict(self.attrs)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Node":
        return cls(d["name"], d["type"], tuple(d["inputs"]), tuple(d["outputs"]), dict(d["attrs"]))


def _precision(parts: tuple[str, ...]) -> str:
    """A node's precision attr (informational; the runtimes go by the weights' dtypes): "model", or
    "fp8:" and its e4m3 linear layers (`slmrank build --fp8`)."""
    return "fp8:" + ",".join(parts) if parts else "model"


def _layers(cfg: ModelConfig, prefix: str, mode: str, step: int = 0, max_rows: int = 0,
            fp8: tuple[str, ...] = ()) -> list[Node]:
    nodes = []
    precision = _precision(tuple(part for part in fp8 if part in ("attn", "mlp")))
    for i in range(cfg.num_layers):
        attrs: dict[str, Any] = {"layer": i, "mode": mode, "precision": precision}
        if step:
            attrs["step"] = step
        if max_rows:
            attrs["max_rows"] = max_rows
        if mode == "score":  # prefix part (shared K/V) + own-sample causal part, merged by LSE (or key_ranges: one kernel)
            ins = ("x", "positions", "mask_ctx", "mask_self", "cu_self", "cu_blocks", "prefix_len", "has_ctx",
                   "key_ranges")
            outs = ("x",)
        elif mode == "prefill":  # keeps the prompt K/V that every beam shares
            ins = ("x", "positions", "mask_self", "cu_self", "key_ranges")
            outs = ("x", f"prompt_k.{i}", f"prompt_v.{i}")
        else:  # decode: one token per beam; prompt part + per-beam suffix part, merged by LSE
            ins = ("x", "beam_pos", "mask_beam", "kv_start", "kv_len", f"prompt_k.{i}", f"prompt_v.{i}",
                   f"suffix_k.{i}", f"suffix_v.{i}", "suffix_rows")
            outs = ("x", f"suffix_k.{i}", f"suffix_v.{i}")
        # mlp_out: a layer's MLP output is added to x by the next layer's first norm (or the final
        # norm), in one kernel with it; the first layer of a forward has nothing pending
        ins = ins[:1] + ("mlp_out",) + ins[1:] if i > 0 else ins
        outs = outs[:1] + ("mlp_out",) + outs[1:]
        nodes.append(Node(f"{prefix}layer.{i}", "decoder_layer", ins, outs, attrs))
    return nodes


def _head(cfg: ModelConfig, prefix: str, rows: str, step: int = 0, fp8: tuple[str, ...] = (),
          codes: bool = False) -> list[Node]:
    """codes: the LM head also takes beam_codes (a batch normalised over a catalog's code tokens:
    the head's rows for those tokens only)."""
    attrs = {"step": step} if step else {}
    precision = _precision(("head",) if "head" in fp8 else ())
    nodes = [Node(f"{prefix}final_norm", "rms_norm", ("x", "mlp_out"), ("x",), {**attrs, "weight": "final_norm"})]
    if rows:
        nodes.append(Node(f"{prefix}gather_last", "gather_rows", ("x", rows), ("h",), dict(attrs)))
    src = "h" if rows else "x"
    if cfg.has_cls_head:
        nodes.append(Node(f"{prefix}cls_head", "cls_head", (src,), ("logits",), {**attrs, "precision": precision}))
    else:
        nodes.append(Node(f"{prefix}lm_head", "lm_head", (src,) + (("beam_codes",) if codes else ()), ("logits",),
                          {**attrs, "precision": precision}))
    return nodes


def score_dag(cfg: ModelConfig, max_rows: int, fp8: tuple[str, ...] = ()) -> list[Node]:
    """max_rows: the most tokens of one Score request (limits.max_score_tokens), which bounds a
    segment: the varlen attention's static longest run. fp8: the e4m3 parts (the nodes' precision)."""
    # on the CPU (and float32 on CUDA) the masks of the dense reference; on CUDA in 16 bits the varlen segment bounds;
    # with the fused kernels each row's key ranges (kernels/segment_attention.py)
    nodes = [Node("masks", "score_masks", ("positions", "seg", "ctx", "request_rows", "prefix_rows", "last"),
                  ("mask_self", "mask_ctx", "cu_self", "cu_blocks", "prefix_len", "has_ctx", "key_ranges"),
                  {"max_rows": max_rows}),
             Node("embed", "embedding", ("tokens",), ("x",))]
    nodes += _layers(cfg, "", "score", max_rows=max_rows, fp8=fp8)
    nodes += _head(cfg, "", "last", fp8=fp8)
    if not cfg.has_cls_head:
        nodes.append(Node("label_logprobs", "label_logprobs", ("logits", "labels"), ("scores",)))
    else:
        nodes[-1] = Node(nodes[-1].name, nodes[-1].type, nodes[-1].inputs, ("scores",), nodes[-1].attrs)
    return nodes


def beam_dag(cfg: ModelConfig, max_new_tokens: int, constrained: bool = False, fp8: tuple[str, ...] = ()) -> list[Node]:
    """constrained (the artifact has catalogs): a beam_allowed node before each selection computes
    each row's allowed tokens from the trie (beam_trie [R, B]: each beam's trie node), and the
    selection masks with it and advances beam_trie."""
    if cfg.has_cls_head:
        return []
    trie = ("allowed", "beam_trie") if constrained else ()
    codes = ("beam_codes",) if constrained else ()  # present in a batch normalised over a catalog's codes
    # per-beam suffix K/V, one slot per decode step: one buffer (suffix_kv) on the fused path, with
    # every layer's suffix_k/v.i a view of it, and each row's slots' rows (suffix_rows: the K/V is
    # never copied there); separate buffers on the ATen path, copied after the parents
    suffix = ("suffix_kv", "suffix_rows") + tuple(f"suffix_{kv}.{i}" for i in range(cfg.num_layers) for kv in "kv")
    nodes = [Node("masks", "beam_masks", ("positions", "seg", "beam_req", "beam_pos", "last"),
                  ("mask_self", "cu_self", "key_ranges", "mask_beam", "kv_start", "kv_len")),
             Node("beam_state", "beam_state", ("beam_seqs", "beam_slot"), suffix),
             Node("embed", "embedding", ("tokens",), ("x",))]
    nodes += _layers(cfg, "", "prefill", fp8=fp8)
    nodes += _head(cfg, "", "last", fp8=fp8, codes=constrained)
    if constrained:
        nodes.append(Node("beam_allowed", "beam_allowed", ("beam_catalog",) + codes, trie))
    nodes.append(Node("beam_init", "beam_init", ("logits", "beam_width", "beam_seqs", "beam_slot") + trie + codes,
                      ("beam_tokens", "beam_scores", "beam_seqs", "beam_parents") + trie[1:]))
    live = ("beam_steps", "beam_scores", "beam_seqs")
    nodes.append(Node("beam_hold", "beam_hold", live, ("held_scores", "held_seqs")))
    for t in range(1, max_new_tokens):
        p = f"step{t}."
        nodes.append(Node(f"{p}embed", "embedding", ("beam_tokens",), ("x",), {"step": t}))
        nodes += _layers(cfg, p, "decode", t, fp8=fp8)
        nodes += _head(cfg, p, "", t, fp8=fp8, codes=constrained)
        if constrained:
            nodes.append(Node(f"{p}beam_allowed", "beam_allowed", ("beam_trie", "beam_slot") + codes, ("allowed",),
                              {"step": t}))
        nodes.append(Node(f"{p}beam_step", "beam_step",
                          ("logits", "beam_scores", "beam_seqs", "beam_width", "beam_slot", "beam_src") + suffix + trie
                          + codes,
                          ("beam_tokens", "beam_scores", "beam_seqs", "beam_parents") + suffix + trie[1:],
                          {"step": t}))
        nodes.append(Node(f"{p}beam_hold", "beam_hold", live + ("held_scores", "held_seqs"),
                          ("held_scores", "held_seqs"), {"step": t}))
    return nodes


def dag_to_list(nodes: list[Node]) -> list[dict[str, Any]]:
    return [n.to_dict() for n in nodes]


def dag_from_list(items: list[dict[str, Any]]) -> list[Node]:
    return [Node.from_dict(d) for d in items]
