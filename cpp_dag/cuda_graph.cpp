#include "cuda_graph.h"

#include <stdexcept>

#if SLMRANK_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>
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

// One stream per (device, lane, role), made once: a lane's graphs and eager runs all use its main
// stream (role 0); its graphs' conditional bodies are captured on its body stream (role 1).
c10::cuda::CUDAStream lane_stream(const at::Device& device, int lane, int role = 0) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(static_cast<int>(device.index()), lane, role);
  auto it = streams.find(key);
  if (it == streams.end()) {
    it = streams.emplace(key, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())).first;
  }
  return it->second;
}

// A stream's active capture's id (0: not capturing).
unsigned long long capture_id(cudaStream_t stream) {
  cudaStreamCaptureStatus status{};
  unsigned long long id = 0;
  check_cuda(cudaStreamGetCaptureInfo(stream, &status, &id), "cudaStreamGetCaptureInfo");
  return status == cudaStreamCaptureStatusActive ? id : 0;
}

// The allocations of the stream capture `id` come from `pool` (torch's caching allocator).
void allocate_to_pool(const at::Device& device, std::pair<uint64_t, uint64_t> pool, unsigned long long id) {
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(
      device.index(), {pool.first, pool.second}, [id](cudaStream_t stream) { return capture_id(stream) == id; });
}

// Conditional bodies of the graph being captured on a lane's main stream: each an IF node added
// after what the main stream captured so far, its body captured on the lane's own body stream (one
// stream, not torch's pool of them: cuBLAS keeps a workspace per stream, and the caching allocator a
// free list, so a body stream a capture would each take another of both). The body's allocations
// come from the lane's pool, as the rest of the graph's.
class LaneConditional final : public ConditionalScope {
 public:
  LaneConditional(const at::Device& device, int lane, std::pair<uint64_t, uint64_t> pool, cudaStreamCaptureMode mode)
      : device_(device), main_(lane_stream(device, lane)), body_(lane_stream(device, lane, 1)), pool_(pool),
        mode_(mode) {}

  bool begin_if(const at::Tensor& pred) override {
    if (open_) throw std::logic_error("conditional bodies do not nest here");
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
    cudaStream_t main = main_.stream();
    cudaStreamCaptureStatus status{};
    cudaGraph_t graph = nullptr;
    check_cuda(cudaStreamGetCaptureInfo(main, &status, &main_id_, &graph), "cudaStreamGetCaptureInfo");
    if (status != cudaStreamCaptureStatusActive) throw std::logic_error("begin_if outside a capture");
    cudaGraphConditionalHandle handle{};
    check_cuda(cudaGraphConditionalHandleCreate(&handle, graph, 0, 0), "cudaGraphConditionalHandleCreate");
    at::cuda::CUDAGraph::set_conditional_handle(handle, pred);  // a kernel on the main stream: pred -> handle
    const cudaGraphNode_t* deps = nullptr;
    const cudaGraphEdgeData* edges = nullptr;
    size_t num_deps = 0;
    check_cuda(cudaStreamGetCaptureInfo(main, &status, nullptr, nullptr, &deps, &edges, &num_deps),
               "cudaStreamGetCaptureInfo");
    cudaGraphNodeParams params{};
    params.type = cudaGraphNodeTypeConditional;
    params.conditional.handle = handle;
    params.conditional.type = cudaGraphCondTypeIf;
    params.conditional.size = 1;
    cudaGraphNode_t node = nullptr;
    check_cuda(cudaGraphAddNode(&node, graph, deps, edges, num_deps, &params), "cudaGraphAddNode (IF)");
    check_cuda(cudaStreamUpdateCaptureDependencies(main, &node, nullptr, 1, cudaStreamSetCaptureDependencies),
               "cudaStreamUpdateCaptureDependencies");
    check_cuda(cudaStreamBeginCaptureToGraph(body_.stream(), params.conditional.phGraph_out[0], nullptr, nullptr, 0,
                                             mode_),
               "cudaStreamBeginCaptureToGraph");
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device_.index(), {pool_.first, pool_.second});
    allocate_to_pool(device_, pool_, capture_id(body_.stream()));
    guard_.emplace(body_);  // the body's launches go to the body stream
    open_ = true;
    return true;
#else
    (void)pred;
    throw std::runtime_error("conditional graph nodes: this extension was built with CUDA < 13");
#endif
  }

  void end_if() override {
    if (!open_) throw std::logic_error("end_if without begin_if");
    guard_.reset();
    open_ = false;
    check_cuda(cudaStreamEndCapture(body_.stream(), nullptr), "cudaStreamEndCapture (IF body)");
    c10::cuda::CUDACachingAllocator::endAllocateToPool(device_.index(), {pool_.first, pool_.second});
    allocate_to_pool(device_, pool_, main_id_);  // the main stream's allocations again
  }

  bool open() const { return open_; }

 private:
  at::Device device_;
  c10::cuda::CUDAStream main_, body_;
  std::pair<uint64_t, uint64_t> pool_;
  cudaStreamCaptureMode mode_;
  unsigned long long main_id_ = 0;
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
  bool open_ = false;
};

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

  if (warm_up) {  // on the capture's streams: initialises cuBLAS handles and workspaces outside the graph
    // every conditional body runs, on the lane's body stream as in the capture (its cuBLAS workspace
    // made here, not inside the graph), ordered after and before the main stream by events
    struct Eager final : ConditionalScope {
      Eager(c10::cuda::CUDAStream main, c10::cuda::CUDAStream body) : main(main), body(body) {
        check_cuda(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "cudaEventCreate");
        check_cuda(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "cudaEventCreate");
      }
      ~Eager() override {
        cudaEventDestroy(fork);
        cudaEventDestroy(join);
      }
      bool begin_if(const at::Tensor&) override {
        check_cuda(cudaEventRecord(fork, main.stream()), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(body.stream(), fork, 0), "cudaStreamWaitEvent");
        guard.emplace(body);
        return true;
      }
      void end_if() override {
        guard.reset();
        check_cuda(cudaEventRecord(join, body.stream()), "cudaEventRecord");
        check_cuda(cudaStreamWaitEvent(main.stream(), join, 0), "cudaStreamWaitEvent");
      }
      c10::cuda::CUDAStream main, body;
      cudaEvent_t fork = nullptr, join = nullptr;
      std::optional<c10::cuda::CUDAStreamGuard> guard;
    } eager(*g.stream, lane_stream(device, lane, 1));
    Env warm = static_env;
    body(warm, [](size_t) {}, eager);
    check_cuda(cudaStreamSynchronize(g.stream->stream()), "warm-up");
  }
  LaneConditional conditional(device, lane, pool_id, cudaStreamCaptureModeThreadLocal);

  g.env = std::move(static_env);
  auto record = [&g](size_t k) {
    check_cuda(cudaEventRecordWithFlags(g.events.at(k), g.stream->stream(), cudaEventRecordExternal),
               "cudaEventRecordWithFlags");
  };
  g.graph.capture_begin({pool_id.first, pool_id.second}, cudaStreamCaptureModeThreadLocal);
  try {
    record(0);
    body(g.env, [&record](size_t k) { record(k + 1); }, conditional);
    if (conditional.open()) throw std::logic_error("a conditional body was left open");
  } catch (...) {
    try {
      if (conditional.open()) conditional.end_if();
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
