#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "executor.h"

#include "triton_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>

namespace slmrank {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

namespace {

// The node objects of one DAG, and its declarations checked: each node type finds the buffers it
// uses declared (its constructor's `require`), every input comes from the batch or an earlier node,
// and the batch's outputs are written.
std::vector<std::unique_ptr<Node>> build_dag(const std::vector<NodeSpec>& specs, bool beam) {
  std::vector<std::unique_ptr<Node>> dag;
  dag.reserve(specs.size());
  for (const auto& spec : specs) dag.push_back(make_node(spec));
  if (beam) {
    check_dataflow(specs, batch_inputs(true), {"held_seqs", "held_scores"});
  } else {
    check_dataflow(specs, batch_inputs(false), {"scores"});
  }
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
  w.wqkv_scale = optional("wqkv.scale");
  w.wo_scale = optional("wo.scale");
  w.wgu_scale = optional("wgu.scale");
  w.wdown_scale = optional("wdown.scale");
  if (ctx.cfg.qk_norm && !(w.q_norm.defined() && w.k_norm.defined())) {
    throw std::invalid_argument("layer " + std::to_string(i) + ": qwen3 needs q_norm and k_norm weights");
  }
  return w;
}

double ms_between(int64_t a, int64_t b) { return static_cast<double>(b - a) / 1e6; }

// The first step's nodes of a plan (the DAG lists them first): a family's graph marks each of them,
// then each later step as a whole.
size_t first_step_size(const std::vector<const Node*>& nodes) {
  return static_cast<size_t>(std::count_if(nodes.begin(), nodes.end(), [](const Node* n) { return n->spec().step == 0; }));
}

}  // namespace

Executor::Executor(ModelConfig cfg, WeightMap weights, at::Tensor rope_cos, at::Tensor rope_sin,
                   const std::vector<NodeSpec>& score_dag, const std::vector<NodeSpec>& beam_dag, bool use_graphs,
                   int num_lanes)
    : device_(weights.count("embed") ? weights.at("embed").device() : at::Device(at::kCPU)),
      score_dag_(build_dag(score_dag, false)),
      beam_dag_(build_dag(beam_dag, true)),
      num_threads_(at::get_num_threads()),
      use_graphs_(use_graphs && device_.is_cuda()) {
  ctx_.cfg = cfg;
  ctx_.weights = std::move(weights);
  ctx_.rope_cos = std::move(rope_cos);
  ctx_.rope_sin = std::move(rope_sin);
  ctx_.scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
  const std::string floor_suffix = ".min_rows";  // service/model/checkpoint.py::fp8_min_rows
  for (const auto& [name, t] : ctx_.weights) {
    if (name.size() > floor_suffix.size() &&
        name.compare(name.size() - floor_suffix.size(), floor_suffix.size(), floor_suffix) == 0) {
      ctx_.fp8_min_rows[name.substr(0, name.size() - floor_suffix.size())] = t.reshape({-1})[0].item<int64_t>();
    }
  }
  for (int64_t i = 0; i < cfg.num_layers; ++i) ctx_.layers.push_back(layer_weights(ctx_, i));
  for (const auto& spec : beam_dag) max_steps_ = std::max(max_steps_, spec.step + 1);
  if (num_lanes <= 0) num_lanes = device_.is_cuda() ? 2 : 1;
  for (int i = 0; i < num_lanes; ++i) {
    auto lane = std::make_unique<Lane>();
    lane->index = i;
    // one pool per lane: a lane's graphs never run concurrently, two lanes' do
    if (use_graphs_) lane->graph_pool = new_graph_pool();
    lanes_.push_back(std::move(lane));
  }
  for (auto& lane : lanes_) lane->worker = std::thread([this, l = lane.get()] { worker_loop(*l); });
}

Executor::~Executor() { shutdown(); }

void Executor::use_triton_kernels(const std::string& dir) {
  if (!device_.is_cuda()) throw std::invalid_argument("use_triton_kernels: the executor is on " + device_.str() + ", not CUDA");
  if (num_graphs() > 0) throw std::logic_error("use_triton_kernels: graphs are already captured; call it first");
  ctx_.fused = std::make_shared<const TritonKernels>(dir, device_);
}

void Executor::use_conditional_steps() {
  if (num_graphs() > 0) throw std::logic_error("use_conditional_steps: graphs are already captured; call it first");
  conditional_steps_ = true;
  if (!use_graphs_) return;
  for (auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->busy);
    if (!lane->stop) lane->stop = std::make_unique<HostFlag>(device_);
  }
}

