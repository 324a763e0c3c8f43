// The DAG executor: runs the artifact's Score / BeamSearch DAG over one batch's static buffers,
// with a timing for every node, synchronously or on its own worker thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_graph.h"
#include "dag.h"

namespace slmrank {

struct NodeTiming {
  std::string name;
  double host_ms = 0;     // host clock around the node's launch (eager) or its share (graph)
  double device_ms = -1;  // device time between the node's events; -1 where there is no device timer
};

// Host timestamps in steady-clock nanoseconds, and per-node timings.
struct RunTimings {
  int64_t submit_ns = 0, start_ns = 0, h2d_end_ns = 0, launch_ns = 0, d2h_end_ns = 0, done_ns = 0;
  bool graph = false;  // replayed from a captured CUDA graph
  std::vector<NodeTiming> nodes;
  int64_t paused_ns = 0;  // inside start..done, a heavy run waiting for light ones (not running)
};

// Host copies of named buffers after one node (step-by-step checks against the Python runtime).
struct TraceEntry {
  std::string node;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
};

struct RunOutput {
  std::vector<at::Tensor> outputs;  // Score: {scores [S, L]}; Beam: {seqs [R, B, n], scores [R, B]} (host)
  RunTimings timings;
  std::vector<TraceEntry> trace;  // only when BatchSpec::trace_buffers is set (runs eagerly)
};

enum class Kind { kScore, kBeam };

// What a caller tells a run while it runs (shared with the run; set from any thread).
// cancelled: the run stops before its next node (or before it starts) with RunCancelled, its
// outputs never made. heavy: run eagerly on the CPU, it waits between its nodes while a light
// run (any run not heavy) is in progress: two runs at once share the cores, and this way the
// light one overlaps at most the one heavy node already running.
// On a GPU, a family's graph (use_conditional_steps) checks its lane's stop flag before each decode
// step: while a run is bound to it, cancel() sets it, and the steps not yet begun are skipped.
struct RunControl {
  std::atomic<bool> cancelled{false};
  bool heavy = false;
  void cancel() {
    cancelled.store(true, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ != nullptr) __atomic_store_n(stop_, 1, __ATOMIC_SEQ_CST);
  }
  bool is_cancelled() const { return cancelled.load(std::memory_order_relaxed); }
  // The running graph's stop flag (mapped host memory), for the length of one replay; false, and
  // nothing bound, when it is cancelled already.
  bool bind(int32_t* stop) {
    std::lock_guard<std::mutex> lock(mu_);
    if (is_cancelled()) return false;
    stop_ = stop;
    return true;
  }
  void unbind() {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = nullptr;
  }

 private:
  std::mutex mu_;
  int32_t* stop_ = nullptr;
};

// Thrown by a run whose RunControl was cancelled.
struct RunCancelled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct BatchSpec {
  Kind kind = Kind::kScore;
  Env inputs;  // host tensors named as service/runtime/batch.py packs them
  int64_t num_requests = 0, beam_width = 0, new_tokens = 1;  // beam only
  std::vector<std::string> trace_buffers;  // copy these to the host after every node (forces eager)
  std::shared_ptr<RunControl> control;  // may be null: never cancelled, light
};

class Executor {
 public:
  using Callback = std::function<void(RunOutput* output, const std::string& error)>;

  // On a CUDA device with use_graphs, each bucket runs as one captured CUDA graph (captured on
  // first use, or ahead of time by prepare()); otherwise node by node ("eager").
  // num_lanes: batches that may be in flight at once, each lane with its own worker thread,
  // stream, graphs and memory pool (0 = 2 on a GPU, 1 on the CPU).
  Executor(ModelConfig cfg, WeightMap weights, at::Tensor rope_cos, at::Tensor rope_sin,
           const std::vector<NodeSpec>& score_dag, const std::vector<NodeSpec>& beam_dag, bool use_graphs,
           int num_lanes = 0);
  ~Executor();
  // Runs the decoder layers with the AOT-compiled Triton kernels of `dir` (kernels/aot.py) instead
  // of the ATen ops they replace. CUDA only; before the first batch (no graph captured yet).
  void use_triton_kernels(const std::string& dir);
  bool uses_triton_kernels() const { return ctx_.fused != nullptr; }
  // BeamSearch batches run in their family's buffers: the buckets that differ only in new tokens
  // share them, sized for the DAG's most steps (beam_seqs padded to it; the outputs cut back to the
  // batch's own), and on a GPU one graph per family whose decode steps are conditional (CUDA IF
  // nodes: step t runs when some request of the batch has more than t new tokens), in place of a
  // graph per bucket with its steps unrolled. A family's graph is timed per node up to the first
  // decode step and per decode step after it ("decode step t"): no event may be recorded inside a
  // conditional body. Before the first batch (no graph captured yet).
  void use_conditional_steps();
  bool uses_conditional_steps() const { return conditional_steps_; }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Blocking: runs on the calling thread, in lane 0 (waits while that lane is busy). On the CPU
  // (no graphs, no streams: nothing of a lane's to guard) concurrent calls run at once, each on
  // its caller's thread and that thread's intra-op threads (their CPU priority is the caller's).
  RunOutput run(const BatchSpec& batch);
  // Asynchronous: queued to the worker thread; callback(output, "") or callback(nullptr, error).
  // Throws std::runtime_error after shutdown().
  void submit(BatchSpec batch, Callback callback);
  // Stops taking work, finishes (or fails) every queued batch, joins the worker. Idempotent.
  void shutdown();
  size_t pending() const;
  // Captures the graph of this batch's bucket in every lane now (start-up), so no request pays
  // for it. Returns the captures' wall time in ms; 0 when graphs are off or already captured.
  // lanes_at_once: each lane captures on its own worker thread, all lanes at once (a capture is
  // mostly host work: recording the launches and instantiating the graph; each lane has its own
  // stream and pool, and torch routes each capture's allocations to its pool by capture id);
  // otherwise the calling thread captures lane after lane.
  double prepare(const BatchSpec& example, bool lanes_at_once = false);
  bool uses_graphs() const { return use_graphs_; }
  size_t num_graphs() const;
  int num_lanes() const { return static_cast<int>(lanes_.size()); }

