#include "cuda_graph.h"

#include <stdexcept>

#if SLMRANK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <map>
#include <mutex>
#include <optional>
#endif

namespace slmrank {

int64_t now_ns();  // executor.cpp

#if SLMRANK_WITH_CUDA

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

std::vector<cudaEvent_t> make_events(size_t n) {
  std::vector<cudaEvent_t> events(n);
  for (auto& ev : events) check_cuda(cudaEventCreate(&ev), "cudaEventCreate");
  return events;
}

void destroy_events(std::vector<cudaEvent_t>& events) {
  for (auto ev : events) cudaEventDestroy(ev);
  events.clear();
}

std::vector<double> elapsed_between(const std::vector<cudaEvent_t>& events, size_t num_marks) {
  check_cuda(cudaEventSynchronize(events[num_marks]), "cudaEventSynchronize");
  std::vector<double> ms(num_marks);
  for (size_t k = 0; k < num_marks; ++k) {
    float v = 0;
    check_cuda(cudaEventElapsedTime(&v, events[k], events[k + 1]), "cudaEventElapsedTime");
    ms[k] = v;
  }
  return ms;
}

// One stream per (device, lane), made once: a lane's graphs and eager runs all use it.
c10::cuda::CUDAStream lane_stream(const at::Device& device, int lane) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(static_cast<int>(device.index()), lane);
  auto it = streams.find(key);
  if (it == streams.end()) {
    it = streams.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())).first;
  }
  return it->second;
}

}  // namespace

bool cuda_graphs_available() { return true; }

struct LaneStream::Impl {
  std::optional<c10::cuda::CUDAGuard> device_guard;
  std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
};

LaneStream::LaneStream(const at::Device& device, int lane) : impl_(new Impl) {
  if (!device.is_cuda()) return;
  impl_->device_guard.emplace(device);
  impl_->stream_guard.emplace(lane_stream(device, lane));
}

LaneStream::~LaneStream() = default;

std::pair<uint64_t, uint64_t> new_graph_pool() {
  auto id = at::cuda::graph_pool_handle();
  return {id.first, id.second};
}

struct CudaNodeTimer::Impl {
  std::vector<cudaEvent_t> events;  // events[0] = start, events[k+1] = after node k
};

CudaNodeTimer::CudaNodeTimer(size_t max_marks) : impl_(new Impl) { impl_->events = make_events(max_marks + 1); }
CudaNodeTimer::~CudaNodeTimer() { destroy_events(impl_->events); }
void CudaNodeTimer::start() {
  check_cuda(cudaEventRecord(impl_->events[0], at::cuda::getCurrentCUDAStream()), "cudaEventRecord");
}
void CudaNodeTimer::mark(size_t k) {
  check_cuda(cudaEventRecord(impl_->events.at(k + 1), at::cuda::getCurrentCUDAStream()), "cudaEventRecord");
}
std::vector<double> CudaNodeTimer::elapsed_ms(size_t num_marks) { return elapsed_between(impl_->events, num_marks); }

struct CapturedGraph::Impl {
  Env env;  // static buffers; after capture also every buffer the graph wrote last (outputs)
  std::vector<std::string> input_names, output_names;
  std::vector<at::Tensor> pinned_in, pinned_out;
  at::cuda::CUDAGraph graph;
  std::optional<c10::cuda::CUDAStream> stream;
  std::vector<cudaEvent_t> events;
  size_t num_nodes = 0;
};

CapturedGraph::CapturedGraph(Env static_env, std::vector<std::string> input_names,
                             std::vector<std::string> output_names, size_t num_nodes, const Body& body,
                             std::pair<uint64_t, uint64_t> pool_id, int lane, bool warm_up)
    : impl_(new Impl) {
  Impl& g = *impl_;
  g.input_names = std::move(input_names);
  g.output_names = std::move(output_names);
  g.num_nodes = num_nodes;
  g.events = make_events(num_nodes + 1);
  const at::Device device = static_env.begin()->second.device();
  c10::cuda::CUDAGuard device_guard(device);
  g.stream = lane_stream(device, lane);
  c10::cuda::CUDAStreamGuard stream_guard(*g.stream);

  if (warm_up) {  // on the capture stream: initialises cuBLAS handles and workspaces outside the graph
    struct Eager final : ConditionalScope {  // every conditional body runs
      bool begin_if(const at::Tensor&) override { return true; }
      void end_if() override {}
    } eager;
    Env warm = static_env;
    body(warm, [](size_t) {}, eager);
    check_cuda(cudaStreamSynchronize(g.stream->stream()), "warm-up");
  }
  struct Captured final : ConditionalScope {  // IF nodes of the graph being captured
    explicit Captured(at::cuda::CUDAGraph& graph) : graph(graph) {}
    bool begin_if(const at::Tensor& pred) override {
      if (open) throw std::logic_error("conditional bodies do not nest here");
      graph.begin_capture_to_if_node(pred);
      open = true;
      return true;
    }
    void end_if() override {
      if (!open) throw std::logic_error("end_if without begin_if");
      graph.end_capture_to_conditional_node();
      open = false;
    }
    at::cuda::CUDAGraph& graph;
    bool open = false;
  } conditional(g.graph);

  g.env = std::move(static_env);
  auto record = [&g](size_t k) {
    check_cuda(cudaEventRecordWithFlags(g.events.at(k), g.stream->stream(), cudaEventRecordExternal),
               "cudaEventRecordWithFlags");
  };
  g.graph.capture_begin({pool_id.first, pool_id.second}, cudaStreamCaptureModeThreadLocal);
  try {
    record(0);
    body(g.env, [&record](size_t k) { record(k + 1); }, conditional);
    if (conditional.open) throw std::logic_error("a conditional body was left open");
  } catch (...) {
    try {
      if (conditional.open) g.graph.end_capture_to_conditional_node();
    } catch (...) {
    }
    try {
      g.graph.capture_end();
    } catch (...) {
    }
    throw;
  }
  g.graph.capture_end();
  {  // keep the inputs and outputs only
    Env kept;
    for (const auto& names : {&g.input_names, &g.output_names}) {
      for (const auto& name : *names) kept[name] = g.env.at(name);
    }
    g.env = std::move(kept);
  }

  for (const auto& name : g.input_names) {
    const at::Tensor& t = g.env.at(name);
    g.pinned_in.push_back(at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true)));
  }
  for (const auto& name : g.output_names) {
    const at::Tensor& t = g.env.at(name);
    g.pinned_out.push_back(at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true)));
  }
}