BatchSpec Executor::family_of(const BatchSpec& batch) const {
  BatchSpec family = batch;
  auto it = batch.inputs.find("beam_seqs");  // [R, B, n]: the one input sized by the bucket's new tokens
  if (it == batch.inputs.end() || it->second.dim() != 3) throw std::invalid_argument("beam batch: no beam_seqs [R, B, n]");
  const int64_t n = it->second.size(2);
  if (n > max_steps_) {
    throw std::invalid_argument("beam batch: " + std::to_string(n) + " new tokens, the DAG runs at most " +
                                std::to_string(max_steps_));
  }
  if (n < max_steps_) family.inputs["beam_seqs"] = at::constant_pad_nd(it->second, {0, max_steps_ - n}, 0);
  family.new_tokens = max_steps_;
  return family;
}

const BatchSpec& Executor::as_run(const BatchSpec& batch, BatchSpec& padded) const {
  if (!in_family(batch)) return batch;
  padded = family_of(batch);
  return padded;
}

std::vector<std::string> Executor::node_names(Kind kind) const {
  std::vector<std::string> names;
  for (const auto& n : kind == Kind::kScore ? score_dag_ : beam_dag_) names.push_back(n->spec().name);
  return names;
}

std::vector<const Node*> Executor::plan(const BatchSpec& batch) const {
  const auto& dag = batch.kind == Kind::kScore ? score_dag_ : beam_dag_;
  const int64_t num_steps = batch.kind == Kind::kScore ? 1 : batch.new_tokens;
  std::vector<const Node*> nodes;
  for (const auto& node : dag) {
    if (node->spec().step < num_steps) nodes.push_back(node.get());
  }
  return nodes;
}

void Executor::run_nodes(const std::vector<const Node*>& nodes, Env& env, const std::function<void(size_t)>& mark,
                         std::vector<double>* host_ms, const std::vector<std::string>* trace_buffers,
                         std::vector<TraceEntry>* trace, const std::function<void(size_t)>* before) const {
  for (size_t k = 0; k < nodes.size(); ++k) {
    const NodeSpec& spec = nodes[k]->spec();
    if (before && k > 0) (*before)(k);
    const int64_t start = now_ns();
    try {
      nodes[k]->run(ctx_, env);
    } catch (const std::exception& e) {
      throw std::runtime_error("node " + spec.name + " (" + spec.type + "): " + e.what());
    }
    mark(k);
    if (host_ms) host_ms->push_back(ms_between(start, now_ns()));
    if (trace && trace_buffers && !trace_buffers->empty()) {
      TraceEntry entry{spec.name, {}};
      for (const auto& name : *trace_buffers) {
        auto it = env.find(name);
        if (it != env.end()) entry.buffers.emplace_back(name, it->second.to(at::kCPU, false, /*copy=*/true));
      }
      trace->push_back(std::move(entry));
    }
  }
}

Env Executor::device_env(const BatchSpec& batch) const {
  Env env;
  for (const auto& [name, tensor] : batch.inputs) env[name] = tensor.to(device_, /*non_blocking=*/false);
  if (batch.kind == Kind::kBeam && (batch.num_requests < 1 || batch.beam_width < 1 || batch.new_tokens < 1)) {
    throw std::invalid_argument("beam batch: num_requests, beam_width and new_tokens must be >= 1");
  }
  return env;
}

