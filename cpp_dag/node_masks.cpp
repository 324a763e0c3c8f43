// score_masks / beam_masks: the attention visibility of a batch, from its segment ids.
// Mirrors service/nodes.py::score_masks / beam_masks.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "layer_ops.h"
#include "node_types.h"

namespace slmrank {
namespace {

// [..., N] -> [..., N, N]: same segment and key position <= query position
at::Tensor causal_within(const at::Tensor& pos, const at::Tensor& seg) {
  at::Tensor same = seg.unsqueeze(-1).eq(seg.unsqueeze(-2));
  return same.bitwise_and(pos.unsqueeze(-2).le(pos.unsqueeze(-1)));
}

class ScoreMasks final : public Node {
 public:
  using Node::Node;
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &prefix = in(env, 2), &blocks = in(env, 3);
    if (seg.is_cuda()) {  // one fused attention per request block over the union (a row sees at least itself)
      const int64_t r = blocks.size(0);
      at::Tensor pos_b = pos.view({r, -1}), seg_b = seg.view({r, -1}), prefix_b = prefix.view({r, -1});
      at::Tensor visible = causal_within(pos_b, seg_b).bitwise_or(prefix_b.unsqueeze(-1).eq(seg_b.unsqueeze(-2)));
      env["attn_bias"] = attention_bias(visible, ctx.rope_cos.scalar_type());  // [R, 1, T/R, T/R]
      return;
    }
    env["mask_self"] = causal_within(pos, seg);
    env["mask_ctx"] = prefix.unsqueeze(1).eq(seg.unsqueeze(0));  // a sample sees its whole prefix
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
    if (ctx.fused) {  // the fused decode attention reads each beam row's prompt range instead of mask_beam
      const at::Tensor& plen = env.at("beam_pos");
      env["kv_len"] = plen;
      env["kv_start"] = env.at("last").index_select(0, beam_req).sub(plen).add(1);
    }
  }
};

}  // namespace

std::unique_ptr<Node> make_score_masks(const NodeSpec& spec) { return std::make_unique<ScoreMasks>(spec); }
std::unique_ptr<Node> make_beam_masks(const NodeSpec& spec) { return std::make_unique<BeamMasks>(spec); }

}  // namespace slmrank
