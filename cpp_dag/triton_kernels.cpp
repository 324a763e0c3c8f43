#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "triton_kernels.h"

#include <stdexcept>

#if SLMRANK_WITH_CUDA
#include "msgpack_reader.h"
#include "sha256.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#endif

namespace slmrank {

#if SLMRANK_WITH_CUDA

namespace {

void check_cu(CUresult r, const std::string& what) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  cuGetErrorString(r, &msg);
  throw std::runtime_error(what + ": " + (msg ? msg : "CUDA driver error " + std::to_string(static_cast<int>(r))));
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

const char* dtype_tag(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    default: throw std::invalid_argument(std::string("triton kernels: no variant for dtype ") + c10::toString(t));
  }
}

// kernels/aot.py::variant_name: kernel, then each dimension as <key><value>, then the dtype
std::string variant_name(const std::string& kernel, at::ScalarType t,
                         const std::vector<std::pair<const char*, int64_t>>& dims = {}) {
  std::string name = kernel;
  for (const auto& [key, value] : dims) name += std::string(".") + key + std::to_string(value);
  return name + "." + dtype_tag(t);
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// programs of per_block items covering n
uint32_t blocks(int64_t n, int64_t per_block) { return static_cast<uint32_t>((n + per_block - 1) / per_block); }

// kernels/beam_topk.py::sizes' KP: the sort width for k keys a row, a power of two >= max(k, 2)
int64_t sort_width(int64_t k) {
  int64_t kp = 2;
  while (kp < k) kp *= 2;
  return kp;
}

}  // namespace

struct TritonKernels::Impl {
  struct Kernel {
    CUmodule module = nullptr;
    CUfunction function = nullptr;
    uint32_t threads = 0, shared = 0;
    std::vector<std::string> param_types;  // the non-scratch parameters: CUdeviceptr / int32_t / int64_t / float
    std::vector<bool> divisible_by_16;     // per parameter: compiled assuming a 16-byte aligned pointer
    std::map<std::string, int64_t> constexprs;  // integer / bool ones
  };
  at::Device device = at::kCPU;
  std::map<std::string, Kernel> kernels;

  const Kernel& get(const std::string& variant) const {
    auto it = kernels.find(variant);
    if (it == kernels.end()) throw std::invalid_argument("triton kernels: no compiled variant " + variant);
    return it->second;
  }
};

TritonKernels::TritonKernels(const std::string& dir, const at::Device& device) : impl_(new Impl) {
  if (!device.is_cuda()) throw std::invalid_argument("triton kernels need a CUDA device, got " + device.str());
  // "cuda" means the current device: tensors always carry an index, so the launch check needs one
  impl_->device = device.has_index() ? device : at::Device(at::kCUDA, c10::cuda::current_device());
  c10::cuda::CUDAGuard guard(impl_->device);
  if (cudaFree(nullptr) != cudaSuccess) throw std::runtime_error("triton kernels: cannot initialise the CUDA context");
  const std::string manifest_path = dir + "/kernels.msgpack";
  const Value manifest = read_msgpack_file(manifest_path);
  for (const Value& k : manifest.at("kernels").as_array()) {
    const std::string variant = k.at("variant").as_str();
    const std::string cubin_path = dir + "/" + k.at("cubin").as_str();
    if (k.at("global_scratch_size").as_int64() != 0 || k.at("profile_scratch_size").as_int64() != 0) {
      throw std::runtime_error(manifest_path + ": kernel " + variant + " needs scratch memory (not supported)");
    }
    const std::string image = read_file(cubin_path);
    if (sha256_file(cubin_path) != k.at("sha256").as_str()) {
      throw std::runtime_error(cubin_path + ": sha256 does not match " + manifest_path);
    }
    Impl::Kernel kernel;
    check_cu(cuModuleLoadData(&kernel.module, image.data()), cubin_path + ": cuModuleLoadData");
    const std::string fn = k.at("function").as_str();
    check_cu(cuModuleGetFunction(&kernel.function, kernel.module, fn.c_str()), cubin_path + ": cuModuleGetFunction " + fn);
    kernel.threads = static_cast<uint32_t>(32 * k.at("num_warps").as_int64());
    kernel.shared = static_cast<uint32_t>(k.at("shared_bytes").as_int64());
    if (kernel.shared > 48 * 1024) {
      check_cu(cuFuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                  static_cast<int>(kernel.shared)),
               variant + ": dynamic shared memory");
    }
    for (const Value& p : k.at("params").as_array()) {
      if (p.at("triton").as_str() == "scratch") continue;
      kernel.param_types.push_back(p.at("type").as_str());
      const Value* div16 = p.find("divisible_by_16");
      kernel.divisible_by_16.push_back(div16 != nullptr && div16->as_bool());
    }
    for (const auto& [name, value] : k.at("constexprs").as_map()) {
      if (value.is_integer()) kernel.constexprs[name] = value.as_int64();
      if (value.type() == Value::Type::kBool) kernel.constexprs[name] = value.as_bool() ? 1 : 0;
    }
    impl_->kernels.emplace(variant, std::move(kernel));
  }
}

