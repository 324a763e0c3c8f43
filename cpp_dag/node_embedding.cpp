// embedding: token ids -> hidden rows. Mirrors service/runtime/nodes.py::embedding.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ops/embedding.h>

#include "node_types.h"

namespace slmrank {
namespace {

class Embedding final : public Node {
 public:
  explicit Embedding(const NodeSpec& spec) : Node(spec) { require(1, 1); }
  void run(const Context& ctx, Env& env) const override {
    env[spec_.outputs[0]] = at::embedding(ctx.weight("embed"), in(env, 0).reshape({-1}));
  }
};

}  // namespace

std::unique_ptr<Node> make_embedding(const NodeSpec& spec) { return std::make_unique<Embedding>(spec); }

}  // namespace slmrank
