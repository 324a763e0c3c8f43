// The node registry: adding a node type is its own file plus one line here.
#include <algorithm>
#include <functional>
#include <stdexcept>
#include <unordered_set>

#include "dag.h"
#include "node_types.h"

namespace slmrank {

const at::Tensor& Context::weight(const std::string& name) const {
  auto it = weights.find(name);
  if (it == weights.end()) throw std::invalid_argument("weight '" + name + "' is not in the artifact");
  return it->second;
}

std::pair<at::Tensor, at::Tensor> Context::gemm_weight(const std::string& name, int64_t rows) const {
  if (auto floor = fp8_min_rows.find(name); floor != fp8_min_rows.end() && rows < floor->second) {
    return {weight(name + ".full"), at::Tensor()};
  }
  auto scale = weights.find(name + ".scale");
  return {weight(name), scale != weights.end() ? scale->second : at::Tensor()};
}

namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

bool Node::declares_input(const std::string& name) const { return contains(spec_.inputs, name); }
bool Node::declares_output(const std::string& name) const { return contains(spec_.outputs, name); }

const at::Tensor& Node::in(const Env& env, size_t i) const {
  if (i >= spec_.inputs.size()) {
    throw std::logic_error("node " + spec_.name + " reads input " + std::to_string(i) + " of " +
                           std::to_string(spec_.inputs.size()) + " declared");
  }
  const std::string& name = spec_.inputs[i];
  auto it = env.find(name);
  if (it == env.end()) throw std::runtime_error("input buffer '" + name + "' is not set");
  return it->second;
}

const at::Tensor& Node::read(const Env& env, const std::string& name) const {
  if (!declares_input(name) && !declares_output(name)) {
    throw std::logic_error("node " + spec_.name + " (" + spec_.type + ") reads buffer '" + name +
                           "', which it does not declare as an input");
  }
  auto it = env.find(name);
  if (it == env.end()) throw std::runtime_error("buffer '" + name + "' is not set");
  return it->second;
}

at::Tensor& Node::update(Env& env, const std::string& name) const {
  if (!declares_input(name) || !declares_output(name)) {
    throw std::logic_error("node " + spec_.name + " (" + spec_.type + ") changes buffer '" + name +
                           "' in place, which it does not declare as both an input and an output");
  }
  auto it = env.find(name);
  if (it == env.end()) throw std::runtime_error("buffer '" + name + "' is not set");
  return it->second;
}

void Node::write(Env& env, const std::string& name, at::Tensor value) const {
  if (!declares_output(name)) {
    throw std::logic_error("node " + spec_.name + " (" + spec_.type + ") writes buffer '" + name +
                           "', which it does not declare as an output");
  }
  env[name] = std::move(value);
}

at::Tensor Node::optional_input(const Env& env, const std::string& name) const {
  return declares_input(name) && env.count(name) > 0 ? env.at(name) : at::Tensor();
}

bool Node::has(const Env& env, const std::string& name) const {
  if (!declares_input(name)) {
    throw std::logic_error("node " + spec_.name + " (" + spec_.type + ") looks for buffer '" + name +
                           "', which it does not declare as an input");
  }
  return env.count(name) > 0;
}

void Node::require(size_t min_inputs, size_t min_outputs, const std::vector<std::string>& reads,
                   const std::vector<std::string>& writes) const {
  const std::string node = "node " + spec_.name + " (" + spec_.type + ")";
  for (const auto& name : reads) {
    if (!declares_input(name)) throw std::invalid_argument(node + " reads '" + name + "' but does not declare it as an input");
  }
  for (const auto& name : writes) {
    if (!declares_output(name)) throw std::invalid_argument(node + " writes '" + name + "' but does not declare it as an output");
  }
  if (spec_.inputs.size() < min_inputs || spec_.outputs.size() < min_outputs) {
    throw std::invalid_argument(node + " declares " + std::to_string(spec_.inputs.size()) + " inputs and " +
                                std::to_string(spec_.outputs.size()) + " outputs; it needs at least " +
                                std::to_string(min_inputs) + " and " + std::to_string(min_outputs));
  }
}

const std::vector<std::string>& batch_inputs(bool beam) {
  static const std::vector<std::string> score = {"tokens", "positions", "seg", "ctx", "request_rows", "prefix_rows", "last", "labels"};
  static const std::vector<std::string> beams = {"tokens",   "positions", "seg",       "last",     "beam_width",
                                                 "beam_req", "beam_pos",  "beam_slot", "beam_src", "beam_seqs",
                                                 "beam_catalog", "beam_steps", "beam_codes"};
  return beam ? beams : score;
}

void check_dataflow(const std::vector<NodeSpec>& dag, const std::vector<std::string>& inputs,
                    const std::vector<std::string>& outputs) {
  std::unordered_set<std::string> available(inputs.begin(), inputs.end());
  for (const auto& spec : dag) {
    for (const auto& name : spec.inputs) {
      if (!available.count(name)) {
        throw std::invalid_argument("node " + spec.name + " (" + spec.type + ") reads '" + name +
                                    "', which neither the batch nor an earlier node provides");
      }
    }
    available.insert(spec.outputs.begin(), spec.outputs.end());
  }
  for (const auto& name : outputs) {
    if (!dag.empty() && !available.count(name)) throw std::invalid_argument("the DAG never writes '" + name + "'");
  }
}

std::unique_ptr<Node> make_node(const NodeSpec& spec) {
  using Factory = std::function<std::unique_ptr<Node>(const NodeSpec&)>;
  static const std::unordered_map<std::string, Factory> registry = {
      {"score_masks", make_score_masks},
      {"beam_masks", make_beam_masks},
      {"beam_state", make_beam_state},
      {"embedding", make_embedding},
      {"decoder_layer", make_decoder_layer},
      {"rms_norm", make_rms_norm},
      {"gather_rows", make_gather_rows},
      {"lm_head", make_lm_head},
      {"cls_head", make_cls_head},
      {"label_logprobs", make_label_logprobs},
      {"beam_init", make_beam_init},
      {"beam_step", make_beam_step},
      {"beam_allowed", make_beam_allowed},
      {"beam_hold", make_beam_hold},
  };
  auto it = registry.find(spec.type);
  if (it == registry.end()) {
    throw std::invalid_argument("node " + spec.name + ": unknown node type '" + spec.type + "'");
  }
  return it->second(spec);
}

}  // namespace slmrank
