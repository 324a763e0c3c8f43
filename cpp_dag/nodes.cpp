// The node registry: adding a node type is its own file plus one line here.
#include <functional>
#include <stdexcept>

#include "dag.h"
#include "node_types.h"

namespace slmrank {

const at::Tensor& Context::weight(const std::string& name) const {
  auto it = weights.find(name);
  if (it == weights.end()) throw std::invalid_argument("weight '" + name + "' is not in the artifact");
  return it->second;
}

const at::Tensor& Node::in(const Env& env, size_t i) const {
  const std::string& name = spec_.inputs.at(i);
  auto it = env.find(name);
  if (it == env.end()) throw std::runtime_error("input buffer '" + name + "' is not set");
  return it->second;
}

std::unique_ptr<Node> make_node(const NodeSpec& spec) {
  using Factory = std::function<std::unique_ptr<Node>(const NodeSpec&)>;
  static const std::unordered_map<std::string, Factory> registry = {
      {"score_masks", make_score_masks},
      {"beam_masks", make_beam_masks},
      {"embedding", make_embedding},
      {"decoder_layer", make_decoder_layer},
      {"rms_norm", make_rms_norm},
      {"gather_rows", make_gather_rows},
      {"lm_head", make_lm_head},
      {"cls_head", make_cls_head},
      {"label_logprobs", make_label_logprobs},
      {"beam_init", make_beam_init},
      {"beam_step", make_beam_step},
  };
  auto it = registry.find(spec.type);
  if (it == registry.end()) {
    throw std::invalid_argument("node " + spec.name + ": unknown node type '" + spec.type + "'");
  }
  return it->second(spec);
}

}  // namespace slmrank
