// rms_norm and gather_rows: the model's final norm and the pick of each sequence's last row.
// Mirrors service/runtime/nodes.py::rms_norm_node / gather_rows.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "layer_ops.h"
#include "node_types.h"

namespace slmrank {
namespace {

class RmsNorm final : public Node {
 public:
  explicit RmsNorm(const NodeSpec& spec) : Node(spec) { require(1, 1); }
  void run(const Context& ctx, Env& env) const override {
    // a second input: the last layer's MLP output, added first (in one kernel with the norm when fused)
    const at::Tensor pending = spec_.inputs.size() > 1 ? in(env, 1) : at::Tensor();
    env[spec_.outputs[0]] =
        residual_rms_norm(in(env, 0), pending, ctx.weight(spec_.weight), ctx.cfg.rms_norm_eps, ctx.fused.get()).second;
  }
};

class GatherRows final : public Node {
 public:
  explicit GatherRows(const NodeSpec& spec) : Node(spec) { require(2, 1); }
  void run(const Context&, Env& env) const override {
    env[spec_.outputs[0]] = in(env, 0).index_select(0, in(env, 1));
  }
};

}  // namespace

std::unique_ptr<Node> make_rms_norm(const NodeSpec& spec) { return std::make_unique<RmsNorm>(spec); }
std::unique_ptr<Node> make_gather_rows(const NodeSpec& spec) { return std::make_unique<GatherRows>(spec); }

}  // namespace slmrank