namespace {

std::vector<std::string> output_names(Kind kind) {
  if (kind == Kind::kScore) return {"scores"};
  return {"held_seqs", "held_scores"};  // the beam_hold nodes': each request's beams at its own last step
}

std::string bucket_key(const BatchSpec& batch) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : batch.inputs) shapes[name] = t.sizes().vec();
  std::string key = batch.kind == Kind::kScore ? "score" : "beam";
  key += "/r" + std::to_string(batch.num_requests) + "/b" + std::to_string(batch.beam_width) + "/n" +
         std::to_string(batch.new_tokens);
  for (const auto& [name, sizes] : shapes) {
    key += "/" + name + ":";
    for (auto s : sizes) key += std::to_string(s) + "x";
  }
  return key;
}

}  // namespace

void Executor::run_conditional_steps(const std::vector<const Node*>& nodes, Env& env, ConditionalScope& cond,
                                     const GroupRunner& run_group, const std::function<void()>& step_done,
                                     const at::Tensor& stop) const {
  std::vector<std::vector<const Node*>> steps(static_cast<size_t>(max_steps_));
  int64_t last = 0;
  for (const Node* node : nodes) {  // the DAG lists each step's nodes after the step before's
    const int64_t t = node->spec().step;
    if (t < last || t > last + 1 || t >= max_steps_) {
      throw std::logic_error("conditional steps: node " + node->spec().name + " of step " + std::to_string(t) +
                             " out of order");
    }
    steps[t].push_back(node);
    last = t;
  }
  run_group(steps[0], false);
  const std::vector<std::string> outputs = output_names(Kind::kBeam);
  const at::Tensor most = env.at("beam_steps").max();  // the batch's most new tokens, on the device
  for (int64_t t = 1; t < max_steps_; ++t) {
    // the outputs as they stand: a body rebinds them to buffers of its own, which a skipped body
    // never writes, so each body ends by copying them back into these
    std::vector<at::Tensor> before;
    for (const auto& name : outputs) before.push_back(env.at(name));
    at::Tensor go = most.gt(t);
    if (stop.defined()) go = go.logical_and(stop.eq(0));  // read when the step is due, not at launch
    if (cond.begin_if(go)) {
      run_group(steps[t], true);
      for (size_t i = 0; i < outputs.size(); ++i) {
        at::Tensor& now = env.at(outputs[i]);
        if (!now.is_same(before[i])) {
          before[i].copy_(now);
          now = before[i];
        }
      }
    }
    cond.end_if();
    step_done();
  }
}

size_t Executor::num_graphs() const {
  size_t n = 0;
  for (const auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->busy);
    n += lane->graphs.size();
  }
  return n;
}

CapturedGraph& Executor::graph_for(Lane& lane, const BatchSpec& batch, double* capture_ms) {
  const std::string key = bucket_key(batch);
  auto it = lane.graphs.find(key);
  if (capture_ms) *capture_ms = 0;
  if (it != lane.graphs.end()) return *it->second;
  const int64_t start = now_ns();
  c10::InferenceMode guard;
  std::vector<const Node*> nodes = plan(batch);
  std::vector<std::string> inputs;
  for (const auto& [name, t] : batch.inputs) inputs.push_back(name);
  // The beam state (the beam_state node) is allocated inside the body: during capture it comes from
  // the lane's pool and is handed back to it afterwards, like every other intermediate buffer.
  const bool family = in_family(batch);
  const size_t first = family ? first_step_size(nodes) : nodes.size();
  const size_t marks = family ? first + static_cast<size_t>(max_steps_ - 1) : nodes.size();
  const at::Tensor stop = family && lane.stop ? lane.stop->device_view() : at::Tensor();
  auto body = [this, &nodes, family, first, &stop](Env& env, const std::function<void(size_t)>& mark,
                                                  ConditionalScope& cond) {
    if (!family) {
      run_nodes(nodes, env, mark, nullptr);
      return;
    }
    size_t marked = first;
    const std::function<void(size_t)> none = [](size_t) {};  // no event inside a conditional body
    run_conditional_steps(
        nodes, env, cond,
        [&](const std::vector<const Node*>& group, bool in_body) { run_nodes(group, env, in_body ? none : mark, nullptr); },
        [&] { mark(marked++); }, stop);
  };
  const std::thread::id thread = std::this_thread::get_id();
  auto graph = std::make_unique<CapturedGraph>(device_env(batch), inputs, output_names(batch.kind), marks,
                                               body, lane.graph_pool, lane.index,
                                               /*warm_up=*/lane.warmed_threads.count(thread) == 0);
  lane.warmed_threads.insert(thread);
  if (capture_ms) *capture_ms = ms_between(start, now_ns());
  return *lane.graphs.emplace(key, std::move(graph)).first->second;
}

