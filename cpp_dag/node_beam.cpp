// beam_init and beam_step: the fused beam bookkeeping.
//   beam_init: top-B of the prompt's next-token log-probs (every beam starts equal)
//   beam_step: log-softmax + add beam score + top-B over B x V + parent gather + suffix K/V reorder
// A request narrower than the bucket's beam keeps its extra ranks dead (-inf).
// Mirrors service/nodes.py::beam_init / beam_step.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ops/arange.h>
#include <ATen/ops/zeros_like.h>

#include <limits>

#include "node_types.h"

namespace slmrank {
namespace {

at::Tensor mask_extra_beams(const at::Tensor& scores, const at::Tensor& widths) {
  at::Tensor rank = at::arange(scores.size(1), scores.options().dtype(at::kLong)).unsqueeze(0);
  return scores.masked_fill(rank.ge(widths.unsqueeze(1)), -std::numeric_limits<double>::infinity());
}

class BeamInit final : public Node {
 public:
  using Node::Node;
  void run(const Context&, Env& env) const override {
    const at::Tensor &logits = in(env, 0), &widths = in(env, 1);  // [R, V] float32, [R]
    at::Tensor& seqs = env.at("beam_seqs");                        // [R, B, n]
    auto [scores, tokens] = logits.log_softmax(-1).topk(seqs.size(1), -1);
    seqs.select(2, 0).copy_(tokens);
    env["beam_scores"] = mask_extra_beams(scores, widths);
    env["beam_tokens"] = tokens.reshape({-1});
    env["beam_parents"] = at::zeros_like(tokens);
  }
};

class BeamStep final : public Node {
 public:
  using Node::Node;
  void run(const Context&, Env& env) const override {
    const at::Tensor &logits = in(env, 0), &scores = in(env, 1), &seqs = in(env, 2), &widths = in(env, 3);
    const int64_t r = scores.size(0), b = scores.size(1), vocab = logits.size(-1);
    at::Tensor cand = logits.log_softmax(-1).reshape({r, b, vocab}).add(scores.unsqueeze(-1));
    auto [top_scores, top_idx] = cand.reshape({r, b * vocab}).topk(b, -1);
    at::Tensor parents = top_idx.div(vocab, "floor");
    at::Tensor tokens = top_idx.sub(parents.mul(vocab));
    at::Tensor rows = parents.add(at::arange(r, parents.options()).unsqueeze(1).mul(b)).reshape({-1});
    at::Tensor new_seqs = seqs.gather(1, parents.unsqueeze(-1).expand_as(seqs)).clone();
    new_seqs.select(2, spec_.step).copy_(tokens);
    env["beam_seqs"] = new_seqs;
    env["beam_scores"] = mask_extra_beams(top_scores, widths);
    env["beam_tokens"] = tokens.reshape({-1});
    env["beam_parents"] = parents;
    for (size_t i = 4; i < spec_.inputs.size(); ++i) {
      const std::string& name = spec_.inputs[i];
      env[name] = env.at(name).index_select(0, rows);
    }
  }
};

}  // namespace

std::unique_ptr<Node> make_beam_init(const NodeSpec& spec) { return std::make_unique<BeamInit>(spec); }
std::unique_ptr<Node> make_beam_step(const NodeSpec& spec) { return std::make_unique<BeamStep>(spec); }

}  // namespace slmrank
