// The only translation unit that includes pybind11 / torch/extension.h (the slow headers).
// Everything else in cpp_dag/ is plain C++ over ATen and knows nothing of Python.
#include <torch/extension.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "artifact_loader.h"
#include "attention_merge.h"
#include "beam_wire.h"
#include "executor.h"
#include "msgpack_reader.h"
#include "safetensors_reader.h"
#include "sha256.h"
#include "triton_kernels.h"

namespace py = pybind11;

namespace {

std::tuple<at::Tensor, at::Tensor> merge_attention_states_py(const at::Tensor& out_a,
                                                             const at::Tensor& lse_a,
                                                             const at::Tensor& out_b,
                                                             const at::Tensor& lse_b) {
  at::Tensor lse;
  at::Tensor out = slmrank::merge_attention_states(out_a, lse_a, out_b, lse_b, &lse);
  return {std::move(out), std::move(lse)};
}

constexpr const char* cxx_standard() {
  return __cplusplus >= 202002L ? "c++20" : __cplusplus >= 201703L ? "c++17" : "older";
}

py::dict build_info() {
  py::dict info;
  info["torch_version"] = SLMRANK_TORCH_VERSION;
  info["with_cuda"] = static_cast<bool>(SLMRANK_WITH_CUDA);
  info["cxx_standard"] = cxx_standard();
  info["cxx11_abi"] = static_cast<bool>(_GLIBCXX_USE_CXX11_ABI);
  return info;
}

// ---- the executor: Python dicts in, C++ structs out -------------------------------------

// A batch's timings as a plain tuple, in RunTimings' field order: (submit_ns, start_ns, h2d_end_ns,
// launch_ns, d2h_end_ns, done_ns, graph, ((name, host_ms, device_ms), ...), paused_ns). The one Python type
// both runtimes return, service.runtime.timings.BatchTimings, is made of it by BatchTimings.from_executor
// (cpp_dag sits below service and cannot construct it here).
py::tuple timings_tuple(const slmrank::RunTimings& t) {
  py::tuple nodes(t.nodes.size());
  for (size_t i = 0; i < t.nodes.size(); ++i) {
    const auto& n = t.nodes[i];
    nodes[i] = py::make_tuple(n.name, n.host_ms, n.device_ms);
  }
  return py::make_tuple(t.submit_ns, t.start_ns, t.h2d_end_ns, t.launch_ns, t.d2h_end_ns, t.done_ns, t.graph,
                        std::move(nodes), t.paused_ns);
}

py::tuple output_to_tuple(const slmrank::RunOutput& out) {
  py::list outputs;
  for (const auto& o : out.outputs) outputs.append(o);
  return py::make_tuple(outputs, timings_tuple(out.timings));
}

// The buffers copied after every node of a traced run: [(node, {buffer: tensor})].
py::list trace_to_list(const slmrank::RunOutput& out) {
  py::list trace;
  for (const auto& entry : out.trace) {
    py::dict buffers;
    for (const auto& [name, t] : entry.buffers) buffers[py::str(name)] = t;
    trace.append(py::make_tuple(entry.node, buffers));
  }
  return trace;
}

slmrank::BatchSpec batch_from(const std::string& kind, std::unordered_map<std::string, at::Tensor> inputs,
                              int64_t num_requests, int64_t beam_width, int64_t new_tokens,
                              std::vector<std::string> trace_buffers = {},
                              std::shared_ptr<slmrank::RunControl> control = nullptr) {
  slmrank::BatchSpec b;
  if (kind == "score") {
    b.kind = slmrank::Kind::kScore;
  } else if (kind == "beam") {
    b.kind = slmrank::Kind::kBeam;
  } else {
    throw std::invalid_argument("kind must be 'score' or 'beam', got '" + kind + "'");
  }
  b.inputs = std::move(inputs);
  b.num_requests = num_requests;
  b.beam_width = beam_width;
  b.new_tokens = new_tokens;
  b.trace_buffers = std::move(trace_buffers);
  b.control = std::move(control);
  return b;
}

// A Python callable that may be called and destroyed from the worker thread: both take the GIL.
struct PyCallback {
  explicit PyCallback(py::function f) : fn(new py::function(std::move(f))) {}
  PyCallback(const PyCallback&) = default;
  std::shared_ptr<py::function> fn;
  ~PyCallback() {
    if (fn.use_count() == 1) {
      py::gil_scoped_acquire gil;
      fn.reset();
    }
  }
  void operator()(slmrank::RunOutput* out, const std::string& error) const {
    py::gil_scoped_acquire gil;
    try {
      if (out) {
        (*fn)(output_to_tuple(*out), py::none());
      } else {
        (*fn)(py::none(), error);
      }
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("slmrank executor callback");
    }
  }
};

// ---- the artifact, read in C++ (from_artifact; read_msgpack / read_safetensors for tests) --

py::object to_python(const slmrank::Value& v) {
  using T = slmrank::Value::Type;
  switch (v.type()) {
    case T::kNil: return py::none();
    case T::kBool: return py::bool_(v.as_bool());
    case T::kInt: return py::int_(v.raw_int());
    case T::kUint: return py::int_(v.raw_uint());
    case T::kFloat32:
    case T::kFloat64: return py::float_(v.as_double());
    case T::kStr: return py::str(v.as_str());
    case T::kBin: return py::bytes(v.as_bin());
    case T::kArray: {
      py::list out;
      for (const auto& item : v.as_array()) out.append(to_python(item));
      return std::move(out);
    }
    case T::kMap: {
      py::dict out;
      for (const auto& [key, item] : v.as_map()) out[py::str(key)] = to_python(item);
      return std::move(out);
    }
  }
  return py::none();
}

std::optional<at::ScalarType> dtype_arg(const std::optional<std::string>& name) {
  return name ? std::optional<at::ScalarType>(slmrank::dtype_from_name(*name)) : std::nullopt;
}

// What load_artifact produced, as plain Python data (tests compare it with the Python loader's).
py::dict loaded_to_dict(slmrank::LoadedArtifact& a) {
  auto nodes = [](const std::vector<slmrank::NodeSpec>& specs) {
    py::list out;
    for (const auto& s : specs) {
      out.append(py::dict(py::arg("name") = s.name, py::arg("type") = s.type, py::arg("inputs") = s.inputs,
                          py::arg("outputs") = s.outputs, py::arg("layer") = s.layer, py::arg("step") = s.step,
                          py::arg("mode") = s.mode, py::arg("weight") = s.weight));
    }
    return out;
  };
  const slmrank::ModelConfig& c = a.cfg;
  py::dict config(py::arg("vocab_size") = c.vocab_size, py::arg("hidden_size") = c.hidden_size,
                  py::arg("num_layers") = c.num_layers, py::arg("num_heads") = c.num_heads,
                  py::arg("num_kv_heads") = c.num_kv_heads, py::arg("head_dim") = c.head_dim,
                  py::arg("intermediate_size") = c.intermediate_size, py::arg("num_labels") = c.num_labels,
                  py::arg("rms_norm_eps") = c.rms_norm_eps, py::arg("qk_norm") = c.qk_norm);
  py::dict weights;
  for (auto& [name, t] : a.weights) weights[py::str(name)] = t;
  return py::dict(py::arg("config") = config, py::arg("weights") = weights, py::arg("num_positions") = a.num_positions,
                  py::arg("rope_cos") = a.rope_cos, py::arg("rope_sin") = a.rope_sin,
                  py::arg("score_dag") = nodes(a.score_dag), py::arg("beam_dag") = nodes(a.beam_dag));
}

// Destroying an Executor joins its workers, whose completion callbacks need the GIL: release it
// first, or dropping a runtime with batches still queued would deadlock.
struct ExecutorDeleter {
  void operator()(slmrank::Executor* executor) const noexcept {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete executor;
    } else {
      delete executor;
    }
  }
};
using ExecutorPtr = std::unique_ptr<slmrank::Executor, ExecutorDeleter>;

