// lm_head, cls_head, label_logprobs: from the last hidden rows to a request's scores.
// Mirrors service/runtime/nodes.py::lm_head / cls_head / label_logprobs.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <limits>

#include "layer_ops.h"
#include "node_types.h"
#include "triton_kernels.h"

namespace slmrank {
namespace {

class LmHead final : public Node {
 public:
  explicit LmHead(const NodeSpec& spec) : Node(spec) { require(1, 1); }
  void run(const Context& ctx, Env& env) const override {
    Activation a(in(env, 0));
    at::Tensor rows_w, scale;  // tied embeddings share the table (unless the head is fp8)
    if (ctx.weights.count("lm_head")) {
      std::tie(rows_w, scale) = ctx.gemm_weight("lm_head", a.x.size(0));
    } else {
      rows_w = ctx.weight("embed");
    }
    const at::Tensor codes = optional_input(env, "beam_codes");
    if (codes.defined()) {  // a batch normalised over a catalog's code tokens: their rows only, -inf past them
      const at::Tensor rows = codes.clamp_min(0);
      rows_w = rows_w.index_select(0, rows);
      if (scale.defined()) scale = scale.index_select(0, rows);
    }
    if (const TritonKernels* fused = ctx.fused.get(); fp8_in_kernel(fused, a.x, rows_w, scale)) {
      auto [q, s] = fused->quantize_rows(a.x);  // the final norm's rows, quantized in one kernel
      a = Activation(q, s);
    }
    at::Tensor logits = linear(a, rows_w, at::Tensor(), scale);
    if (codes.defined()) logits = logits.masked_fill(codes.lt(0), -std::numeric_limits<double>::infinity());
    // the fused beam step reads the model-dtype logits once (computing in float32): no float32 copy
    env[spec_.outputs[0]] = ctx.fused ? logits : logits.to(at::kFloat);
  }
};

class ClsHead final : public Node {
 public:
  explicit ClsHead(const NodeSpec& spec) : Node(spec) { require(1, 1); }
  void run(const Context& ctx, Env& env) const override {
    const at::Tensor& x = in(env, 0);
    auto [w, scale] = ctx.gemm_weight("cls_head", x.size(0));
    at::Tensor logits = linear(x, w, at::Tensor(), scale);
    env[spec_.outputs[0]] = logits.to(at::kFloat);
  }
};

class LabelLogprobs final : public Node {
 public:
  explicit LabelLogprobs(const NodeSpec& spec) : Node(spec) { require(2, 1); }
  void run(const Context&, Env& env) const override {
    env[spec_.outputs[0]] = in(env, 0).to(at::kFloat).log_softmax(-1).gather(1, in(env, 1));
  }
};

}  // namespace

std::unique_ptr<Node> make_lm_head(const NodeSpec& spec) { return std::make_unique<LmHead>(spec); }
std::unique_ptr<Node> make_cls_head(const NodeSpec& spec) { return std::make_unique<ClsHead>(spec); }
std::unique_ptr<Node> make_label_logprobs(const NodeSpec& spec) { return std::make_unique<LabelLogprobs>(spec); }

}  // namespace slmrank
