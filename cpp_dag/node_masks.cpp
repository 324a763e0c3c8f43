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
    require(6, 0, {}, {"mask_self", "mask_ctx", "cu_self", "cu_blocks", "prefix_len", "has_ctx", "key_ranges"});
  }
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor &pos = in(env, 0), &seg = in(env, 1), &prefix = in(env, 2), &request_rows = in(env, 3),
                     &prefix_rows = in(env, 4), &last = in(env, 5);
    if (ctx.fused) {  // the fused segment attention (kernels/segment_attention.py): each row's key ranges
      write(env, "key_ranges", segment_key_ranges(seg, prefix, request_rows, prefix_rows));
      return;
    }
    if (uses_varlen(ctx, seg)) {  // varlen attention: segment bounds, and each request's prefix (the shared K/V)
      const int64_t r = prefix_rows.size(0), s = last.size(0), chunk = spec_.max_rows;
      if (chunk <= 0) throw std::invalid_argument("node " + spec_.name + ": score_masks needs max_rows > 0");
      // runs: the prefixes and samples, and the padding in chunks of at most max_rows
      write(env, "cu_self", segment_bounds(seg, s + r + seg.size(0) / chunk + 1, chunk));
      write(env, "cu_blocks", request_rows.to(at::kInt));  // [R+1]: each request's rows
      write(env, "prefix_len", prefix_rows.to(at::kInt));  // [R]
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
      write(env, "key_ranges", segment_key_ranges(seg));
    } else if (uses_varlen(ctx, seg)) {  // varlen prefill attention: one causal segment per prompt (+ the padding run)
      write(env, "cu_self", segment_bounds(seg, last.size(0) + 1));
    } else {
      write(env, "mask_self", causal_within(pos, seg));  // causal within a prompt
    }
    // a beam row sees its request's prompt; a padding row (request R) no prompt token (seg < R)
    write(env, "mask_beam", beam_req.unsqueeze(1).eq(seg.unsqueeze(0)));
    if (ctx.fused) {  // the fused decode attention reads each beam row's prompt range instead of mask_beam
      write(env, "kv_len", plen);  // 0 for a padding row: no prompt key
      write(env, "kv_start", last.index_select(0, beam_req.clamp_max(last.size(0) - 1)).sub(plen).add(1));
    }
  }
};

}  // namespace

std::unique_ptr<Node> make_score_masks(const NodeSpec& spec) { return std::make_unique<ScoreMasks>(spec); }
std::unique_ptr<Node> make_beam_masks(const NodeSpec& spec) { return std::make_unique<BeamMasks>(spec); }

}  // namespace slmrank