double Executor::prepare(const BatchSpec& bucket_example, bool lanes_at_once) {
  if (!use_graphs_) return 0;
  BatchSpec padded;
  const BatchSpec& example = as_run(bucket_example, padded);  // the graph it runs as
  if (!lanes_at_once || lanes_.size() < 2) {
    double total = 0;
    for (auto& lane : lanes_) {
      std::lock_guard<std::mutex> lock(lane->busy);
      double ms = 0;
      graph_for(*lane, example, &ms);
      total += ms;
    }
    return total;
  }
  const int64_t start = now_ns();
  double captured_ms = 0;
  // A worker's first capture on its lane runs the bucket eagerly first (graph_for's warm-up), from
  // the general allocator: one lane at a time there, so two warm-ups never hold memory at once.
  std::vector<Lane*> cold, warm;
  for (auto& lane : lanes_) {
    std::lock_guard<std::mutex> lock(lane->busy);
    (lane->warmed_threads.count(lane->worker.get_id()) ? warm : cold).push_back(lane.get());
  }
  for (Lane* lane : cold) captured_ms += capture_on_workers({lane}, example);
  if (!warm.empty()) captured_ms += capture_on_workers(warm, example);
  return captured_ms > 0 ? ms_between(start, now_ns()) : 0;
}

double Executor::capture_on_workers(const std::vector<Lane*>& lanes, const BatchSpec& example) {
  struct Pending {
    std::mutex mu;
    std::condition_variable done;
    size_t left = 0;
    double captured_ms = 0;  // 0 when every lane had the graph already
    std::string error;
  };
  auto pending = std::make_shared<Pending>();
  pending->left = lanes.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw std::runtime_error("executor is shut down: no captures");
    for (Lane* l : lanes) {
      l->tasks.push_back([this, l, &example, pending] {
        std::string error;
        double ms = 0;
        try {
          std::lock_guard<std::mutex> busy(l->busy);
          graph_for(*l, example, &ms);
        } catch (const std::exception& e) {
          error = "lane " + std::to_string(l->index) + ": " + e.what();
        }
        std::lock_guard<std::mutex> lock(pending->mu);
        pending->captured_ms += ms;
        if (!error.empty() && pending->error.empty()) pending->error = error;
        if (--pending->left == 0) pending->done.notify_all();
      });
    }
  }
  cv_.notify_all();
  std::unique_lock<std::mutex> lock(pending->mu);
  pending->done.wait(lock, [&] { return pending->left == 0; });
  if (!pending->error.empty()) throw std::runtime_error(pending->error);
  return pending->captured_ms;
}

RunOutput Executor::run(const BatchSpec& batch) {
  const int64_t submit_ns = now_ns();
  Lane& lane = *lanes_.front();
  if (!device_.is_cuda()) return run_timed(lane, batch, submit_ns);  // a CPU lane holds nothing to guard
  std::lock_guard<std::mutex> lock(lane.busy);
  return run_timed(lane, batch, submit_ns);
}

void Executor::between_nodes(const BatchSpec& batch, const std::string& next, int64_t& paused_ns) {
  const RunControl* control = batch.control.get();
  if (control == nullptr) return;
  if (control->is_cancelled()) throw RunCancelled("cancelled before node " + next);
  if (!control->heavy || device_.is_cuda()) return;
  std::unique_lock<std::mutex> lock(gate_mu_);
  if (light_running_ == 0) return;
  const int64_t t0 = now_ns();
  // cancel() does not know this condition variable: look at the flag every few ms while paused
  while (!gate_cv_.wait_for(lock, std::chrono::milliseconds(5), [&] { return light_running_ == 0; })) {
    if (control->is_cancelled()) break;
  }
  paused_ns += now_ns() - t0;
  if (control->is_cancelled()) throw RunCancelled("cancelled before node " + next);
}

