// decoder_layer: one transformer block in one of three attention modes.
//   score:   own-sample causal part + shared-prefix part, merged by LSE (fused: one kernel over both)
//   prefill: causal over the packed prompts; keeps the prompt K/V every beam shares
//   decode:  one token per beam; prompt part + per-beam suffix part, merged by LSE
// Mirrors service/runtime/nodes.py::decoder_layer.
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

class DecoderLayer final : public Node {
 public:
  explicit DecoderLayer(const NodeSpec& spec) : Node(spec), mode_(parse_mode(spec)), i_(std::to_string(spec.layer)) {
    if (spec.layer < 0) throw std::invalid_argument("node " + spec.name + ": decoder_layer needs a layer index");
    if (mode_ == Mode::kDecode && spec.step < 1) throw std::invalid_argument("node " + spec.name + ": decode needs step >= 1");
    const std::string k = "prompt_k." + i_, v = "prompt_v." + i_, sk = "suffix_k." + i_, sv = "suffix_v." + i_;
    switch (mode_) {  // the buffers run() touches by name, each mode (service/artifact/dag.py::_layers)
      case Mode::kScore:
        require(0, 0, {"x", "positions", "mask_ctx", "mask_self", "cu_self", "cu_blocks", "prefix_len", "has_ctx",
                       "key_ranges"},
                {"x"});
        break;
      case Mode::kPrefill:
        require(0, 0, {"x", "positions", "mask_self", "cu_self", "key_ranges"}, {"x", k, v});
        break;
      case Mode::kDecode:
        require(0, 0, {"x", "beam_pos", "mask_beam", "kv_start", "kv_len", k, v, sk, sv, "suffix_rows"}, {"x", sk, sv});
        break;
    }
  }

  void run(const Context& ctx, Env& env) const override {
    const ModelConfig& cfg = ctx.cfg;
    const LayerWeights& stored = ctx.layers.at(spec_.layer);
    // the weights a GEMM of this many rows takes (an e4m3 one below its row floor: its model-dtype copy)
    const bool floored = !ctx.fp8_min_rows.empty();
    const LayerWeights at_these_rows = floored ? at_rows(ctx, spec_.layer, read(env, "x").size(0)) : LayerWeights();
    const LayerWeights& w = floored ? at_these_rows : stored;
    const TritonKernels* fused = ctx.fused.get();
    // the previous layer's MLP output, added to x by this layer's first norm (which quantizes its
    // output for an FP8 q/k/v GEMM on the fused path)
    auto [x, h] = residual_rms_norm_for(read(env, "x"), has_pending_ ? read(env, "mlp_out") : at::Tensor(),
                                        w.attn_norm, cfg.rms_norm_eps, fused, w.wqkv, w.wqkv_scale);
    at::Tensor attn;
    if (mode_ == Mode::kScore || mode_ == Mode::kPrefill) {
      auto [q, k, v] = qkv_projection(cfg, w, h, read(env, "positions"), 0, ctx.rope_cos, ctx.rope_sin, fused);
      if (fused) {  // one kernel: each row's prefix and own-segment keys (the masks node's key_ranges)
        attn = fused->segment_attention(q, k, v, read(env, "key_ranges"), ctx.scale);
      } else if (has(env, "cu_self")) {  // on CUDA in 16 bits: varlen flash attention over the packed segments
        attn = varlen_layer_attention(q, k, v, env, ctx.scale);
      } else if (q.device().is_cpu()) {  // a block (request) at a time: the same bytes packed as alone
        attn = blockwise_self_attention(q, k, v, read(env, "mask_self"),
                                        mode_ == Mode::kScore ? read(env, "mask_ctx") : at::Tensor(), ctx.scale);
      } else if (mode_ == Mode::kScore) {
        attn = two_part_attention(q, k, v, read(env, "mask_ctx"), k, v, read(env, "mask_self"), ctx.scale);
      } else {
        attn = std::get<0>(masked_attention(q, k, v, read(env, "mask_self"), ctx.scale));
      }
      if (mode_ == Mode::kPrefill) {
        write(env, "prompt_k." + i_, k);
        write(env, "prompt_v." + i_, v);
      }
    } else {
      const int64_t t = spec_.step;
      at::Tensor& suffix_k = update(env, "suffix_k." + i_);  // [R*B, n-1, G, E]
      at::Tensor& suffix_v = update(env, "suffix_v." + i_);
      const at::Tensor &prompt_k = read(env, "prompt_k." + i_), &prompt_v = read(env, "prompt_v." + i_);
      if (fused) {
        // one kernel: q/k norm + RoPE of the GEMM's output, this token's k/v into suffix slot t-1, then the
        // row's own prompt range (beam_masks) + its first t suffix slots (slot j from row suffix_rows[row, j])
        const bool norm = cfg.qk_norm;
        attn = fused->decode_attention_qkv(linear(h, w.wqkv, w.bqkv, w.wqkv_scale), read(env, "beam_pos"), t - 1,
                                           ctx.rope_cos, ctx.rope_sin, cfg.num_heads, norm ? w.q_norm : at::Tensor(),
                                           norm ? w.k_norm : at::Tensor(), cfg.rms_norm_eps, prompt_k, prompt_v,
                                           read(env, "kv_start"), read(env, "kv_len"), suffix_k, suffix_v,
                                           read(env, "suffix_rows"), t, ctx.scale);
      } else {  // this token's k and v go straight into suffix slot t-1, then the two parts
        at::Tensor q = std::get<0>(qkv_projection(cfg, w, h, read(env, "beam_pos"), t - 1, ctx.rope_cos,
                                                  ctx.rope_sin, nullptr, suffix_k.select(1, t - 1),
                                                  suffix_v.select(1, t - 1)));
        if (q.device().is_cpu()) {  // the prompt part a request's rows at a time: the same bytes as alone
          attn = two_part_attention_by_runs(q, prompt_k, prompt_v, read(env, "mask_beam"), suffix_k.slice(1, 0, t),
                                            suffix_v.slice(1, 0, t), ctx.scale);
        } else {
          attn = two_part_attention(q, prompt_k, prompt_v, read(env, "mask_beam"), suffix_k.slice(1, 0, t),
                                    suffix_v.slice(1, 0, t), at::Tensor(), ctx.scale);
        }
      }
    }
    auto [y, mlp_out] = attention_output_and_mlp(cfg, w, x, attn, fused);
    if (defers_mlp_) {  // the next layer's (or the final) norm adds it, in the same kernel
      write(env, "x", y);
      write(env, "mlp_out", mlp_out);
    } else {  // a DAG without the pending buffer
      write(env, "x", y.add(mlp_out));
    }
  }

