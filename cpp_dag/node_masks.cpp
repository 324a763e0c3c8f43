// score_masks / beam_masks: the attention visibility of a batch, from its segment ids.
// Mirrors service/runtime/nodes.py::score_masks / beam_masks.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ops/arange.h>

#include "layer_ops.h"
#include "node_types.h"

namespace slmrank {
namespace {

// [..., N] -> [..., N, N]: same segment and key position <= query position
at::Tensor causal_within(const at::Tensor& pos, const at::Tensor& seg) {
  at::Tensor same = seg.unsqueeze(-1).eq(seg.unsqueeze(-2));
  return same.bitwise_and(pos.unsqueeze(-2).le(pos.unsqueeze(-1)));
}

// FlashAttention takes 16-bit inputs only: float32 on CUDA keeps the dense-mask reference path
bool uses_varlen(const Context& ctx, const at::Tensor& seg) {
  const auto dtype = ctx.rope_cos.scalar_type();
  return seg.is_cuda() && (dtype == at::kHalf || dtype == at::kBFloat16);
}

class ScoreMasks final : public Node {
 public:
  explicit ScoreMasks(const NodeSpec& spec) : Node(spec) {
    require(5, 0, {}, {"mask_self", "mask_ctx", "cu_self", "cu_blocks", "prefix_len", "has_ctx", "key_ranges"});
  }
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &prefix = in(env, 2), &blocks = in(env, 3),
                     &last = in(env, 4);
    if (ctx.fused) {  // the fused segment attention (kernels/segment_attention.py): each row's key ranges
      write(env, "key_ranges", segment_key_ranges(seg, seg.size(0) / blocks.size(0), prefix));
      return;
    }
    if (uses_varlen(ctx, seg)) {  // varlen attention: segment bounds, and each request block's prefix (the shared K/V)
      const int64_t r = blocks.size(0), t = seg.size(0), s = last.size(0), block = t / r;
      // runs: at most a prefix and a padding run per block besides the samples
      write(env, "cu_self", segment_bounds(seg, block, s + 2 * r));
      write(env, "cu_blocks", at::arange(0, t + 1, block, seg.options().dtype(at::kInt)));  // [R+1]
      at::Tensor prefix_seg = prefix.view({r, block}).amax(1);  // a block's prefix segment id, or NO_CONTEXT (-2)
      write(env, "prefix_len", seg.view({r, block}).eq(prefix_seg.unsqueeze(1)).sum(1, false, at::kInt));  // [R]
      write(env, "has_ctx", prefix.ge(0).unsqueeze(1));  // [T, 1]: a sample after a prefix
      return;
    }
    write(env, "mask_self", causal_within(pos, seg));
    write(env, "mask_ctx", prefix.unsqueeze(1).eq(seg.unsqueeze(0)));  // a sample sees its whole prefix
  }
};

class BeamMasks final : public Node {
 public:
  explicit BeamMasks(const NodeSpec& spec) : Node(spec) {
    require(5, 0, {}, {"mask_self", "cu_self", "key_ranges", "mask_beam", "kv_start", "kv_len"});
  }
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &beam_req = in(env, 2), &plen = in(env, 3),
                     &last = in(env, 4);
    if (ctx.fused) {  // the fused segment attention: each row's key ranges, one causal segment per prompt
      write(env, "key_ranges", segment_key_ranges(seg, seg.size(0)));
    } else if (uses_varlen(ctx, seg)) {  // varlen prefill attention: one causal segment per prompt (+ the padding run)
      write(env, "cu_self", segment_bounds(seg, seg.size(0), last.size(0) + 1));
    } else {
      write(env, "mask_self", causal_within(pos, seg));  // causal within a prompt
    }
    write(env, "mask_beam", beam_req.unsqueeze(1).eq(seg.unsqueeze(0)));  // a beam sees its request's prompt
    if (ctx.fused) {  // the fused decode attention reads each beam row's prompt range instead of mask_beam
      write(env, "kv_len", plen);
      write(env, "kv_start", last.index_select(0, beam_req).sub(plen).add(1));
    }
  }
};

}  // namespace

std::unique_ptr<Node> make_score_masks(const NodeSpec& spec) { return std::make_unique<ScoreMasks>(spec); }
std::unique_ptr<Node> make_beam_masks(const NodeSpec& spec) { return std::make_unique<BeamMasks>(spec); }

}  // namespace slmrank