RunOutput Executor::run_timed(Lane& lane, const BatchSpec& batch, int64_t submit_ns) {
  c10::InferenceMode guard;
  LaneStream stream_scope(device_, lane.index);  // this lane's stream for everything below
  RunOutput out;
  RunTimings& t = out.timings;
  t.submit_ns = submit_ns;
  t.start_ns = now_ns();
  if (batch.control && batch.control->is_cancelled()) throw RunCancelled("cancelled before it started");
  std::vector<const Node*> nodes = plan(batch);
  const bool family = in_family(batch);
  // a family's batch: its inputs padded to the family's new tokens, its outputs cut back to its own
  BatchSpec padded;
  const BatchSpec& run_as = as_run(batch, padded);
  auto own_outputs = [&](std::vector<at::Tensor> outputs) {
    if (family) outputs[0] = outputs[0].slice(2, 0, batch.new_tokens).contiguous();  // held_seqs [R, B, n]
    return outputs;
  };
  if (use_graphs_ && batch.trace_buffers.empty()) {
    CapturedGraph& graph = graph_for(lane, run_as, nullptr);
    // a family's graph reads the lane's stop flag before each decode step: cancel() during the
    // replay sets it, and the steps not yet begun are skipped
    RunControl* stoppable = family && lane.stop && batch.control ? batch.control.get() : nullptr;
    if (family && lane.stop) lane.stop->set(0);
    if (stoppable && !stoppable->bind(lane.stop->host())) throw RunCancelled("cancelled before it started");
    struct Unbind {
      RunControl* control;
      ~Unbind() {
        if (control) control->unbind();
      }
    } unbind{stoppable};
    CapturedGraph::Replay r = graph.replay(run_as.inputs);
    if (stoppable && stoppable->is_cancelled()) throw RunCancelled("cancelled during its decode steps");
    t.graph = true;
    t.h2d_end_ns = r.h2d_end_ns;
    t.launch_ns = r.launch_ns;
    t.d2h_end_ns = r.d2h_end_ns;
    // a timing per mark: every node; a family's first step's nodes, then the decode steps this batch ran
    const size_t first = family ? first_step_size(nodes) : nodes.size();
    std::vector<std::string> names;
    for (size_t k = 0; k < first; ++k) names.push_back(nodes[k]->spec().name);
    for (int64_t step = 1; family && step < batch.new_tokens; ++step) names.push_back("decode step " + std::to_string(step));
    const double host_share = ms_between(t.launch_ns, t.d2h_end_ns) / std::max<size_t>(names.size(), 1);
    for (size_t k = 0; k < names.size(); ++k) t.nodes.push_back({names[k], host_share, r.node_ms[k]});
    out.outputs = own_outputs(std::move(r.outputs));
    t.done_ns = now_ns();
    return out;
  }
  Env env = device_env(run_as);
  t.h2d_end_ns = now_ns();
  t.launch_ns = t.h2d_end_ns;
  std::vector<double> host_ms;
  // Every node this batch runs, in order, with mark(k) after the k-th: its plan's nodes; a family's
  // batch walks its family's steps, each later step run when its condition (read on the host) holds.
  std::vector<const Node*> ran;
  const std::vector<const Node*> walked = family ? plan(run_as) : nodes;  // the most a walk may run
  auto walk = [&](const std::function<void(size_t)>& mark) {
    auto run_group = [&](const std::vector<const Node*>& group, bool) {
      const size_t base = ran.size();
      const std::function<void(size_t)> before = [&](size_t k) {
        between_nodes(batch, group[k]->spec().name, t.paused_ns);
      };
      if (base > 0 && !group.empty()) before(0);  // run_nodes checks ahead of its second node on
      run_nodes(group, env, [&](size_t k) { mark(base + k); }, &host_ms, &batch.trace_buffers, &out.trace, &before);
      ran.insert(ran.end(), group.begin(), group.end());
    };
    if (!family) {
      run_group(nodes, false);
      return;
    }
    struct OnHost final : ConditionalScope {  // eager: a body runs when its condition is true now
      bool begin_if(const at::Tensor& pred) override { return pred.item<bool>(); }
      void end_if() override {}
    } on_host;
    run_conditional_steps(walked, env, on_host, run_group, [] {});
  };
  if (device_.is_cuda()) {  // eager on the GPU: events between nodes give device times
    CudaNodeTimer timer(walked.size());
    timer.start();
    walk([&timer](size_t k) { timer.mark(k); });
    std::vector<double> device_ms = timer.elapsed_ms(ran.size());
    for (size_t k = 0; k < ran.size(); ++k) t.nodes.push_back({ran[k]->spec().name, host_ms[k], device_ms[k]});
  } else {
    // a light run holds heavy ones between their nodes for as long as it runs
    const bool light = !(batch.control && batch.control->heavy);
    if (light) {
      std::lock_guard<std::mutex> lock(gate_mu_);
      ++light_running_;
    }
    struct LightDone {
      Executor* ex;
      bool light;
      ~LightDone() {
        if (!light) return;
        {
          std::lock_guard<std::mutex> lock(ex->gate_mu_);
          --ex->light_running_;
        }
        ex->gate_cv_.notify_all();
      }
    } light_done{this, light};
    walk([](size_t) {});
    for (size_t k = 0; k < ran.size(); ++k) t.nodes.push_back({ran[k]->spec().name, host_ms[k], -1});
  }
  for (const auto& name : output_names(batch.kind)) out.outputs.push_back(env.at(name).to(at::kCPU));
  out.outputs = own_outputs(std::move(out.outputs));
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

void Executor::update_weights(const WeightMap& values) {
  for (const auto& [name, value] : values) {  // every value checked before any is written
    const at::Tensor& w = ctx_.weight(name);
    if (!value.sizes().equals(w.sizes()) || value.scalar_type() != w.scalar_type()) {
      throw std::invalid_argument("update_weights: " + name + " is " + std::string(c10::toString(w.scalar_type())) +
                                  " " + c10::str(w.sizes()) + ", the new value " +
                                  std::string(c10::toString(value.scalar_type())) + " " + c10::str(value.sizes()));
    }
  }
  // On a GPU, no lane runs meanwhile (a lane's run holds `busy` until its outputs are on the host);
  // a CPU run reading the forest while it is written reads only rows that are not constrained
  // (the caller's guarantee), whose masks do not depend on it.
  std::vector<std::unique_lock<std::mutex>> held;
  if (device_.is_cuda()) {
    for (auto& lane : lanes_) held.emplace_back(lane->busy);
  }
  c10::InferenceMode guard;
  for (const auto& [name, value] : values) {
    at::Tensor w = ctx_.weight(name);
    w.copy_(value);  // from the host: returns once the copy is done
  }
}

size_t Executor::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Executor::worker_loop(Lane& lane) {
  at::set_num_threads(num_threads_);  // same intra-op threads as the caller: same reduction order
  for (;;) {
    Job job;
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !lane.tasks.empty(); });
      if (!lane.tasks.empty()) {  // this lane's own work first (prepare waits on it)
        task = std::move(lane.tasks.front());
        lane.tasks.pop_front();
      } else if (queue_.empty()) {
        return;  // stopping and drained
      } else {
        job = std::move(queue_.front());
        queue_.pop_front();
      }
    }
    if (task) {
      task();  // catches its own errors
      continue;
    }
    RunOutput out;
    std::string error;
    try {
      std::lock_guard<std::mutex> busy(lane.busy);
      out = run_timed(lane, job.batch, job.submit_ns);
      out.timings.done_ns = now_ns();
    } catch (const std::exception& e) {
      error = e.what();  // one bad batch fails alone; the lane goes on
    }
    job.callback(error.empty() ? &out : nullptr, error);
  }
}

void Executor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (joined_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->worker.joinable() && lane->worker.get_id() != std::this_thread::get_id()) lane->worker.join();
  }
  std::lock_guard<std::mutex> lock(mu_);
  joined_ = true;
}

}  // namespace slmrank
