// The only translation unit that includes pybind11 / torch/extension.h (the slow headers).
// Everything else in cpp_dag/ is plain C++ over ATen and knows nothing of Python.
#include <torch/extension.h>

#include <tuple>

#include "attention_merge.h"

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

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "slmrank C++ DAG runtime (private; import from cpp_dag)";
  m.def("merge_attention_states", &merge_attention_states_py,
        py::arg("out_a"), py::arg("lse_a"), py::arg("out_b"), py::arg("lse_b"),
        py::call_guard<py::gil_scoped_release>(),
        "Merge two partial attention results over disjoint keys through their LSEs.\n"
        "out_*: [N, H, E] float dtype; lse_*: [N, H] float32 (-inf = no keys).\n"
        "Returns (out [N, H, E] in out_a's dtype, lse [N, H] float32).");
  m.def("build_info", &build_info,
        "How this extension was built: torch_version, with_cuda, cxx_standard, cxx11_abi.");
}