ExecutorPtr executor_from_artifact(const std::string& path, const std::string& device,
                                   const std::optional<std::string>& dtype, bool use_graphs, bool verify,
                                   int num_lanes, std::tuple<int64_t, int64_t, int64_t> catalog_capacity) {
  py::gil_scoped_release nogil;
  const auto [nodes, edges, window] = catalog_capacity;
  slmrank::LoadedArtifact a = slmrank::load_artifact(path, at::Device(device), dtype_arg(dtype), verify,
                                                     slmrank::ForestCapacity{nodes, edges, window});
  a.weights.merge(a.catalogs);  // the beam_allowed node's constants, beside the weights (catalog.* names)
  return ExecutorPtr(new slmrank::Executor(a.cfg, std::move(a.weights), a.rope_cos, a.rope_sin, a.score_dag,
                                           a.beam_dag, use_graphs, num_lanes));
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "slmrank C++ DAG runtime (private; import from cpp_dag)";
  m.def("merge_attention_states", &merge_attention_states_py,
        py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"),
        py::call_guard<py::gil_scoped_release>(),
        "Merge two partial attention results over disjoint keys through their LSEs.\n"
        "out_*: [N, H, E] float dtype; lse_*: [N, H] float32 (-inf = no keys).\n"
        "Returns (out [N, H, E] in out_a's dtype, lse [N, H] float32).");
  py::register_exception<slmrank::RunCancelled>(m, "RunCancelled", PyExc_RuntimeError);
  py::class_<slmrank::RunControl, std::shared_ptr<slmrank::RunControl>>(
      m, "RunControl",
      "What a caller tells a run of Executor.run / submit while it runs: cancel() stops it before its\n"
      "next node when it runs eagerly, before its next decode step in a family's graph (use_conditional_steps),\n"
      "before it starts in a bucket's graph (RunCancelled); heavy: on the CPU it waits between its nodes while a\n"
      "light run is in progress.")
      .def(py::init([](bool heavy) {
             auto c = std::make_shared<slmrank::RunControl>();
             c->heavy = heavy;
             return c;
           }),
           py::arg("heavy") = false)
      .def("cancel", &slmrank::RunControl::cancel)
      .def_property_readonly("cancelled", &slmrank::RunControl::is_cancelled)
      .def_readonly("heavy", &slmrank::RunControl::heavy);
  // One way to make an executor: from an artifact directory (its manifest, weights, DAGs).
  py::class_<slmrank::Executor, ExecutorPtr>(m, "Executor",
                                 "Runs the artifact's Score/BeamSearch DAGs with a timing per node.")
      .def_static("from_artifact", &executor_from_artifact, py::arg("path"), py::arg("device") = "cpu",
                  py::arg("dtype") = py::none(), py::arg("use_graphs") = true, py::arg("verify") = true,
                  py::arg("num_lanes") = 0, py::arg("catalog_capacity") = std::make_tuple(0, 0, 0),
                  "Loads the artifact directory in C++ (manifest, weights, RoPE tables; GIL released).\n"
                  "dtype: float32 | bfloat16 | float16 (default: the weights'); verify: check the weights' sha256;\n"
                  "catalog_capacity: (trie nodes, edges, children at a node) the catalogs' forest holds room for\n"
                  "(0: exactly the artifact's; service/artifact/catalog.py::ForestCapacity).")
      .def("update_weights", &slmrank::Executor::update_weights, py::arg("values"),
           py::call_guard<py::gil_scoped_release>(),
           "Overwrites weights in place ({name: host tensor of the weight's shape and dtype}); on a GPU it\n"
           "waits for the lanes' runs in progress. The caller keeps runs that read them away meanwhile.")
      .def("weight", &slmrank::Executor::weight, py::arg("name"), "A weight as the nodes read it (tests).")
      .def(
          "prepare",
          [](slmrank::Executor& ex, const std::string& kind, std::unordered_map<std::string, at::Tensor> inputs,
             int64_t num_requests, int64_t beam_width, int64_t new_tokens, bool lanes_at_once) {
            slmrank::BatchSpec batch = batch_from(kind, std::move(inputs), num_requests, beam_width, new_tokens);
            py::gil_scoped_release nogil;
            return ex.prepare(batch, lanes_at_once);
          },
          py::arg("kind"), py::arg("inputs"), py::arg("num_requests") = 0, py::arg("beam_width") = 0,
          py::arg("new_tokens") = 1, py::arg("lanes_at_once") = false,
          "Capture this bucket's CUDA graph in every lane now; returns the capture's wall time in ms (0 if none).\n"
          "lanes_at_once: each lane's worker thread captures its own, all lanes at once (else one after another).")
      .def_property_readonly("uses_graphs", &slmrank::Executor::uses_graphs)
      .def_property_readonly("num_graphs", &slmrank::Executor::num_graphs)
      .def_property_readonly("num_lanes", &slmrank::Executor::num_lanes)
      .def("use_triton_kernels", &slmrank::Executor::use_triton_kernels, py::arg("dir"),
           py::call_guard<py::gil_scoped_release>(),
           "Decoder layers use the AOT Triton kernels of dir (kernels/aot.py): CUDA only, before the first batch.")
      .def_property_readonly("uses_triton_kernels", &slmrank::Executor::uses_triton_kernels)
      .def("use_conditional_steps", &slmrank::Executor::use_conditional_steps,
           "BeamSearch batches run in their family's buffers (buckets that differ only in new tokens share them,\n"
           "sized for the DAG's most steps), on a GPU as one graph per family with conditional decode steps.\n"
           "Before the first batch (no graph captured yet).")
      .def_property_readonly("uses_conditional_steps", &slmrank::Executor::uses_conditional_steps)
      .def(
          "run",
          [](slmrank::Executor& ex, const std::string& kind, std::unordered_map<std::string, at::Tensor> inputs,
             int64_t num_requests, int64_t beam_width, int64_t new_tokens,
             std::shared_ptr<slmrank::RunControl> control) {
            slmrank::BatchSpec batch =
                batch_from(kind, std::move(inputs), num_requests, beam_width, new_tokens, {}, std::move(control));
            slmrank::RunOutput out;
            {
              py::gil_scoped_release nogil;
              out = ex.run(batch);
            }
            return output_to_tuple(out);
          },
          py::arg("kind"), py::arg("inputs"), py::arg("num_requests") = 0, py::arg("beam_width") = 0,
          py::arg("new_tokens") = 1, py::arg("control") = nullptr,
          "Blocking run of one batch (GIL released). Returns ([output tensors], timings tuple): submit_ns,\n"
          "start_ns, h2d_end_ns, launch_ns, d2h_end_ns, done_ns, graph, ((name, host_ms, device_ms), ...),\n"
          "paused_ns (service.runtime.timings.BatchTimings.from_executor makes the record of it).\n"
          "control: a RunControl (cancel: RunCancelled at its next node or decode step, see RunControl;\n"
          "heavy: pause for light runs on the CPU).")
      .def(
          "trace",
          [](slmrank::Executor& ex, const std::string& kind, std::unordered_map<std::string, at::Tensor> inputs,
             std::vector<std::string> buffers, int64_t num_requests, int64_t beam_width, int64_t new_tokens) {
            slmrank::BatchSpec batch =
                batch_from(kind, std::move(inputs), num_requests, beam_width, new_tokens, std::move(buffers));
            slmrank::RunOutput out;
            {
              py::gil_scoped_release nogil;
              out = ex.run(batch);
            }
            return trace_to_list(out);
          },
          py::arg("kind"), py::arg("inputs"), py::arg("buffers"), py::arg("num_requests") = 0,
          py::arg("beam_width") = 0, py::arg("new_tokens") = 1,
          "Blocking run of one batch, eagerly, copying `buffers` to the host after every node (debugging).\n"
          "Returns [(node, {buffer: tensor})].")
      .def(
          "submit",
          [](slmrank::Executor& ex, const std::string& kind, std::unordered_map<std::string, at::Tensor> inputs,
             py::function callback, int64_t num_requests, int64_t beam_width, int64_t new_tokens,
             std::shared_ptr<slmrank::RunControl> control) {
            slmrank::BatchSpec batch =
                batch_from(kind, std::move(inputs), num_requests, beam_width, new_tokens, {}, std::move(control));
            PyCallback cb(std::move(callback));
            // no GIL release: a queue push under a mutex the worker holds only to pop (it never takes
            // the GIL while holding it). Releasing would make the event loop wait up to the interpreter's
            // switch interval (5 ms) to get the GIL back whenever another thread runs Python meanwhile.
            ex.submit(std::move(batch), cb);
          },
          py::arg("kind"), py::arg("inputs"), py::arg("callback"), py::arg("num_requests") = 0,
          py::arg("beam_width") = 0, py::arg("new_tokens") = 1, py::arg("control") = nullptr,
          "Queue one batch for the worker thread; callback((outputs, timings tuple), None) or\n"
          "callback(None, error) "
          "runs on that thread (use loop.call_soon_threadsafe to reach an asyncio loop).")
      .def("shutdown", &slmrank::Executor::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Stop taking batches; finish every queued one; join the worker.")
      .def("pending", &slmrank::Executor::pending)
      .def("node_names", [](const slmrank::Executor& ex, const std::string& kind) {
        return ex.node_names(kind == "beam" ? slmrank::Kind::kBeam : slmrank::Kind::kScore);
      });
  py::class_<slmrank::BeamWire, std::shared_ptr<slmrank::BeamWire>>(
      m, "BeamWire",
      "A BeamSearchResponse's protobuf wire bytes straight from one request's output rows (ids,\n"
      "log-probs, texts from the tokenizer's token bytes made valid UTF-8 as Python's errors='replace').")
      .def(py::init<std::vector<std::optional<std::string>>, int64_t>(), py::arg("token_bytes"),
           py::arg("model_vocab"))
      .def(
          "encode",
          [](const slmrank::BeamWire& wire, const at::Tensor& seqs, const at::Tensor& scores) -> py::object {
            // with the GIL: ~1 us a beam on the event loop, shorter than a GIL hand-over
            std::optional<std::string> out = wire.encode(seqs, scores);
            if (!out) return py::none();
            return py::bytes(*out);
          },
          py::arg("seqs"), py::arg("scores"),
          "seqs [w, n] int64, scores [w] float32 (CPU): the response bytes, or None when an id is no\n"
          "token or not the model's (the caller's Python path handles or reports it).")
      .def_property_readonly("num_tokens", &slmrank::BeamWire::num_tokens);
  m.def(
      "utf8_replace",
      [](const py::bytes& data) {
        std::string in = data, out;
        slmrank::append_utf8_replaced(in.data(), in.size(), out);
        return py::bytes(out);
      },
      py::arg("data"), "bytes.decode('utf-8', errors='replace').encode() (tests).");
  m.def(
      "read_msgpack", [](const std::string& path) { return to_python(slmrank::read_msgpack_file(path)); },
      py::arg("path"), "Decodes a MessagePack file with the C++ reader (tests).");
  m.def("sha256_file", &slmrank::sha256_file, py::arg("path"), py::call_guard<py::gil_scoped_release>(),
        "Hex SHA-256 of a file, computed in C++ (tests).");
  m.def(
      "read_safetensors",
      [](const std::string& path, const std::string& device, const std::optional<std::string>& dtype) {
        slmrank::SafetensorsFile f;
        {
          py::gil_scoped_release nogil;
          f = slmrank::read_safetensors(path, at::Device(device), dtype_arg(dtype));
        }
        py::dict tensors;
        for (auto& [name, t] : f.tensors) tensors[py::str(name)] = t;
        return py::make_tuple(tensors, f.metadata);
      },
      py::arg("path"), py::arg("device") = "cpu", py::arg("dtype") = py::none(),
      "Reads a .safetensors file with the C++ reader: ({name: tensor}, metadata) (tests).");
  m.def(
      "load_artifact",
      [](const std::string& path, const std::string& device, const std::optional<std::string>& dtype, bool verify) {
        slmrank::LoadedArtifact a;
        {
          py::gil_scoped_release nogil;
          a = slmrank::load_artifact(path, at::Device(device), dtype_arg(dtype), verify);
        }
        return loaded_to_dict(a);
      },
      py::arg("path"), py::arg("device") = "cpu", py::arg("dtype") = py::none(), py::arg("verify") = true,
      "What Executor.from_artifact loads, as a dict: config, weights, num_positions, rope_cos,\n"
      "rope_sin, score_dag, beam_dag (tests).");
  m.def("build_info", &build_info,
        "How this extension was built: torch_version, with_cuda, cxx_standard, cxx11_abi.");
#if SLMRANK_WITH_CUDA
  using slmrank::TritonKernels;
  py::class_<TritonKernels, std::shared_ptr<TritonKernels>>(
      m, "TritonKernels",
      "The ahead-of-time compiled Triton kernels of a directory written by kernels/aot.py, loaded on one\n"
      "CUDA device; each op launches on the current stream (CUDA builds only).")
      .def(py::init([](const std::string& dir, const std::string& device) {
             return std::make_shared<TritonKernels>(dir, at::Device(device));
           }),
           py::arg("dir"), py::arg("device") = "cuda")
      .def("variants", &TritonKernels::variants)
      .def("has", &TritonKernels::has, py::arg("variant"))
      .def("rms_norm", &TritonKernels::rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"))
      .def("rms_norm_residual", &TritonKernels::rms_norm_residual, py::arg("x"), py::arg("residual"),
           py::arg("weight"), py::arg("eps"))
      .def(
          "qkv_rope",
          [](const TritonKernels& k, const at::Tensor& qkv, const at::Tensor& positions, int64_t pos_offset,
             const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
             const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps,
             const std::optional<at::Tensor>& k_out, const std::optional<at::Tensor>& v_out) {
            return k.qkv_rope(qkv, positions, pos_offset, cos, sin, num_heads, num_kv_heads,
                              q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()), eps,
                              k_out.value_or(at::Tensor()), v_out.value_or(at::Tensor()));
          },
          py::arg("qkv"), py::arg("positions"), py::arg("pos_offset"), py::arg("cos"), py::arg("sin"),
          py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"),
          py::arg("k_out") = py::none(), py::arg("v_out") = py::none())
      .def("silu_mul", &TritonKernels::silu_mul, py::arg("gate_up"))
      .def("quantize_rows", &TritonKernels::quantize_rows, py::arg("x"))
      .def("rms_norm_fp8", &TritonKernels::rms_norm_fp8, py::arg("x"), py::arg("weight"), py::arg("eps"))
      .def("rms_norm_residual_fp8", &TritonKernels::rms_norm_residual_fp8, py::arg("x"), py::arg("residual"),
           py::arg("weight"), py::arg("eps"))
      .def("silu_mul_fp8", &TritonKernels::silu_mul_fp8, py::arg("gate_up"))
      .def(
          "trie_allowed",
          [](const TritonKernels& k, const at::Tensor& trie, const at::Tensor& offsets, const at::Tensor& tokens,
             const std::optional<at::Tensor>& cols, int64_t num_words) {
            return k.trie_allowed(trie, offsets, tokens, cols.value_or(at::Tensor()), num_words);
          },
          py::arg("trie"), py::arg("offsets"), py::arg("tokens"), py::arg("cols"), py::arg("num_words"))
      .def("trie_advance", &TritonKernels::trie_advance, py::arg("trie"), py::arg("next_tokens"), py::arg("offsets"),
           py::arg("tokens"), py::arg("child"))
      .def("segment_attention", &TritonKernels::segment_attention, py::arg("q"), py::arg("k"), py::arg("v"),
           py::arg("key_ranges"), py::arg("scale"))
      .def(
          "decode_attention_qkv",
          [](const TritonKernels& k, const at::Tensor& qkv, const at::Tensor& positions, int64_t pos_offset,
             const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, const std::optional<at::Tensor>& q_norm,
             const std::optional<at::Tensor>& k_norm, double eps, const at::Tensor& prompt_k,
             const at::Tensor& prompt_v, const at::Tensor& kv_start, const at::Tensor& kv_len,
             const at::Tensor& suffix_k, const at::Tensor& suffix_v, int64_t num_suffix, double scale,
             const at::Tensor& suffix_rows) {
            return k.decode_attention_qkv(qkv, positions, pos_offset, cos, sin, num_heads,
                                          q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()), eps, prompt_k,
                                          prompt_v, kv_start, kv_len, suffix_k, suffix_v, suffix_rows, num_suffix,
                                          scale);
          },
          py::arg("qkv"), py::arg("positions"), py::arg("pos_offset"), py::arg("cos"), py::arg("sin"),
          py::arg("num_heads"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("prompt_k"),
          py::arg("prompt_v"), py::arg("kv_start"), py::arg("kv_len"), py::arg("suffix_k"), py::arg("suffix_v"),
          py::arg("num_suffix"), py::arg("scale"), py::arg("suffix_rows"))
      .def(
          "beam_candidates",
          [](const TritonKernels& k, const at::Tensor& logits, const at::Tensor& beam_scores, int64_t num_candidates,
             int64_t num_parents, const std::optional<at::Tensor>& allowed, const std::optional<at::Tensor>& slot,
             const std::optional<at::Tensor>& src) {
            return k.beam_candidates(logits, beam_scores, num_candidates, num_parents, allowed.value_or(at::Tensor()),
                                     slot.value_or(at::Tensor()), src.value_or(at::Tensor()));
          },
          py::arg("logits"), py::arg("beam_scores"), py::arg("num_candidates"), py::arg("num_parents"),
          py::arg("allowed") = py::none(), py::arg("slot") = py::none(), py::arg("src") = py::none())
      .def("beam_merge", &TritonKernels::beam_merge, py::arg("keys"), py::arg("num_requests"), py::arg("num_beams"))
      .def(
          "beam_commit",
          [](const TritonKernels& k, const at::Tensor& top, const at::Tensor& seqs, const at::Tensor& widths,
             const at::Tensor& slot, int64_t vocab, int64_t step, const std::optional<at::Tensor>& src,
             const std::optional<at::Tensor>& codes, const std::optional<at::Tensor>& suffix_rows) {
            auto out = k.beam_commit(top, seqs, widths, slot, vocab, step, src.value_or(at::Tensor()),
                                     codes.value_or(at::Tensor()), suffix_rows.value_or(at::Tensor()));
            const at::Tensor &parent_rows = std::get<5>(out), &rows_out = std::get<6>(out);
            return py::make_tuple(std::get<0>(out), std::get<1>(out), std::get<2>(out), std::get<3>(out),
                                  std::get<4>(out), parent_rows.defined() ? py::cast(parent_rows) : py::none(),
                                  rows_out.defined() ? py::cast(rows_out) : py::none());
          },
          py::arg("top"), py::arg("seqs"), py::arg("widths"), py::arg("slot"), py::arg("vocab"), py::arg("step"),
          py::arg("src") = py::none(), py::arg("codes") = py::none(), py::arg("suffix_rows") = py::none());
#endif
}
