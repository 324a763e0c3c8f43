// decoder_layer: one transformer block in one of three attention modes.
//   score:   own-sample causal part + shared-prefix part, merged by LSE
//   prefill: causal over the packed prompts; keeps the prompt K/V every beam shares
//   decode:  one token per beam; prompt part + per-beam suffix part, merged by LSE
// Mirrors service/nodes.py::decoder_layer.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>


#include "layer_ops.h"
#include "node_types.h"
#include "triton_kernels.h"

namespace slmrank {
namespace {

enum class Mode { kScore, kPrefill, kDecode };

Mode parse_mode(const NodeSpec& spec) {
  if (spec.mode == "score") return Mode::kScore;
  if (spec.mode == "prefill") return Mode::kPrefill;
  if (spec.mode == "decode") return Mode::kDecode;
  throw std::invalid_argument("node " + spec.name + ": unknown decoder_layer mode '" + spec.mode + "'");
}

// Mirrors service/runtime/nodes.py::_varlen_layer_attention.
at::Tensor varlen_layer_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Env& env,
                                  Mode mode, double scale) {
  const at::Tensor& cu_self = env.at("cu_self");
  if (mode == Mode::kPrefill) {
    const int64_t t = q.size(0);
    return std::get<0>(varlen_attention(q, k, v, cu_self, cu_self, t, t, true, scale));
  }
  const at::Tensor& cu_blocks = env.at("cu_blocks");
  const int64_t block = q.size(0) / (cu_blocks.size(0) - 1);
  auto [out_self, lse_self] = varlen_attention(q, k, v, cu_self, cu_self, block, block, true, scale);
  // every row of a block against the block's prefix; only samples after a prefix keep it
  auto [out_ctx, lse_ctx] = varlen_attention(q, k, v, cu_blocks, cu_blocks, block, block, false, scale,
                                             env.at("prefix_len"));
  lse_ctx = lse_ctx.masked_fill(env.at("has_ctx").logical_not(), -std::numeric_limits<double>::infinity());
  // the log-sum-exp merge as one interpolation (exact algebra; weight 0 without a prefix)
  at::Tensor weight = lse_ctx.sub(lse_self).sigmoid().to(out_self.scalar_type()).unsqueeze(-1);  // [T, H, 1]
  return out_self.lerp(out_ctx, weight);
}

class DecoderLayer final : public Node {
 public:
  explicit DecoderLayer(const NodeSpec& spec) : Node(spec), mode_(parse_mode(spec)), i_(std::to_string(spec.layer)) {
    if (spec.layer < 0) throw std::invalid_argument("node " + spec.name + ": decoder_layer needs a layer index");
    if (mode_ == Mode::kDecode && spec.step < 1) throw std::invalid_argument("node " + spec.name + ": decode needs step >= 1");
  }

  void run(const Context& ctx, Env& env) const override {
    const ModelConfig& cfg = ctx.cfg;
    const LayerWeights& w = ctx.layers.at(spec_.layer);
    const TritonKernels* fused = ctx.fused.get();
    // the previous layer's MLP output, added to x by this layer's first norm
    auto [x, h] = residual_rms_norm(env.at("x"), has_pending_ ? env.at("mlp_out") : at::Tensor(), w.attn_norm,
                                    cfg.rms_norm_eps, fused);
    at::Tensor attn;
    if (mode_ == Mode::kScore || mode_ == Mode::kPrefill) {
      auto [q, k, v] = qkv_projection(cfg, w, h, env.at("positions"), 0, ctx.rope_cos, ctx.rope_sin, fused);
      if (env.count("cu_self")) {  // on CUDA: varlen flash attention over the packed segments
        attn = varlen_layer_attention(q, k, v, env, mode_, ctx.scale);
      } else if (mode_ == Mode::kScore) {
        attn = two_part_attention(q, k, v, env.at("mask_ctx"), k, v, env.at("mask_self"), ctx.scale);
      } else {
        attn = std::get<0>(masked_attention(q, k, v, env.at("mask_self"), ctx.scale));
      }
      if (mode_ == Mode::kPrefill) {
        env["prompt_k." + i_] = k;
        env["prompt_v." + i_] = v;
      }
    } else {
      const int64_t t = spec_.step;
      at::Tensor& suffix_k = env.at("suffix_k." + i_);  // [R*B, n-1, G, E]
      at::Tensor& suffix_v = env.at("suffix_v." + i_);
      // this token's k and v go straight into suffix slot t-1
      at::Tensor q = std::get<0>(qkv_projection(cfg, w, h, env.at("beam_pos"), t - 1, ctx.rope_cos, ctx.rope_sin,
                                                fused, suffix_k.select(1, t - 1), suffix_v.select(1, t - 1)));
      if (fused) {  // one kernel: the row's own prompt range (beam_masks) + its first t suffix slots
        attn = fused->decode_attention(q, env.at("prompt_k." + i_), env.at("prompt_v." + i_), env.at("kv_start"),
                                       env.at("kv_len"), suffix_k, suffix_v, t, ctx.scale);
      } else {
        attn = two_part_attention(q, env.at("prompt_k." + i_), env.at("prompt_v." + i_), env.at("mask_beam"),
                                  suffix_k.slice(1, 0, t), suffix_v.slice(1, 0, t), at::Tensor(), ctx.scale);
      }
    }
    auto [y, mlp_out] = attention_output_and_mlp(cfg, w, x, attn, fused);
    if (defers_mlp_) {  // the next layer's (or the final) norm adds it, in the same kernel
      env["x"] = y;
      env["mlp_out"] = mlp_out;
    } else {  // a DAG without the pending buffer
      env["x"] = y.add(mlp_out);
    }
  }

 private:
  static bool declares(const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  }

  Mode mode_;
  std::string i_;
  bool has_pending_ = declares(spec_.inputs, "mlp_out");
  bool defers_mlp_ = declares(spec_.outputs, "mlp_out");
};

}  // namespace

std::unique_ptr<Node> make_decoder_layer(const NodeSpec& spec) { return std::make_unique<DecoderLayer>(spec); }

}  // namespace slmrank