TritonKernels::~TritonKernels() {
  if (!impl_) return;
  for (auto& [name, k] : impl_->kernels) {
    if (k.module) cuModuleUnload(k.module);
  }
}

std::vector<std::string> TritonKernels::variants() const {
  std::vector<std::string> out;
  for (const auto& [name, k] : impl_->kernels) out.push_back(name);
  return out;
}

bool TritonKernels::has(const std::string& variant) const { return impl_->kernels.count(variant) > 0; }

void TritonKernels::launch(const std::string& variant, std::array<uint32_t, 3> grid,
                           const std::vector<Arg>& args) const {
  const Impl::Kernel& k = impl_->get(variant);
  if (args.size() != k.param_types.size()) {
    throw std::invalid_argument(variant + ": " + std::to_string(args.size()) + " arguments for " +
                                std::to_string(k.param_types.size()) + " parameters");
  }
  std::vector<uint64_t> storage(args.size() + 2, 0);  // 8 bytes a value; the last two: scratch pointers (null)
  std::vector<void*> params(args.size() + 2);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& type = k.param_types[i];
    void* slot = &storage[i];
    if (const auto* t = std::get_if<at::Tensor>(&args[i])) {
      require(type == "CUdeviceptr", variant + ": parameter " + std::to_string(i) + " is a " + type + ", not a pointer");
      require(t->device() == impl_->device, variant + ": tensor argument " + std::to_string(i) + " is not on " +
                                                impl_->device.str());
      const auto address = reinterpret_cast<uintptr_t>(t->data_ptr());
      require(!k.divisible_by_16[i] || address % 16 == 0,
              variant + ": tensor argument " + std::to_string(i) + " must be 16-byte aligned (compiled so)");
      *static_cast<CUdeviceptr*>(slot) = static_cast<CUdeviceptr>(address);
    } else if (const auto* v = std::get_if<int32_t>(&args[i])) {
      require(type == "int32_t", variant + ": parameter " + std::to_string(i) + " is a " + type + ", not an int32");
      *static_cast<int32_t*>(slot) = *v;
    } else if (const auto* v = std::get_if<int64_t>(&args[i])) {
      require(type == "int64_t", variant + ": parameter " + std::to_string(i) + " is a " + type + ", not an int64");
      *static_cast<int64_t*>(slot) = *v;
    } else {
      require(type == "float", variant + ": parameter " + std::to_string(i) + " is a " + type + ", not a float");
      *static_cast<float*>(slot) = std::get<float>(args[i]);
    }
    params[i] = slot;
  }
  params[args.size()] = &storage[args.size()];
  params[args.size() + 1] = &storage[args.size() + 1];
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return;  // nothing to do
  c10::cuda::CUDAGuard guard(impl_->device);
  CUstream stream = reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(impl_->device.index()).stream());
  check_cu(cuLaunchKernel(k.function, grid[0], grid[1], grid[2], k.threads, 1, 1, k.shared, stream, params.data(),
                          nullptr),
           variant + ": cuLaunchKernel");
}

