// The static DAG as the C++ runtime sees it: model config, node specs from the manifest, the
// per-run buffer environment, and the Node interface every node type implements.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace slmrank {

struct ModelConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, intermediate_size = 0, num_labels = 0;
  double rms_norm_eps = 1e-6;
  bool qk_norm = false;
  int64_t q_size() const { return num_heads * head_dim; }
  int64_t kv_size() const { return num_kv_heads * head_dim; }
};

// One node of the manifest's DAG (service/artifact/dag.py writes them).
struct NodeSpec {
  std::string name, type;
  std::vector<std::string> inputs, outputs;
  int64_t layer = -1;  // decoder_layer
  int64_t step = 0;    // decode-step nodes: 1..max_new_tokens-1
  std::string mode;    // decoder_layer: score | prefill | decode
  std::string weight;  // rms_norm: the weight's name
  int64_t max_rows = 0;  // score_masks / score decoder_layer: the most tokens of one request (a segment's bound)
};

// Named buffers of one run. Nodes read their inputs and (re)bind their outputs here.
using Env = std::unordered_map<std::string, at::Tensor>;
using WeightMap = std::unordered_map<std::string, at::Tensor>;

struct LayerWeights {
  at::Tensor attn_norm, wqkv, bqkv, q_norm, k_norm, wo, mlp_norm, wgu, wdown;  // bqkv/q_norm/k_norm may be undefined
  // the e4m3 weights' per-output-channel float32 scales (`slmrank build --fp8`); undefined: not fp8
  at::Tensor wqkv_scale, wo_scale, wgu_scale, wdown_scale;
};

// Everything a node reads besides the Env: immutable after construction.
class TritonKernels;  // triton_kernels.h

struct Context {
  ModelConfig cfg;
  WeightMap weights;
  std::vector<LayerWeights> layers;
  // each e4m3 weight's row floor (NAME.min_rows, read once on the host): below it a GEMM takes NAME.full
  std::unordered_map<std::string, int64_t> fp8_min_rows;
  at::Tensor rope_cos, rope_sin;  // [positions, head_dim] in the compute dtype
  double scale = 1.0;             // head_dim ** -0.5
  // The fused Triton kernels (CUDA), or null: the ATen ops. Set before the first batch.
  std::shared_ptr<const TritonKernels> fused;

  const at::Tensor& weight(const std::string& name) const;
  // The GEMM weight `name` for activations of `rows` rows and its e4m3 scale (undefined: not e4m3):
  // the stored weight, or below its row floor its model-dtype copy NAME.full. layers.py::gemm_weight.
  std::pair<at::Tensor, at::Tensor> gemm_weight(const std::string& name, int64_t rows) const;
};

// A node touches only the buffers its spec declares (service/artifact/dag.py): every node type
// states at construction what it reads and writes by name (`require`, checked against the spec
// when the DAG is loaded), and every access goes through the checked accessors below.
class Node {
 public:
  explicit Node(NodeSpec spec) : spec_(std::move(spec)) {}
  virtual ~Node() = default;
  virtual void run(const Context& ctx, Env& env) const = 0;
  const NodeSpec& spec() const { return spec_; }

 protected:
  const at::Tensor& in(const Env& env, size_t i) const;  // the i-th declared input, which must be set
  const at::Tensor& read(const Env& env, const std::string& name) const;  // declared input or output
  at::Tensor& update(Env& env, const std::string& name) const;  // declared input and output, changed in place
  void write(Env& env, const std::string& name, at::Tensor value) const;  // declared output
  bool has(const Env& env, const std::string& name) const;  // declared input: is it set on this device?
  // An input the node may declare and a batch may leave out (beam_codes): the buffer, else undefined.
  at::Tensor optional_input(const Env& env, const std::string& name) const;
  // std::invalid_argument naming the node and the buffer unless the spec declares at least
  // min_inputs inputs and min_outputs outputs, every name of `reads` as an input and every name
  // of `writes` as an output.
  void require(size_t min_inputs, size_t min_outputs, const std::vector<std::string>& reads = {},
               const std::vector<std::string>& writes = {}) const;
  bool declares_input(const std::string& name) const;
  bool declares_output(const std::string& name) const;
  NodeSpec spec_;
};

// The registry (nodes.cpp): one line per node type. Throws std::invalid_argument for an unknown type.
std::unique_ptr<Node> make_node(const NodeSpec& spec);

// A batch's input buffers (service/artifact/dag.py SCORE_INPUTS / BEAM_INPUTS).
const std::vector<std::string>& batch_inputs(bool beam);

// std::invalid_argument unless every input a node declares is a batch input or an earlier node's
// output, and the DAG writes `outputs` (service/artifact/dag.py check_dataflow).
void check_dataflow(const std::vector<NodeSpec>& dag, const std::vector<std::string>& inputs,
                    const std::vector<std::string>& outputs);

}  // namespace slmrank