CapturedGraph::~CapturedGraph() { destroy_events(impl_->events); }

struct HostFlag::Impl {
  int32_t* host = nullptr;
  at::Tensor device_view;
};

HostFlag::HostFlag(const at::Device& device) : impl_(new Impl) {
  c10::cuda::CUDAGuard guard(device);
  void* host = nullptr;
  check_cuda(cudaHostAlloc(&host, sizeof(int32_t), cudaHostAllocMapped), "cudaHostAlloc (mapped flag)");
  impl_->host = static_cast<int32_t*>(host);
  *impl_->host = 0;
  void* on_device = nullptr;
  check_cuda(cudaHostGetDevicePointer(&on_device, host, 0), "cudaHostGetDevicePointer");
  impl_->device_view = at::from_blob(on_device, {}, at::TensorOptions().dtype(at::kInt).device(device));
}

HostFlag::~HostFlag() {
  impl_->device_view = at::Tensor();
  if (impl_->host) cudaFreeHost(impl_->host);
}

void HostFlag::set(int32_t value) { __atomic_store_n(impl_->host, value, __ATOMIC_SEQ_CST); }
int32_t* HostFlag::host() const { return impl_->host; }
const at::Tensor& HostFlag::device_view() const { return impl_->device_view; }

size_t CapturedGraph::num_nodes() const { return impl_->num_nodes; }

CapturedGraph::Replay CapturedGraph::replay(const Env& host_inputs) {
  Impl& g = *impl_;
  Replay r;
  c10::cuda::CUDAGuard device_guard(g.env.begin()->second.device());
  c10::cuda::CUDAStreamGuard stream_guard(*g.stream);
  // Inputs must not be re-bound: the graph reads the static tensors' memory.
  for (size_t i = 0; i < g.input_names.size(); ++i) {
    const at::Tensor& src = host_inputs.at(g.input_names[i]);
    if (src.sizes() != g.pinned_in[i].sizes()) {
      throw std::invalid_argument("input " + g.input_names[i] + " does not have its bucket's shape");
    }
    g.pinned_in[i].copy_(src);
    g.env.at(g.input_names[i]).copy_(g.pinned_in[i], /*non_blocking=*/true);
  }
  r.h2d_end_ns = now_ns();  // enqueued; the copies run ahead of the graph on the same stream
  g.graph.replay();
  r.launch_ns = now_ns();
  for (size_t i = 0; i < g.output_names.size(); ++i) {
    g.pinned_out[i].copy_(g.env.at(g.output_names[i]), /*non_blocking=*/true);
  }
  check_cuda(cudaStreamSynchronize(g.stream->stream()), "replay");
  r.d2h_end_ns = now_ns();
  for (auto& t : g.pinned_out) r.outputs.push_back(t.clone());  // the pinned buffers are reused
  r.node_ms = elapsed_between(g.events, g.num_nodes);
  return r;
}

#else  // no CUDA in this build

bool cuda_graphs_available() { return false; }
struct LaneStream::Impl {};
LaneStream::LaneStream(const at::Device& device, int) {
  if (device.is_cuda()) throw std::runtime_error("built without CUDA");
}
LaneStream::~LaneStream() = default;
std::pair<uint64_t, uint64_t> new_graph_pool() { throw std::runtime_error("built without CUDA"); }
struct CudaNodeTimer::Impl {};
CudaNodeTimer::CudaNodeTimer(size_t) { throw std::runtime_error("built without CUDA"); }
CudaNodeTimer::~CudaNodeTimer() = default;
void CudaNodeTimer::start() {}
void CudaNodeTimer::mark(size_t) {}
std::vector<double> CudaNodeTimer::elapsed_ms(size_t) { return {}; }
struct CapturedGraph::Impl {};
CapturedGraph::CapturedGraph(Env, std::vector<std::string>, std::vector<std::string>, size_t, const Body&,
                             std::pair<uint64_t, uint64_t>, int, bool) {
  throw std::runtime_error("CUDA graphs: this extension was built without CUDA");
}
CapturedGraph::~CapturedGraph() = default;
CapturedGraph::Replay CapturedGraph::replay(const Env&) { throw std::runtime_error("built without CUDA"); }
struct HostFlag::Impl {
  at::Tensor none;
};
HostFlag::HostFlag(const at::Device&) { throw std::runtime_error("HostFlag: this extension was built without CUDA"); }
HostFlag::~HostFlag() = default;
void HostFlag::set(int32_t) {}
int32_t* HostFlag::host() const { return nullptr; }
const at::Tensor& HostFlag::device_view() const { return impl_->none; }
size_t CapturedGraph::num_nodes() const { return 0; }

#endif

}  // namespace slmrank