at::Tensor TritonKernels::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) const {
  require(x.is_contiguous() && x.dim() >= 1, "rms_norm: x must be contiguous");
  const int64_t d = x.size(-1);
  require(weight.dim() == 1 && weight.size(0) == d && weight.scalar_type() == x.scalar_type(),
          "rms_norm: weight must be [" + std::to_string(d) + "] of x's dtype");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.numel() / d;
  const std::string variant = variant_name("rms_norm", x.scalar_type(), {{"n", d}, {"res", 0}});
  launch(variant, {blocks(rows, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {x, x, weight, out, out, static_cast<int32_t>(rows), static_cast<float>(eps)});
  return out;
}

std::pair<at::Tensor, at::Tensor> TritonKernels::rms_norm_residual(const at::Tensor& x, const at::Tensor& residual,
                                                                   const at::Tensor& weight, double eps) const {
  require(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
              x.scalar_type() == residual.scalar_type(),
          "rms_norm: x and residual must be contiguous, of one shape and dtype");
  const int64_t d = x.size(-1);
  require(weight.dim() == 1 && weight.size(0) == d && weight.scalar_type() == x.scalar_type(),
          "rms_norm: weight must be [" + std::to_string(d) + "] of x's dtype");
  at::Tensor out = at::empty_like(x), total = at::empty_like(x);
  const int64_t rows = x.numel() / d;
  const std::string variant = variant_name("rms_norm", x.scalar_type(), {{"n", d}, {"res", 1}});
  launch(variant, {blocks(rows, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {x, residual, weight, out, total, static_cast<int32_t>(rows), static_cast<float>(eps)});
  return {out, total};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> TritonKernels::qkv_rope(
    const at::Tensor& qkv, const at::Tensor& positions, int64_t pos_offset, const at::Tensor& cos,
    const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, const at::Tensor& q_norm, const at::Tensor& k_norm,
    double eps, const at::Tensor& k_out, const at::Tensor& v_out) const {
  const int64_t h = num_heads, g = num_kv_heads;
  require(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
          "qkv_rope: cos and sin must be contiguous [P, E] tables of qkv's dtype");
  const int64_t e = cos.size(1);
  require(qkv.dim() == 2 && qkv.is_contiguous() && g > 0 && h % g == 0 && qkv.size(1) == (h + 2 * g) * e,
          "qkv_rope: qkv must be a contiguous [N, (H + 2G) * E]");
  const int64_t n = qkv.size(0);
  require(positions.dim() == 1 && positions.size(0) == n && positions.scalar_type() == at::kLong &&
              positions.is_contiguous(),
          "qkv_rope: positions must be a contiguous int64 [" + std::to_string(n) + "]");
  const bool has_norm = q_norm.defined();
  require(has_norm == k_norm.defined() &&
              (!has_norm || (q_norm.dim() == 1 && q_norm.size(0) == e && k_norm.sizes() == q_norm.sizes() &&
                             q_norm.scalar_type() == qkv.scalar_type() && k_norm.scalar_type() == qkv.scalar_type())),
          "qkv_rope: q_norm and k_norm must both be [" + std::to_string(e) + "] of qkv's dtype, or both undefined");
  at::Tensor q = at::empty({n, h, e}, qkv.options());
  at::Tensor k = k_out.defined() ? k_out : at::empty({n, g, e}, qkv.options());
  at::Tensor v = v_out.defined() ? v_out : at::empty({n, g, e}, qkv.options());
  for (const at::Tensor* t : {&k, &v}) {
    require(t->dim() == 3 && t->size(0) == n && t->size(1) == g && t->size(2) == e && t->stride(2) == 1 &&
                t->stride(1) == e && t->scalar_type() == qkv.scalar_type(),
            "qkv_rope: k_out and v_out must be [N, G, E] of qkv's dtype with contiguous heads");
  }
  require(k.stride(0) == v.stride(0) && k.stride(0) % 8 == 0,
          "qkv_rope: k_out and v_out must share one row stride, a multiple of 8 elements");
  const std::string variant =
      variant_name("qkv_rope", qkv.scalar_type(), {{"h", h}, {"g", g}, {"e", e}, {"norm", has_norm ? 1 : 0}});
  const auto& constexprs = impl_->get(variant).constexprs;
  launch(variant, {blocks(n, constexprs.at("BLOCK_T")), static_cast<uint32_t>((h + 2 * g) / constexprs.at("HB")), 1},
         {qkv, positions, cos, sin, has_norm ? q_norm : qkv, has_norm ? k_norm : qkv, q, k, v,
          static_cast<int32_t>(n), static_cast<int32_t>(pos_offset), static_cast<int32_t>(k.stride(0) / 8),
          static_cast<float>(eps)});
  return {q, k, v};
}

at::Tensor TritonKernels::silu_mul(const at::Tensor& gate_up) const {
  require(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
          "silu_mul: gate_up must be a contiguous [N, 2I]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  const std::string variant = variant_name("silu_mul", gate_up.scalar_type(), {{"i", inter}});
  const auto& constexprs = impl_->get(variant).constexprs;
  at::Tensor out = at::empty({n, inter}, gate_up.options());
  launch(variant, {blocks(n, constexprs.at("ROWS")), blocks(inter, constexprs.at("BLOCK")), 1},
         {gate_up, out, static_cast<int32_t>(n)});
  return out;
}

at::Tensor TritonKernels::trie_allowed(const at::Tensor& trie, const at::Tensor& offsets, const at::Tensor& tokens,
                                       const at::Tensor& cols, int64_t num_words) const {
  require(trie.dim() == 1 && trie.is_contiguous() && trie.scalar_type() == at::kLong,
          "trie_allowed: trie must be a contiguous int64 [rows]");
  at::Tensor words = at::empty({trie.size(0), num_words}, trie.options().dtype(at::kInt));
  const std::string variant = variant_name("trie_allowed", at::kFloat, {{"cols", cols.defined() ? 1 : 0}});
  launch(variant, {static_cast<uint32_t>(trie.size(0)), 1, 1},
         {trie, offsets, tokens, cols.defined() ? cols : tokens, words, static_cast<int32_t>(num_words)});
  return words;
}

at::Tensor TritonKernels::trie_advance(const at::Tensor& trie, const at::Tensor& next_tokens, const at::Tensor& offsets,
                                       const at::Tensor& tokens, const at::Tensor& child) const {
  require(trie.sizes() == next_tokens.sizes() && trie.scalar_type() == at::kLong &&
              next_tokens.scalar_type() == at::kLong,
          "trie_advance: trie and next_tokens must be int64 of one shape");
  const at::Tensor flat = trie.reshape({-1}).contiguous(), next = next_tokens.reshape({-1}).contiguous();
  at::Tensor out = at::empty_like(flat);
  launch(variant_name("trie_advance", at::kFloat), {static_cast<uint32_t>(flat.size(0)), 1, 1},
         {flat, next, offsets, tokens, child, out});
  return out.view(trie.sizes());
}

namespace {
// (e4m3 [rows, cols], float32 [rows]) for a quantizing kernel's output
std::pair<at::Tensor, at::Tensor> fp8_outputs(const at::Tensor& like, int64_t rows, int64_t cols) {
  return {at::empty({rows, cols}, like.options().dtype(at::kFloat8_e4m3fn)),
          at::empty({rows}, like.options().dtype(at::kFloat))};
}
}  // namespace

std::pair<at::Tensor, at::Tensor> TritonKernels::quantize_rows(const at::Tensor& x) const {
  require(x.dim() == 2 && x.is_contiguous(), "quantize_rows: x must be a contiguous [M, K]");
  const int64_t rows = x.size(0), d = x.size(1);
  auto [q, scale] = fp8_outputs(x, rows, d);
  const std::string variant = variant_name("quantize_rows", x.scalar_type(), {{"n", d}});
  launch(variant, {blocks(rows, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {x, q, scale, static_cast<int32_t>(rows)});
  return {q, scale};
}

std::pair<at::Tensor, at::Tensor> TritonKernels::rms_norm_fp8(const at::Tensor& x, const at::Tensor& weight,
                                                              double eps) const {
  require(x.dim() == 2 && x.is_contiguous(), "rms_norm_fp8: x must be a contiguous [rows, D]");
  const int64_t rows = x.size(0), d = x.size(1);
  require(weight.dim() == 1 && weight.size(0) == d && weight.scalar_type() == x.scalar_type(),
          "rms_norm_fp8: weight must be [" + std::to_string(d) + "] of x's dtype");
  auto [q, scale] = fp8_outputs(x, rows, d);
  const std::string variant = variant_name("rms_norm_fp8", x.scalar_type(), {{"n", d}, {"res", 0}});
  launch(variant, {blocks(rows, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {x, x, weight, q, scale, x, static_cast<int32_t>(rows), static_cast<float>(eps)});
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> TritonKernels::rms_norm_residual_fp8(const at::Tensor& x,
                                                                                    const at::Tensor& residual,
                                                                                    const at::Tensor& weight,
                                                                                    double eps) const {
  require(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
              x.scalar_type() == residual.scalar_type(),
          "rms_norm_fp8: x and residual must be contiguous [rows, D] of one shape and dtype");
  const int64_t rows = x.size(0), d = x.size(1);
  require(weight.dim() == 1 && weight.size(0) == d && weight.scalar_type() == x.scalar_type(),
          "rms_norm_fp8: weight must be [" + std::to_string(d) + "] of x's dtype");
  auto [q, scale] = fp8_outputs(x, rows, d);
  at::Tensor total = at::empty_like(x);
  const std::string variant = variant_name("rms_norm_fp8", x.scalar_type(), {{"n", d}, {"res", 1}});
  launch(variant, {blocks(rows, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {x, residual, weight, q, scale, total, static_cast<int32_t>(rows), static_cast<float>(eps)});
  return {q, scale, total};
}

std::pair<at::Tensor, at::Tensor> TritonKernels::silu_mul_fp8(const at::Tensor& gate_up) const {
  require(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
          "silu_mul_fp8: gate_up must be a contiguous [N, 2I]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto [q, scale] = fp8_outputs(gate_up, n, inter);
  const std::string variant = variant_name("silu_mul_fp8", gate_up.scalar_type(), {{"i", inter}});
  launch(variant, {blocks(n, impl_->get(variant).constexprs.at("ROWS")), 1, 1},
         {gate_up, q, scale, static_cast<int32_t>(n)});
  return {q, scale};
}

at::Tensor TritonKernels::segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& key_ranges, double scale) const {
  require(q.dim() == 3 && k.dim() == 3, "segment_attention: q [T, H, E], k and v [T, G, E] expected");
  const int64_t t = q.size(0), h = q.size(1), e = q.size(2), g = k.size(1);
  require(g > 0 && h % g == 0 && k.size(0) == t && k.size(2) == e && v.sizes() == k.sizes() &&
              k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
          "segment_attention: shapes or dtypes do not agree");
  require(key_ranges.scalar_type() == at::kInt && key_ranges.dim() == 2 && key_ranges.size(0) == 3 &&
              key_ranges.size(1) == t,
          "segment_attention: key_ranges must be int32 [3, " + std::to_string(t) + "]");
  for (const at::Tensor* x : {&q, &k, &v, &key_ranges}) {
    require(x->is_contiguous(), "segment_attention: every tensor must be contiguous");
  }
  // one program per (query head, tile of BLOCK_M rows): a tile's heads are consecutive programs
  const std::string variant = variant_name("segment_attention", q.scalar_type(), {{"h", h}, {"g", g}, {"e", e}});
  const int64_t block_m = impl_->get(variant).constexprs.at("BLOCK_M");
  at::Tensor out = at::empty_like(q);
  launch(variant, {static_cast<uint32_t>(h), blocks(t, block_m), 1},
         {q, k, v, key_ranges, out, static_cast<int32_t>(t), static_cast<float>(scale)});
  return out;
}

at::Tensor TritonKernels::decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& positions, int64_t pos_offset,
                                               const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                               const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                                               const at::Tensor& prompt_k, const at::Tensor& prompt_v,
                                               const at::Tensor& kv_start, const at::Tensor& kv_len,
                                               const at::Tensor& suffix_k, const at::Tensor& suffix_v,
                                               const at::Tensor& suffix_rows, int64_t num_suffix, double scale) const {
  require(qkv.dim() == 2 && prompt_k.dim() == 3 && suffix_k.dim() == 4, "decode_attention_qkv: qkv [N, (H + 2G) * E], "
          "prompt_k [P, G, E], suffix_k [N, S, G, E] expected");
  const int64_t n = qkv.size(0), h = num_heads, g = prompt_k.size(1), e = prompt_k.size(2), slots = suffix_k.size(1);
  require(g > 0 && h % g == 0 && qkv.size(1) == (h + 2 * g) * e && qkv.is_contiguous() &&
              qkv.scalar_type() == prompt_k.scalar_type(),
          "decode_attention_qkv: qkv must be a contiguous [N, (H + 2G) * E] of the cache's dtype");
  require(suffix_k.size(0) == n && suffix_k.size(2) == g && suffix_k.size(3) == e &&
              prompt_v.sizes() == prompt_k.sizes() && suffix_v.sizes() == suffix_k.sizes(),
          "decode_attention_qkv: shapes do not agree");
  require(num_suffix >= 1 && num_suffix <= slots,
          "decode_attention_qkv: num_suffix outside [1, " + std::to_string(slots) + "]");
  require(suffix_rows.scalar_type() == at::kLong && suffix_rows.dim() == 2 && suffix_rows.size(0) == n &&
              suffix_rows.size(1) == slots,
          "decode_attention_qkv: suffix_rows must be int64 [N, S] (the suffix's rows and slots)");
  for (const at::Tensor* t : {&prompt_k, &prompt_v, &suffix_k, &suffix_v, &suffix_rows, &kv_start, &kv_len, &positions,
                              &cos, &sin}) {
    require(t->is_contiguous(), "decode_attention_qkv: every tensor must be contiguous");
  }
  require(kv_start.scalar_type() == at::kLong && kv_len.scalar_type() == at::kLong && kv_start.numel() == n &&
              kv_len.numel() == n && positions.scalar_type() == at::kLong && positions.numel() == n,
          "decode_attention_qkv: kv_start, kv_len and positions must be int64 [N]");
  require(cos.dim() == 2 && cos.size(1) == e && sin.sizes() == cos.sizes() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(),
          "decode_attention_qkv: cos and sin must be [P, E] tables of qkv's dtype");
  const bool has_norm = q_norm.defined();
  require(has_norm == k_norm.defined() &&
              (!has_norm || (q_norm.numel() == e && k_norm.numel() == e && q_norm.scalar_type() == qkv.scalar_type() &&
                             k_norm.scalar_type() == qkv.scalar_type())),
          "decode_attention_qkv: q_norm and k_norm must both be [E] of qkv's dtype, or both undefined");
  // one program per (tile of BEAMS consecutive beam rows, KV head); any slot count (a loop over num_suffix)
  const std::string variant = variant_name("decode_attention", qkv.scalar_type(),
                                           {{"h", h}, {"g", g}, {"e", e}, {"norm", has_norm ? 1 : 0}});
  const int64_t beams = impl_->get(variant).constexprs.at("BEAMS");
  at::Tensor out = at::empty({n, h, e}, qkv.options());
  launch(variant, {static_cast<uint32_t>((n + beams - 1) / beams), static_cast<uint32_t>(g), 1},
         {qkv, prompt_k, prompt_v, kv_start, kv_len, suffix_k, suffix_v, suffix_rows, out, positions, cos, sin,
          has_norm ? q_norm : qkv, has_norm ? k_norm : qkv, static_cast<int32_t>(n), static_cast<int32_t>(slots),
          static_cast<int32_t>(num_suffix), static_cast<int32_t>(pos_offset), static_cast<float>(scale),
          static_cast<float>(eps)});
  return out;
}

at::Tensor TritonKernels::beam_candidates(const at::Tensor& logits, const at::Tensor& beam_scores,
                                          int64_t num_candidates, int64_t num_parents, const at::Tensor& allowed,
                                          const at::Tensor& slot_in, const at::Tensor& src_in) const {
  require(logits.dim() == 2 && logits.stride(1) == 1 && logits.stride(0) % 16 == 0,
          "beam_candidates: logits must be [rows, V] with contiguous rows of a multiple of 16 elements apart "
          "(the kernels are compiled for 16-byte vectors)");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  require(beam_scores.scalar_type() == at::kFloat && beam_scores.dim() == 1 && beam_scores.size(0) >= 1 &&
              beam_scores.is_contiguous(),
          "beam_candidates: beam_scores must be a contiguous float32 [ranks]");
  const int64_t ranks = beam_scores.size(0);
  require(slot_in.defined() == src_in.defined(), "beam_candidates: give both slot and src, or neither");
  const at::Tensor slot = slot_in.defined() ? slot_in : at::arange(rows, logits.options().dtype(at::kLong));
  const at::Tensor src = src_in.defined() ? src_in : slot;
  for (const auto& [name, t, n] : {std::tuple<const char*, const at::Tensor*, int64_t>{"slot", &slot, rows},
                                   {"src", &src, ranks}}) {
    require(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == n && t->is_contiguous(),
            std::string("beam_candidates: ") + name + " must be a contiguous int64 [" + std::to_string(n) + "]");
  }
  require(num_candidates >= 1 && num_candidates <= std::min<int64_t>(vocab, 1 << 16) && num_parents >= 1 &&
              ranks % num_parents == 0 && num_parents * vocab < (int64_t{1} << 32),
          "beam_candidates: need 1 <= K <= V, ranks a multiple of the parents per request, parents x V < 2^32");
  const bool has_mask = allowed.defined();
  const int64_t words = (vocab + 31) / 32;
  require(!has_mask || (allowed.scalar_type() == at::kInt && allowed.dim() == 2 && allowed.size(0) == rows &&
                        allowed.size(1) == words && allowed.is_contiguous()),
          "beam_candidates: allowed must be a contiguous int32 [rows, ceil(V / 32)] bitmask");
  // kernels/beam_topk.py::sizes: the sort width KP (a power of two >= max(K, 2)) and the groups NG
  const int64_t kp = sort_width(num_candidates);
  const int64_t ng = std::max<int64_t>(1024, 2 * kp), mask = has_mask ? 1 : 0;
  const std::string stats = variant_name("beam_stats", logits.scalar_type(), {{"g", ng}, {"mask", mask}});
  const std::string threshold = variant_name("beam_threshold", at::kFloat, {{"g", ng}, {"k", kp}});
  const std::string collect = variant_name("beam_collect", logits.scalar_type(), {{"g", ng}, {"mask", mask}});
  const std::string select = variant_name("beam_select", logits.scalar_type(), {{"k", kp}, {"mask", mask}});
  const int64_t parts = impl_->get(stats).constexprs.at("NUM_PARTS"), cap = impl_->get(select).constexprs.at("CAP");
  const auto f32 = logits.options().dtype(at::kFloat), i32 = logits.options().dtype(at::kInt);
  at::Tensor pmax = at::empty({rows, parts}, f32), psum = at::empty({rows, parts}, f32);
  at::Tensor gpart = at::empty({rows, parts, ng}, f32), stats_buf = at::empty({rows, 4}, f32);
  // count [rows, 2]: the tokens the collect pass buffered (>= T) and those strictly above T
  at::Tensor count = at::empty({rows, 2}, i32), buf = at::empty({rows, cap}, i32);
  at::Tensor keys = at::empty({ranks, num_candidates}, logits.options().dtype(at::kLong));
  const at::Tensor& bits = has_mask ? allowed : count;  // never read without the mask
  const int32_t v = static_cast<int32_t>(vocab), stride = static_cast<int32_t>(logits.stride(0));
  const int32_t w = static_cast<int32_t>(words), n_ranks = static_cast<int32_t>(ranks);
  const uint32_t r = static_cast<uint32_t>(rows), p = static_cast<uint32_t>(parts);
  launch(stats, {r, p, 1}, {logits, beam_scores, slot, bits, pmax, psum, gpart, v, stride, w, n_ranks});
  launch(threshold, {r, 1, 1},
         {beam_scores, slot, pmax, psum, gpart, stats_buf, count, static_cast<int32_t>(num_candidates), n_ranks});
  launch(collect, {r, p, 1}, {logits, bits, stats_buf, count, buf, v, stride, w, static_cast<int32_t>(cap)});
  launch(select, {static_cast<uint32_t>(ranks), 1, 1},
         {logits, bits, stats_buf, count, buf, src, keys, v, stride, w, static_cast<int32_t>(num_candidates),
          static_cast<int32_t>(num_parents), static_cast<int32_t>(rows)});
  return keys;
}

at::Tensor TritonKernels::beam_merge(const at::Tensor& keys, int64_t num_requests, int64_t num_beams) const {
  require(keys.scalar_type() == at::kLong && keys.is_contiguous() && num_requests >= 1 &&
              keys.numel() % num_requests == 0,
          "beam_merge: keys must be a contiguous int64 [R x P, K] of " + std::to_string(num_requests) + " requests");
  at::Tensor x = keys.view({num_requests, -1});
  int64_t n = x.size(1);
  require(num_beams >= 1 && num_beams <= n, "beam_merge: need 1 <= B (" + std::to_string(num_beams) +
                                                ") <= the keys a request (" + std::to_string(n) + ")");
  if (n == num_beams) return x;
  // kernels/beam_topk.py::merge_sizes: the sort width KP; CHUNK (the keys a program takes) is the variant's
  const std::string variant = variant_name("beam_merge", at::kFloat, {{"k", sort_width(num_beams)}});
  const int64_t chunk = impl_->get(variant).constexprs.at("CHUNK");
  while (true) {
    const int64_t chunks = (n + chunk - 1) / chunk;
    at::Tensor out = at::empty({num_requests, chunks * num_beams}, x.options());
    launch(variant, {static_cast<uint32_t>(num_requests), static_cast<uint32_t>(chunks), 1},
           {x, out, static_cast<int32_t>(n), static_cast<int32_t>(chunks * num_beams),
            static_cast<int32_t>(num_beams)});
    if (chunks == 1) return out;
    x = out;
    n = chunks * num_beams;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> TritonKernels::beam_commit(
    const at::Tensor& top, const at::Tensor& seqs, const at::Tensor& widths, const at::Tensor& slot, int64_t vocab,
    int64_t step, const at::Tensor& src, const at::Tensor& codes, const at::Tensor& suffix_rows) const {
  require(seqs.dim() == 3, "beam_commit: seqs must be [R, B, n]");
  const int64_t r = seqs.size(0), b = seqs.size(1), n = seqs.size(2), rows = slot.numel();
  for (const auto& [name, t, shape] : {std::tuple<const char*, const at::Tensor*, std::vector<int64_t>>{
                                           "top", &top, {r, b}},
                                       {"seqs", &seqs, {r, b, n}}, {"widths", &widths, {r}}, {"slot", &slot, {rows}},
                                       {"src", &src, {r * b}}, {"codes", &codes, {}}}) {
    if (!t->defined()) continue;
    require(t->scalar_type() == at::kLong && t->is_contiguous() && (shape.empty() || t->sizes() == shape),
            std::string("beam_commit: ") + name + " must be a contiguous int64 of the bookkeeping's shape");
  }
  require(step >= 0 && step < n, "beam_commit: step outside the sequence's columns");
  require(!suffix_rows.defined() ||
              (src.defined() && suffix_rows.scalar_type() == at::kLong && suffix_rows.dim() == 2 &&
               suffix_rows.size(0) == rows && suffix_rows.is_contiguous()),
          "beam_commit: suffix_rows must be a contiguous int64 [rows, S] of a decode step (with src)");
  constexpr int64_t kBlock = 128;  // kernels/beam_topk.py COMMIT_BLOCK (the variant's BLOCK)
  const std::string variant = variant_name("beam_commit", at::kFloat, {{"codes", codes.defined() ? 1 : 0}});
  require(impl_->get(variant).constexprs.at("BLOCK") == kBlock, "beam_commit: the compiled BLOCK is not 128");
  at::Tensor seqs_out = at::empty_like(seqs), scores = at::empty({r, b}, top.options().dtype(at::kFloat));
  at::Tensor parents = at::empty_like(top), tokens = at::empty_like(top);
  at::Tensor row_tokens = at::empty({rows}, top.options()), parent_rows;
  if (src.defined()) parent_rows = at::empty({rows}, top.options());
  at::Tensor rows_out;  // each row's suffix_rows for the next decode step (kernels/beam_topk.py)
  if (suffix_rows.defined()) rows_out = at::empty_like(suffix_rows);
  const int64_t rank_programs = (r * b + kBlock - 1) / kBlock;
  launch(variant, {static_cast<uint32_t>(rank_programs + (rows + kBlock - 1) / kBlock), 1, 1},
         {top, seqs, widths, slot, src.defined() ? src : slot, codes.defined() ? codes : slot, seqs_out, scores,
          parents, tokens, row_tokens, src.defined() ? parent_rows : row_tokens,
          suffix_rows.defined() ? suffix_rows : slot, suffix_rows.defined() ? rows_out : row_tokens,
          static_cast<int32_t>(r * b), static_cast<int32_t>(b), static_cast<int32_t>(n), static_cast<int32_t>(step),
          static_cast<int32_t>(vocab), static_cast<int32_t>(rows), static_cast<int32_t>(rank_programs),
          static_cast<int32_t>(src.defined()), static_cast<int32_t>(suffix_rows.defined() ? suffix_rows.size(1) : 0)});
  return {seqs_out, scores, parents, tokens, row_tokens, parent_rows, rows_out};
}

#else  // no CUDA in this build: no object can be made (bindings.cpp binds the class only with CUDA)

namespace {
[[noreturn]] void no_cuda() { throw std::runtime_error("triton kernels: this build has no CUDA"); }
}  // namespace

struct TritonKernels::Impl {};
TritonKernels::TritonKernels(const std::string&, const at::Device&) { no_cuda(); }
TritonKernels::~TritonKernels() = default;
std::vector<std::string> TritonKernels::variants() const { no_cuda(); }
bool TritonKernels::has(const std::string&) const { no_cuda(); }
void TritonKernels::launch(const std::string&, std::array<uint32_t, 3>, const std::vector<Arg>&) const { no_cuda(); }
at::Tensor TritonKernels::rms_norm(const at::Tensor&, const at::Tensor&, double) const { no_cuda(); }
std::pair<at::Tensor, at::Tensor> TritonKernels::rms_norm_residual(const at::Tensor&, const at::Tensor&,
                                                                   const at::Tensor&, double) const {
  no_cuda();
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> TritonKernels::qkv_rope(const at::Tensor&, const at::Tensor&, int64_t,
                                                                       const at::Tensor&, const at::Tensor&, int64_t,
                                                                       int64_t, const at::Tensor&, const at::Tensor&,
                                                                       double, const at::Tensor&,
                                                                       const at::Tensor&) const {
  no_cuda();
}
at::Tensor TritonKernels::silu_mul(const at::Tensor&) const { no_cuda(); }
std::pair<at::Tensor, at::Tensor> TritonKernels::quantize_rows(const at::Tensor&) const { no_cuda(); }
std::pair<at::Tensor, at::Tensor> TritonKernels::rms_norm_fp8(const at::Tensor&, const at::Tensor&, double) const {
  no_cuda();
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> TritonKernels::rms_norm_residual_fp8(const at::Tensor&,
                                                                                    const at::Tensor&,
                                                                                    const at::Tensor&, double) const {
  no_cuda();
}
std::pair<at::Tensor, at::Tensor> TritonKernels::silu_mul_fp8(const at::Tensor&) const { no_cuda(); }
at::Tensor TritonKernels::trie_allowed(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       int64_t) const {
  no_cuda();
}
at::Tensor TritonKernels::trie_advance(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const at::Tensor&) const {
  no_cuda();
}
at::Tensor TritonKernels::segment_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            double) const {
  no_cuda();
}
at::Tensor TritonKernels::decode_attention_qkv(const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                               const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                                               double, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&, int64_t, double) const {
  no_cuda();
}
at::Tensor TritonKernels::beam_candidates(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&) const {
  no_cuda();
}
at::Tensor TritonKernels::beam_merge(const at::Tensor&, int64_t, int64_t) const { no_cuda(); }
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> TritonKernels::beam_commit(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, const at::Tensor&,
    const at::Tensor&, const at::Tensor&) const {
  no_cuda();
}

#endif

}  // namespace slmrank
