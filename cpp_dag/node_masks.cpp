// score_masks / beam_masks: the attention visibility of a batch, from its segment ids.
// Mirrors service/nodes.py::score_masks / beam_masks.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "layer_ops.h"
#include "node_types.h"

namespace slmrank {
namespace {

// causal within a segment: same segment and key position <= query position
at::Tensor causal_within(const at::Tensor& pos, const at::Tensor& seg) {
  at::Tensor same = seg.unsqueeze(1).eq(seg.unsqueeze(0));
  return same.bitwise_and(pos.unsqueeze(0).le(pos.unsqueeze(1)));
}

class ScoreMasks final : public Node {
 public:
  using Node::Node;
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &prefix = in(env, 2);
    env["mask_self"] = causal_within(pos, seg);
    env["mask_ctx"] = prefix.unsqueeze(1).eq(seg.unsqueeze(0));  // a sample sees its whole prefix
    if (seg.is_cuda()) {  // one fused attention over the union (every row sees at least itself)
      env["attn_bias"] = attention_bias(env.at("mask_self").bitwise_or(env.at("mask_ctx")), ctx.rope_cos.scalar_type());
    }
  }
};

class BeamMasks final : public Node {
 public:
  using Node::Node;
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &beam_req = in(env, 2);
    env["mask_self"] = causal_within(pos, seg);
    env["mask_beam"] = beam_req.unsqueeze(1).eq(seg.unsqueeze(0));  // a beam sees its request's prompt
    if (seg.is_cuda()) env["attn_bias"] = attention_bias(env.at("mask_self"), ctx.rope_cos.scalar_type());
  }
};

}  // namespace

std::unique_ptr<Node> make_score_masks(const NodeSpec& spec) { return std::make_unique<ScoreMasks>(spec); }
std::unique_ptr<Node> make_beam_masks(const NodeSpec& spec) { return std::make_unique<BeamMasks>(spec); }

}  // namespace slmrank
