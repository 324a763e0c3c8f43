// beam_state, beam_init and beam_step: the beam bookkeeping.
//   beam_state: the zeroed per-beam suffix K/V, one row per packed beam row (beam_slot [N])
//   beam_init: top-B of the prompt's next-token log-probs (every beam starts equal)
//   beam_step: log-softmax + add beam score + top-B over B x V + parent gather + suffix K/V reorder
// The forward runs over N packed beam rows (each request's own width of rows); the bookkeeping is
// [R, B] (beam_slot: each row's rank r * B + p, R * B for padding; beam_src: each rank's row, N for
// a rank its request does not have). A request narrower than B keeps its extra ranks dead (-inf).
// With the Triton kernels (ctx.fused) the selection is kernels/beam_topk.py: each packed row's top-B
// keys in one pass over the model-dtype logits, written straight into its rank's place (slot / src),
// then top-B of each request's B x B keys (torch), then one kernel for the bookkeeping (scores,
// parents, tokens, sequences, each packed row's next token and parent row, and each row's
// suffix_rows: the rows that hold its beam's suffix slots). Every layer's suffix K/V (views of one
// suffix_kv buffer) stays where each step wrote it: the decode attention reads a row's slot j from
// row suffix_rows[row, j] (kernels/decode_attention.py); on the ATen path it is copied after the parents. With catalogs, beam_allowed computes each row's allowed tokens from the trie forest
// (catalog_forest.h) and beam_init / beam_step mask with them and advance beam_trie [R, B] (with the
// Triton kernels: kernels/trie.py's two lookups, a kernel each).
// Mirrors service/runtime/nodes.py::beam_allowed / beam_init / beam_step, op for op.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ops/arange.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>
#include <string>
#include <tuple>

#include "node_types.h"
#include "triton_kernels.h"

namespace slmrank {
namespace {

// A node that owns the per-beam suffix K/V (beam_state, beam_step): suffix_k.{i} / suffix_v.{i}
// [rows, slots, G, E] per layer; with the fused kernels views of one buffer suffix_kv [layers, 2,
// rows, slots, G, E], never reordered (suffix_rows [rows, slots] says where a row's slots are).
// service/runtime/nodes.py::beam_state / set_beam_suffix.
class SuffixOwner : public Node {
 public:
  explicit SuffixOwner(const NodeSpec& spec) : Node(spec) {}