 private:
  // Mirrors service/runtime/nodes.py::varlen_layer_attention.
  at::Tensor varlen_layer_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Env& env,
                                    double scale) const {
    const at::Tensor& cu_self = read(env, "cu_self");
    if (mode_ == Mode::kPrefill) {
      const int64_t t = q.size(0);
      return std::get<0>(varlen_attention(q, k, v, cu_self, cu_self, t, t, true, scale));
    }
    const at::Tensor& cu_blocks = read(env, "cu_blocks");
    const int64_t rows = spec_.max_rows, t = q.size(0);
    // each sample's segment (no longer than max_rows, the padding chunked to it), causal
    auto [out_self, lse_self] = varlen_attention(q, k, v, cu_self, cu_self, rows, rows, true, scale);
    // every row of a request (the last slot: up to T, with the padding) against the request's prefix;
    // only samples after a prefix keep it
    auto [out_ctx, lse_ctx] = varlen_attention(q, k, v, cu_blocks, cu_blocks, t, t, false, scale,
                                               read(env, "prefix_len"));
    lse_ctx = lse_ctx.masked_fill(read(env, "has_ctx").logical_not(), -std::numeric_limits<double>::infinity());
    // the log-sum-exp merge as one interpolation (exact algebra; weight 0 without a prefix)
    at::Tensor weight = lse_ctx.sub(lse_self).sigmoid().to(out_self.scalar_type()).unsqueeze(-1);  // [T, H, 1]
    return out_self.lerp(out_ctx, weight);
  }

  Mode mode_;
  std::string i_;
  bool has_pending_ = declares_input("mlp_out");
  bool defers_mlp_ = declares_output("mlp_out");
};

}  // namespace

std::unique_ptr<Node> make_decoder_layer(const NodeSpec& spec) { return std::make_unique<DecoderLayer>(spec); }

}  // namespace slmrank
