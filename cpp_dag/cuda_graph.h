// One captured CUDA graph per shape bucket, with an event after every node so that a replay
// yields each node's GPU time. Compiled in every build; without CUDA, is_available() is false
// and constructing one throws.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dag.h"

namespace slmrank {

bool cuda_graphs_available();

// Makes lane `lane`'s own CUDA stream current on `device` for the scope (no-op on the CPU), so
// that lanes run concurrently and never on the legacy default stream.
class LaneStream {
 public:
  LaneStream(const at::Device& device, int lane);
  ~LaneStream();
  LaneStream(const LaneStream&) = delete;
  LaneStream& operator=(const LaneStream&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Device-side event timer for eager runs: mark(k) after node k, then elapsed_ms() per node.
class CudaNodeTimer {
 public:
  explicit CudaNodeTimer(size_t max_marks);
  ~CudaNodeTimer();
  void start();
  void mark(size_t k);
  std::vector<double> elapsed_ms(size_t num_marks);  // synchronizes on the last mark

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A conditional body: what runs between begin_if(pred) and end_if() runs only when pred (a 0-dim
// bool tensor on the device, computed before it) is true. begin_if says whether to run the body's
// host code now. In a capture it always does: the body is captured into a CUDA IF node (CUDA >=
// 12.4) on a side stream (the current stream until end_if), which holds kernels, memsets and
// copies only (no event may be recorded inside it) and runs at replay when pred is. Run eagerly,
// pred is read on the host (the eager warm-up before a capture runs every body).
class ConditionalScope {
 public:
  virtual ~ConditionalScope() = default;
  virtual bool begin_if(const at::Tensor& pred) = 0;
  virtual void end_if() = 0;
};

class CapturedGraph {
 public:
  // Runs the nodes of one bucket, calling mark(k) after the k-th timed point (k = 0..num_nodes-1:
  // after each node, or after each conditional body as a whole); cond opens conditional bodies.
  using Body = std::function<void(Env& env, const std::function<void(size_t)>& mark, ConditionalScope& cond)>;

  // static_env: the bucket's input buffers on the device, allocated before capture (outside the pool).
  // With warm_up, runs body once eagerly first (initialises cuBLAS handles and workspaces for the
  // lane's stream and this host thread; needed by each thread's first capture on a lane only). Then captures body into a graph drawing
  // on `pool_id` (graphs that never run concurrently share one pool), on lane `lane`'s stream,
  // which also runs its replays. After capture only the inputs and outputs stay referenced: every
  // intermediate buffer goes back to the pool, for the next capture of the lane to reuse (the
  // outputs are copied out right after each replay, before the lane replays anything else).
  // Throws on any failure, the capture ended cleanly.
  CapturedGraph(Env static_env, std::vector<std::string> input_names, std::vector<std::string> output_names,
                size_t num_nodes, const Body& body, std::pair<uint64_t, uint64_t> pool_id, int lane,
                bool warm_up = true);
  ~CapturedGraph();

  struct Replay {
    std::vector<at::Tensor> outputs;  // on the host, owned by the caller
    std::vector<double> node_ms;
    int64_t h2d_end_ns = 0, launch_ns = 0, d2h_end_ns = 0;
  };
  // Copies host inputs (same shapes as at capture) in through pinned buffers, replays, copies outputs out.
  Replay replay(const Env& host_inputs);
  size_t num_nodes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A 4-byte flag in mapped pinned host memory: the host writes it at any time, and kernels read it
// over the bus when they run, a captured graph's as well (device_view: a 0-dim int32 tensor on the
// device over the same memory, whose address a capture keeps). GPU only.
class HostFlag {
 public:
  explicit HostFlag(const at::Device& device);
  ~HostFlag();
  HostFlag(const HostFlag&) = delete;
  HostFlag& operator=(const HostFlag&) = delete;
  void set(int32_t value);
  int32_t* host() const;
  const at::Tensor& device_view() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A fresh memory-pool id for graphs (at::cuda::graph_pool_handle()).
std::pair<uint64_t, uint64_t> new_graph_pool();

}  // namespace slmrank