 protected:
  void set_suffix(Env& env, const at::Tensor& suffix_kv) const {
    write(env, "suffix_kv", suffix_kv);
    for (int64_t i = 0; i < suffix_kv.size(0); ++i) {
      write(env, "suffix_k." + std::to_string(i), suffix_kv.select(0, i).select(0, 0));
      write(env, "suffix_v." + std::to_string(i), suffix_kv.select(0, i).select(0, 1));
    }
  }
};

// beam_state: the zeroed suffix K/V of a beam batch: a row per packed beam row (beam_slot [N]),
// max(n-1, 1) slots (one per decode step; beam_seqs [R, B, n]).
class BeamState final : public SuffixOwner {
 public:
  explicit BeamState(const NodeSpec& spec) : SuffixOwner(spec) { require(2, 0, {}, {"suffix_kv", "suffix_rows"}); }
  void run(const Context& ctx, Env& env) const override {
    const ModelConfig& cfg = ctx.cfg;
    const at::Tensor &seqs = in(env, 0), &slot = in(env, 1);
    const std::vector<int64_t> shape = {slot.size(0), std::max<int64_t>(seqs.size(2) - 1, 1), cfg.num_kv_heads,
                                        cfg.head_dim};
    auto options = seqs.options().dtype(ctx.rope_cos.scalar_type());
    if (!ctx.fused) {
      for (int64_t i = 0; i < cfg.num_layers; ++i) {
        for (const char* kv : {"suffix_k.", "suffix_v."}) write(env, kv + std::to_string(i), at::zeros(shape, options));
      }
      return;
    }
    set_suffix(env, at::zeros({cfg.num_layers, 2, shape[0], shape[1], shape[2], shape[3]}, options));
    // every row's slots its own (kernels/decode_attention.py own_suffix_rows)
    write(env, "suffix_rows",
          at::arange(shape[0], seqs.options().dtype(at::kLong)).unsqueeze(1).expand({shape[0], shape[1]}).contiguous());
  }
};

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

at::Tensor mask_extra_beams(const at::Tensor& scores, const at::Tensor& widths) {
  at::Tensor rank = at::arange(scores.size(1), scores.options().dtype(at::kLong)).unsqueeze(0);
  return scores.masked_fill(rank.ge(widths.unsqueeze(1)), kNegInf);
}

// nodes.py::to_rows: [R, B] bookkeeping -> [N] packed rows (slot R*B, a padding row, takes pad).
at::Tensor to_rows(const at::Tensor& rect, const at::Tensor& slot, const at::Scalar& pad) {
  return at::constant_pad_nd(rect.reshape({-1}), {0, 1}, pad).index_select(0, slot);
}

// nodes.py::code_columns_of: beam_codes [C] (a catalog's code tokens, then -1) -> [V]: each token's
// column among them (C for a token that is none).
at::Tensor code_columns_of(const at::Tensor& codes, int64_t vocab) {
  const int64_t c = codes.size(0);
  at::Tensor cols = at::arange(c, codes.options());
  at::Tensor table = at::full({vocab + 1}, c, codes.options());
  return table.scatter_(0, at::where(codes.ge(0), codes, vocab), cols).slice(0, 0, vocab);
}

// nodes.py::to_code_tokens: the tokens of a batch's chosen columns, through codes (beam_codes, when the
// batch is normalised over a catalog's codes; undefined: the columns are the tokens). A padding column,
// only ever a dead beam's, becomes token 0.
at::Tensor to_code_tokens(const at::Tensor& codes, const at::Tensor& columns) {
  if (!codes.defined()) return columns;
  return codes.index_select(0, columns.reshape({-1})).clamp_min(0).view_as(columns);
}

// nodes.py::trie_children: trie [X] nodes (-1: none) -> tokens, children, valid [X, K].
std::tuple<at::Tensor, at::Tensor, at::Tensor> trie_children(const Context& ctx, const at::Tensor& trie) {
  const at::Tensor &offsets = ctx.weight("catalog.offsets"), &window = ctx.weight("catalog.window");
  const int64_t edges = ctx.weight("catalog.tokens").size(0), k = window.size(0);
  at::Tensor node = trie.clamp_min(0);
  at::Tensor start = offsets.index_select(0, node);
  at::Tensor count = offsets.index_select(0, node.add(1)).sub(start);
  at::Tensor edge = start.unsqueeze(1).add(window).clamp_max(edges - 1).reshape({-1});
  at::Tensor tokens = ctx.weight("catalog.tokens").index_select(0, edge).view({-1, k});
  at::Tensor children = ctx.weight("catalog.child").index_select(0, edge).view({-1, k});
  at::Tensor valid = window.lt(count.unsqueeze(1)).logical_and(trie.ge(0).unsqueeze(1));
  return {tokens, children, valid};
}

// nodes.py::advance_trie: the child of each node along its token, -1 where it has none (fused: one kernel).
at::Tensor advance_trie(const Context& ctx, const at::Tensor& trie, const at::Tensor& tokens) {
  if (ctx.fused) {
    return ctx.fused->trie_advance(trie.contiguous(), tokens.contiguous(), ctx.weight("catalog.offsets"),
                                   ctx.weight("catalog.tokens"), ctx.weight("catalog.child"));
  }
  auto [kids_tokens, kids, valid] = trie_children(ctx, trie.reshape({-1}));
  at::Tensor hit = valid.logical_and(kids_tokens.eq(tokens.reshape({-1, 1})));
  at::Tensor child = at::where(hit, kids, 0).sum(1);
  return at::where(hit.any(1), child, -1).view_as(tokens);
}

// nodes.py::_mask_logp: after the log-softmax over the whole vocabulary (Hugging Face's order).
at::Tensor mask_logp(const at::Tensor& logp, const at::Tensor& allowed) {
  return allowed.defined() ? logp.masked_fill(allowed.logical_not(), kNegInf) : logp;
}

// beam_allowed: each row's allowed next tokens (nodes.py::beam_allowed): step 0 a row per request at
// its catalog's root (writes beam_trie [R, 1]); step t the N packed rows at their beams' nodes.
class BeamAllowed final : public Node {
 public:
  explicit BeamAllowed(const NodeSpec& spec) : Node(spec) { require(1, 1, {}, {"allowed"}); }
  void run(const Context& ctx, Env& env) const override {
    at::Tensor trie;
    if (spec_.step == 0) {
      const at::Tensor &cat = read(env, "beam_catalog"), &roots = ctx.weight("catalog.roots");
      trie = roots.index_select(0, at::where(cat.ge(0), cat, roots.size(0) - 1));
      write(env, "beam_trie", trie.unsqueeze(1));
    } else {
      trie = to_rows(read(env, "beam_trie"), read(env, "beam_slot"), -1);
    }
    int64_t vocab = ctx.cfg.vocab_size;
    at::Tensor cols;
    if (const at::Tensor codes = optional_input(env, "beam_codes"); codes.defined()) {
      // normalised over a catalog's codes: the columns are its code tokens
      cols = code_columns_of(codes, vocab);
      vocab = codes.size(0);
    }
    if (ctx.fused) {  // kernels/trie.py: beam_candidates' int32 bitmask in one kernel
      write(env, "allowed", ctx.fused->trie_allowed(trie.contiguous(), ctx.weight("catalog.offsets"),
                                                    ctx.weight("catalog.tokens"), cols, (vocab + 31) / 32));
      return;
    }
    auto [tokens, children, valid] = trie_children(ctx, trie);
    if (cols.defined()) tokens = cols.index_select(0, tokens.reshape({-1})).view_as(tokens);
    at::Tensor allowed = at::zeros({trie.size(0), vocab + 1}, trie.options().dtype(at::kBool))
                             .scatter_(1, at::where(valid, tokens, vocab), true);
    write(env, "allowed", allowed.slice(1, 0, vocab).logical_or(trie.lt(0).unsqueeze(1)));
  }
};

class BeamInit final : public Node {
 public:
  explicit BeamInit(const NodeSpec& spec) : Node(spec) {
    require(4, 0, {"beam_seqs"}, {"beam_seqs", "beam_scores", "beam_tokens", "beam_parents"});
  }
  void run(const Context& ctx, Env& env) const override {
    // [R, V] (model dtype when fused), [R], [N]
    const at::Tensor &logits = in(env, 0), &widths = in(env, 1), &slot = in(env, 3);
    at::Tensor seqs = in(env, 2);  // [R, B, n]; the batch's input buffer stays as the caller made it
    const int64_t b = seqs.size(1);
    const at::Tensor allowed = declares_input("allowed") ? read(env, "allowed") : at::Tensor();
    const at::Tensor codes = optional_input(env, "beam_codes");
    at::Tensor scores, parents, tokens, row_tokens;
    if (ctx.fused) {  // kernels/beam_topk.py: a parent row a request, beam score 0; the bookkeeping in one kernel
      const int64_t r = logits.size(0);
      const at::Tensor ranks = at::arange(r, logits.options().dtype(at::kLong));
      const at::Tensor keys = ctx.fused->beam_candidates(logits, at::zeros({r}, logits.options().dtype(at::kFloat)),
                                                         b, 1, allowed, ranks, ranks);
      // keys [R, B]: one parent a request, so each request's B best already
      std::tie(seqs, scores, parents, tokens, row_tokens, std::ignore, std::ignore) =
          ctx.fused->beam_commit(keys, seqs, widths, slot, logits.size(1), 0, at::Tensor(), codes, at::Tensor());
    } else {
      std::tie(scores, tokens) = mask_logp(logits.log_softmax(-1), allowed).topk(b, -1);
      tokens = to_code_tokens(codes, tokens);
      seqs = seqs.clone();
      seqs.select(2, 0).copy_(tokens);
      scores = mask_extra_beams(scores, widths);
      row_tokens = to_rows(tokens, slot, 0);
      parents = at::zeros_like(tokens);
    }
    if (allowed.defined()) write(env, "beam_trie", advance_trie(ctx, read(env, "beam_trie").expand_as(tokens), tokens));
    write(env, "beam_seqs", seqs);
    write(env, "beam_scores", scores);
    write(env, "beam_tokens", row_tokens);  // [N]: the next step's input, per packed row
    write(env, "beam_parents", parents);
  }
};

class BeamStep final : public Node {
 public:
  explicit BeamStep(const NodeSpec& spec) : Node(spec) {
    require(8, 0, {"suffix_kv", "suffix_rows"},
            {"beam_seqs", "beam_scores", "beam_tokens", "beam_parents", "suffix_kv", "suffix_rows"});
    if (spec.inputs[6] != "suffix_kv" || spec.inputs[7] != "suffix_rows") {  // inputs[8:]: the ATen path's per layer
      throw std::invalid_argument("node " + spec.name + " (beam_step): inputs 6 and 7 must be suffix_kv and "
                                  "suffix_rows, not '" + spec.inputs[6] + "', '" + spec.inputs[7] + "'");
    }
  }
  void run(const Context& ctx, Env& env) const override {
    // [N, V], [R, B], [R, B, n], [R], [N], [R*B]
    const at::Tensor &logits = in(env, 0), &scores = in(env, 1), &seqs = in(env, 2), &widths = in(env, 3),
                     &slot = in(env, 4), &src = in(env, 5);
    const int64_t r = scores.size(0), b = scores.size(1), vocab = logits.size(-1);
    const at::Tensor allowed = declares_input("allowed") ? read(env, "allowed") : at::Tensor();
    const at::Tensor codes = optional_input(env, "beam_codes");
    at::Tensor new_seqs, new_scores, parents, tokens, row_tokens, rows, suffix_rows;
    if (ctx.fused) {
      // each row's top-B + log-sum-exp in one pass (kernels/beam_topk.py), straight into its rank's place
      // [R*B, B]; top-B of each request's B x B; then the bookkeeping in one kernel (with each row's
      // suffix_rows when a later decode step reads the suffix)
      const bool later = spec_.step < seqs.size(2) - 1;
      const at::Tensor keys = ctx.fused->beam_candidates(logits, scores.reshape({-1}), b, b, allowed, slot, src);
      std::tie(new_seqs, new_scores, parents, tokens, row_tokens, rows, suffix_rows) =
          ctx.fused->beam_commit(ctx.fused->beam_merge(keys, r, b), seqs, widths, slot, vocab, spec_.step, src, codes,
                                 later ? read(env, "suffix_rows") : at::Tensor());
    } else {
      at::Tensor row_scores = to_rows(scores, slot, kNegInf);  // [N]: each row's beam score (padding: dead)
      at::Tensor cand = mask_logp(logits.log_softmax(-1), allowed).add(row_scores.unsqueeze(1));  // [N, V]
      cand = at::constant_pad_nd(cand, {0, 0, 0, 1}, kNegInf).index_select(0, src);  // [R*B, V]
      auto [top_scores, top_idx] = cand.reshape({r, b * vocab}).topk(b, -1);
      parents = top_idx.div(vocab, "floor");
      tokens = to_code_tokens(codes, top_idx.sub(parents.mul(vocab)));
      at::Tensor ranks = parents.add(at::arange(r, parents.options()).unsqueeze(1).mul(b)).reshape({-1});
      rows = to_rows(src.index_select(0, ranks), slot, 0);  // [N]: each packed row's parent row
      new_seqs = seqs.gather(1, parents.unsqueeze(-1).expand_as(seqs)).clone();
      new_seqs.select(2, spec_.step).copy_(tokens);
      new_scores = mask_extra_beams(top_scores, widths);
      row_tokens = to_rows(tokens, slot, 0);
    }
    write(env, "beam_seqs", new_seqs);
    write(env, "beam_scores", new_scores);
    write(env, "beam_tokens", row_tokens);
    write(env, "beam_parents", parents);
    if (allowed.defined()) write(env, "beam_trie", advance_trie(ctx, read(env, "beam_trie").gather(1, parents), tokens));
    if (!ctx.fused) {
      for (size_t i = 8; i < spec_.inputs.size(); ++i) {  // suffix_k.{i} / suffix_v.{i} (inputs[6:8]: the fused path's)
        const std::string& name = spec_.inputs[i];
        if (name.rfind("suffix_", 0) != 0) continue;  // then allowed, beam_trie with a catalog
        write(env, name, read(env, name).index_select(0, rows));
      }
    } else if (suffix_rows.defined()) {
      write(env, "suffix_rows", suffix_rows);
    }
  }
};

// The answers of the requests that end at this step (service/runtime/nodes.py beam_hold): a batch
// runs its bucket's n steps, and a request of fewer new tokens (beam_steps [R]) is answered with its
// beams as they stand after its own last step, copied here into held_scores [R, B] / held_seqs
// [R, B, n], the batch's outputs. After beam_init held starts as a copy of the beams.
class BeamHold final : public Node {
 public:
  explicit BeamHold(const NodeSpec& spec) : Node(spec) {
    require(3, 2, {"beam_steps", "beam_scores", "beam_seqs"}, {"held_scores", "held_seqs"});
  }
  void run(const Context&, Env& env) const override {
    const at::Tensor &steps = in(env, 0), &scores = in(env, 1), &seqs = in(env, 2);
    if (!declares_input("held_scores")) {
      write(env, "held_scores", scores.clone());
      write(env, "held_seqs", seqs.clone());
      return;
    }
    const at::Tensor ends = steps.eq(spec_.step + 1);  // [R]
    write(env, "held_scores", at::where(ends.unsqueeze(1), scores, read(env, "held_scores")));
    write(env, "held_seqs", at::where(ends.view({-1, 1, 1}), seqs, read(env, "held_seqs")));
  }
};

}  // namespace

std::unique_ptr<Node> make_beam_hold(const NodeSpec& spec) { return std::make_unique<BeamHold>(spec); }
std::unique_ptr<Node> make_beam_state(const NodeSpec& spec) { return std::make_unique<BeamState>(spec); }
std::unique_ptr<Node> make_beam_init(const NodeSpec& spec) { return std::make_unique<BeamInit>(spec); }
std::unique_ptr<Node> make_beam_step(const NodeSpec& spec) { return std::make_unique<BeamStep>(spec); }
std::unique_ptr<Node> make_beam_allowed(const NodeSpec& spec) { return std::make_unique<BeamAllowed>(spec); }

}  // namespace slmrank