  const ModelConfig& config() const { return ctx_.cfg; }
  // Overwrites weights in place, each value of its weight's shape and dtype (std::invalid_argument
  // otherwise, before anything is written): graphs captured over them see the new values. The
  // caller guarantees that no run reads them meanwhile (Scheduler.replace_catalog: no batch with a
  // constrained request is in flight); returns once the copies are done on the device.
  void update_weights(const WeightMap& values);
  // A weight as the nodes read it (tests).
  at::Tensor weight(const std::string& name) const { return ctx_.weight(name); }
  std::vector<std::string> node_names(Kind kind) const;

 private:
  struct Job {
    BatchSpec batch;
    Callback callback;
    int64_t submit_ns;
  };
  // One batch at a time per lane: its own worker, stream, graphs and pool.
  struct Lane {
    int index = 0;
    std::mutex busy;  // held for a whole run
    std::pair<uint64_t, uint64_t> graph_pool{0, 0};
    std::unordered_map<std::string, std::unique_ptr<CapturedGraph>> graphs;
    // Host threads that have captured on this lane: cuBLAS handles and workspaces are per thread
    // and stream, so a thread's first capture on the lane runs a warm-up pass first.
    std::set<std::thread::id> warmed_threads;
    std::thread worker;
    // Work for this lane's worker alone, taken before any batch (prepare's captures); under mu_.
    std::deque<std::function<void()>> tasks;
    // use_conditional_steps on a GPU: read by a family's graph before each decode step (0: go on)
    std::unique_ptr<HostFlag> stop;
  };
  RunOutput run_timed(Lane& lane, const BatchSpec& batch, int64_t submit_ns);
  Env device_env(const BatchSpec& batch) const;              // the inputs, on the device
  std::vector<const Node*> plan(const BatchSpec& batch) const;
  // Runs nodes in order; mark(k) after node k; appends host times when host_ms is given; before(k)
  // ahead of node k > 0 when given (in no node's time).
  void run_nodes(const std::vector<const Node*>& nodes, Env& env, const std::function<void(size_t)>& mark,
                 std::vector<double>* host_ms, const std::vector<std::string>* trace_buffers = nullptr,
                 std::vector<TraceEntry>* trace = nullptr, const std::function<void(size_t)>* before = nullptr) const;
  // Between two nodes of an eager run: RunCancelled if its control says so; a heavy run on the CPU
  // waits while a light one runs (the wait added to paused_ns).
  void between_nodes(const BatchSpec& batch, const std::string& next, int64_t& paused_ns);
  CapturedGraph& graph_for(Lane& lane, const BatchSpec& batch, double* capture_ms);  // lane.busy held
  // use_conditional_steps: whether the batch runs in its family's buffers, and the batch as its
  // family's graph takes it (beam_seqs padded to max_steps_ new tokens)
  bool in_family(const BatchSpec& batch) const { return conditional_steps_ && batch.kind == Kind::kBeam; }
  BatchSpec family_of(const BatchSpec& batch) const;
  // The batch as its graph and walk take it: itself, or in a family its padded copy (made in `padded`).
  const BatchSpec& as_run(const BatchSpec& batch, BatchSpec& padded) const;
  // A family's nodes, step by step: run_group(the first step's nodes, false), then each later step t
  // inside cond's body for "the batch has a request of more than t new tokens" (run_group(its nodes,
  // true) when cond says to run them now), the batch's outputs written back in place at the body's
  // end (a skipped body leaves them whole), and step_done() after each.
  // stop (may be undefined): a 0-dim int32 on the device; a step runs only while it reads 0.
  using GroupRunner = std::function<void(const std::vector<const Node*>& group, bool in_body)>;
  void run_conditional_steps(const std::vector<const Node*>& nodes, Env& env, ConditionalScope& cond,
                             const GroupRunner& run_group, const std::function<void()>& step_done,
                             const at::Tensor& stop = at::Tensor()) const;
  // graph_for on each lane's own worker thread, the lanes at once; waits for all of them. Returns
  // the lanes' capture ms summed (0: every lane had it); the first lane's error, if any, thrown.
  double capture_on_workers(const std::vector<Lane*>& lanes, const BatchSpec& example);
  void worker_loop(Lane& lane);

  Context ctx_;
  at::Device device_;
  std::vector<std::unique_ptr<Node>> score_dag_, beam_dag_;
  int num_threads_;
  bool use_graphs_;
  bool conditional_steps_ = false;
  int64_t max_steps_ = 1;  // the beam DAG's decode steps + 1: the most new tokens it runs
  std::vector<std::unique_ptr<Lane>> lanes_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  bool joined_ = false;

  // light runs in progress on the CPU, which heavy ones pause for between nodes
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  int light_running_ = 0;
};

int64_t now_ns();

}  // namespace slmrank
