#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "executor.h"

#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <stdexcept>

namespace slmrank {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

std::vector<std::unique_ptr<Node>> build_dag(const std::vector<NodeSpec>& specs) {
  std::vector<std::unique_ptr<Node>> dag;
  dag.reserve(specs.size());
  for (const auto& spec : specs) dag.push_back(make_node(spec));
  return dag;
}

LayerWeights layer_weights(const Context& ctx, int64_t i) {
  const std::string p = "layers." + std::to_string(i) + ".";
  auto optional = [&](const std::string& name) {
    auto it = ctx.weights.find(p + name);
    return it == ctx.weights.end() ? at::Tensor() : it->second;
  };
  LayerWeights w;
  w.attn_norm = ctx.weight(p + "attn_norm");
  w.wqkv = ctx.weight(p + "wqkv");
  w.bqkv = optional("bqkv");
  w.q_norm = optional("q_norm");
  w.k_norm = optional("k_norm");
  w.wo = ctx.weight(p + "wo");
  w.mlp_norm = ctx.weight(p + "mlp_norm");
  w.wgu = ctx.weight(p + "wgu");
  w.wdown = ctx.weight(p + "wdown");
  if (ctx.cfg.qk_norm && !(w.q_norm.defined() && w.k_norm.defined())) {
    throw std::invalid_argument("layer " + std::to_string(i) + ": qwen3 needs q_norm and k_norm weights");
  }
  return w;
}

double ms_between(int64_t a, int64_t b) { return static_cast<double>(b - a) / 1e6; }

}  // namespace

Executor::Executor(ModelConfig cfg, WeightMap weights, at::Tensor rope_cos, at::Tensor rope_sin,
                   const std::vector<NodeSpec>& score_dag, const std::vector<NodeSpec>& beam_dag)
    : device_(weights.count("embed") ? weights.at("embed").device() : at::Device(at::kCPU)),
      score_dag_(build_dag(score_dag)),
      beam_dag_(build_dag(beam_dag)),
      num_threads_(at::get_num_threads()) {
  ctx_.cfg = cfg;
  ctx_.weights = std::move(weights);
  ctx_.rope_cos = std::move(rope_cos);
  ctx_.rope_sin = std::move(rope_sin);
  ctx_.scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
  for (int64_t i = 0; i < cfg.num_layers; ++i) ctx_.layers.push_back(layer_weights(ctx_, i));
  worker_ = std::thread([this] { worker_loop(); });
}

Executor::~Executor() { shutdown(); }

std::vector<std::string> Executor::node_names(Kind kind) const {
  std::vector<std::string> names;
  for (const auto& n : kind == Kind::kScore ? score_dag_ : beam_dag_) names.push_back(n->spec().name);
  return names;
}

void Executor::walk(const std::vector<std::unique_ptr<Node>>& dag, Env& env, int64_t num_steps,
                    RunTimings& t) const {
  for (const auto& node : dag) {
    const NodeSpec& spec = node->spec();
    if (spec.step >= num_steps) continue;
    const int64_t start = now_ns();
    try {
      node->run(ctx_, env);
    } catch (const std::exception& e) {
      throw std::runtime_error("node " + spec.name + " (" + spec.type + "): " + e.what());
    }
    t.nodes.push_back({spec.name, ms_between(start, now_ns()), -1});
  }
}

RunOutput Executor::run(const BatchSpec& batch) { return run_timed(batch, now_ns()); }

RunOutput Executor::run_timed(const BatchSpec& batch, int64_t submit_ns) {
  c10::InferenceMode guard;
  RunOutput out;
  RunTimings& t = out.timings;
  t.submit_ns = submit_ns;
  t.start_ns = now_ns();
  Env env;
  for (const auto& [name, tensor] : batch.inputs) env[name] = tensor.to(device_, /*non_blocking=*/false);
  t.h2d_end_ns = now_ns();
  if (batch.kind == Kind::kBeam) {
    const auto& cfg = ctx_.cfg;
    const int64_t r = batch.num_requests, b = batch.beam_width, n = batch.new_tokens;
    if (r < 1 || b < 1 || n < 1) throw std::invalid_argument("beam batch: num_requests, beam_width, new_tokens must be >= 1");
    auto dtype = ctx_.rope_cos.scalar_type();
    env["beam_seqs"] = at::zeros({r, b, n}, at::TensorOptions().dtype(at::kLong).device(device_));
    for (int64_t i = 0; i < cfg.num_layers; ++i) {  // per-beam suffix K/V: one slot per decode step
      for (const char* kv : {"suffix_k.", "suffix_v."}) {
        env[kv + std::to_string(i)] = at::zeros({r * b, std::max<int64_t>(n - 1, 1), cfg.num_kv_heads, cfg.head_dim},
                                                at::TensorOptions().dtype(dtype).device(device_));
      }
    }
  }
  t.launch_ns = now_ns();
  if (batch.kind == Kind::kScore) {
    walk(score_dag_, env, 1, t);
    out.outputs = {env.at("scores").to(at::kCPU)};
  } else {
    walk(beam_dag_, env, batch.new_tokens, t);
    out.outputs = {env.at("beam_seqs").to(at::kCPU), env.at("beam_scores").to(at::kCPU)};
  }
  t.d2h_end_ns = now_ns();
  t.done_ns = t.d2h_end_ns;
  return out;
}

void Executor::submit(BatchSpec batch, Callback callback) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("executor is shut down: no new batches");
    queue_.push_back({std::move(batch), std::move(callback), now_ns()});
  }
  cv_.notify_one();
}

size_t Executor::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Executor::worker_loop() {
  at::set_num_threads(num_threads_);  // same intra-op threads as the caller: same reduction order
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      RunOutput out = run_timed(job.batch, job.submit_ns);
      out.timings.done_ns = now_ns();
      job.callback(&out, "");
    } catch (const std::exception& e) {
      job.callback(nullptr, e.what());  // one bad batch fails alone; the worker goes on
    }
  }
}

void Executor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

}  // namespace slmrank
