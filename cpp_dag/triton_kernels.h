// Triton kernels compiled ahead of time (kernels/aot.py) into sm_90a cubins, loaded with the CUDA
// driver API and launched on the current CUDA stream (so inside a graph capture too). Every module
// is loaded when the object is made, before any capture; none is unloaded while the object lives.
// The ops mirror the Python launchers of kernels/ (norm_act, fp8_quant, qkv_rope, segment_attention,
// decode_attention, beam_topk, trie) (same variants, same grids); the Python runtime reaches these
// very launches through the extension, which keeps both runtimes byte-identical.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace slmrank {

class TritonKernels {
 public:
  // dir holds kernels.msgpack and the cubins it names; each cubin's SHA-256 is checked.
  // Throws std::runtime_error naming the file or the kernel (always, in a build without CUDA).
  TritonKernels(const std::string& dir, const at::Device& device);
  ~TritonKernels();
  TritonKernels(const TritonKernels&) = delete;
  TritonKernels& operator=(const TritonKernels&) = delete;

  std::vector<std::string> variants() const;
  bool has(const std::string& variant) const;

  // One launch argument: a tensor (its data pointer), an i32, an i64 or an fp32.
  using Arg = std::variant<at::Tensor, int32_t, int64_t, float>;
  // args: the kernel's non-constexpr parameters in order (the scratch pointers are added here).
  void launch(const std::string& variant, std::array<uint32_t, 3> grid, const std::vector<Arg>& args) const;

  // x [..., D] contiguous; weight [D] -> y (and, with a residual, x + residual as well); ROWS rows a program
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) const;
  std::pair<at::Tensor, at::Tensor> rms_norm_residual(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) const;
  // qkv [N, (H + 2G) * E] contiguous (the q/k/v GEMM's output); positions [N] int64; cos/sin [P, E]
  // (the RoPE tables); q_norm/k_norm [E] or undefined -> q [N, H, E], k, v [N, G, E]: the split, q/k
  // RMSNorm, RoPE at positions + pos_offset and the v copy. k_out/v_out: [N, G, E] views with one
  // row stride (a multiple of 8 elements) to write k and v into, or undefined (fresh tensors).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& positions,
                                                          int64_t pos_offset, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t num_heads,
                                                          int64_t num_kv_heads, const at::Tensor& q_norm,
                                                          const at::Tensor& k_norm, double eps,
                                                          const at::Tensor& k_out = at::Tensor(),
                                                          const at::Tensor& v_out = at::Tensor()) const;
  // gate_up [N, 2I] contiguous -> silu(gate) * up [N, I]
  at::Tensor silu_mul(const at::Tensor& gate_up) const;
  // The kernels that end in an FP8 GEMM's activation (kernels/norm_act.py's _fp8 variants,
  // kernels/fp8_linear.py's quantizer; bfloat16 only): e4m3 rows and a float32 scale a row, equal to
  // layer_ops.h's quantize_rows of the plain kernel's output.
  // x [M, K] contiguous -> (q [M, K] e4m3, scale [M])
  std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) const;
  // rms_norm / rms_norm_residual, quantized: (q, scale), and with a residual (q, scale, x + residual)
  std::pair<at::Tensor, at::Tensor> rms_norm_fp8(const at::Tensor& x, const at::Tensor& weight, double eps) const;
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_residual_fp8(const at::Tensor& x, const at::Tensor& residual,
                                                                       const at::Tensor& weight, double eps) const;
  // silu_mul, quantized: gate_up [N, 2I] -> (q [N, I] e4m3, scale [N])
  std::pair<at::Tensor, at::Tensor> silu_mul_fp8(const at::Tensor& gate_up) const;
  // q [T, H, E]; k, v [T, G, E] (the same rows' keys); key_ranges [3, T] int32 (layer_ops.h
  // segment_key_ranges: each row's prefix keys and own segment's first row) -> out [T, H, E]; a row
  // with no key (padding) gets 0. Score and BeamSearch-prefill attention in one kernel.
  at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& key_ranges, double scale) const;
  // A decode step's attention from the q/k/v GEMM's output (kernels/decode_attention.py::
  // decode_attention_qkv, qkv_rope's work included): qkv [N, (H + 2G) * E]; positions [N] int64 (+
  // pos_offset); cos/sin [P, E]; q_norm/k_norm [E] or undefined; prompt_k/v [P, G, E]; kv_start/kv_len
  // [N] int64; suffix_k/v [N, S, G, E]: each row's k and v go into its own slot num_suffix - 1, then
  // the row attends to its prompt range and its first num_suffix slots, slot j from row
  // suffix_rows[row, j] ([N, S] int64: the row's beam's ancestor at step j) -> out [N, H, E]
  at::Tensor decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& positions, int64_t pos_offset,
                                  const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                                  const at::Tensor& q_norm, const at::Tensor& k_norm, double eps,
                                  const at::Tensor& prompt_k, const at::Tensor& prompt_v, const at::Tensor& kv_start,
                                  const at::Tensor& kv_len, const at::Tensor& suffix_k, const at::Tensor& suffix_v,
                                  const at::Tensor& suffix_rows, int64_t num_suffix, double scale) const;
  // The beam step's per-row selection (kernels/beam_topk.py::beam_candidates): logits [rows, V]
  // (packed beam rows, contiguous); beam_scores [ranks] float32 (the [R, P] bookkeeping flattened;
  // -inf: a dead beam); allowed: undefined or an int32 [rows, ceil(V / 32)] token bitmask; slot
  // [rows] int64 (each row's rank; >= ranks: padding) and src [ranks] int64 (each rank's row; >= rows:
  // none), both undefined: the rows are the ranks -> keys [ranks, num_candidates] int64, each rank's
  // best candidates first (score, then flat index (rank % num_parents) * V + token); NO_KEY for a
  // rank without a row.
  at::Tensor beam_candidates(const at::Tensor& logits, const at::Tensor& beam_scores, int64_t num_candidates,
                             int64_t num_parents, const at::Tensor& allowed = at::Tensor(),
                             const at::Tensor& slot = at::Tensor(), const at::Tensor& src = at::Tensor()) const;
  // The B best of each request's keys, best first (kernels/beam_topk.py::beam_merge): keys [R x P, K]
  // int64 (beam_candidates' output, unique) -> [R, num_beams], in rounds over chunks of keys (a view of
  // keys when a request has num_beams of them: one parent, the first token).
  at::Tensor beam_merge(const at::Tensor& keys, int64_t num_requests, int64_t num_beams) const;
  // A beam step's bookkeeping from the B best keys of each request (kernels/beam_topk.py::beam_commit):
  // top [R, B], seqs [R, B, n], widths [R], slot [N], src [R * B] (undefined: the first token), codes
  // [C] or undefined, all int64 -> (seqs with the parents' sequences and the new tokens at column step,
  // scores [R, B] float32 (-inf past each width), parents, tokens [R, B], row_tokens [N], parent_rows
  // [N] (undefined for the first token), and with suffix_rows [N, S] (a decode step's) the next
  // step's: each row's parent row's for slots 0..step-1, its own for the rest (else undefined)).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> beam_commit(
      const at::Tensor& top, const at::Tensor& seqs, const at::Tensor& widths, const at::Tensor& slot, int64_t vocab,
      int64_t step, const at::Tensor& src = at::Tensor(), const at::Tensor& codes = at::Tensor(),
      const at::Tensor& suffix_rows = at::Tensor()) const;
  // A catalog trie's lookups (kernels/trie.py; the forest of catalog_forest.h: int64 offsets, edge
  // tokens and children). trie [rows] int64 nodes (-1: unconstrained) -> the allowed-token bitmask
  // [rows, num_words] int32 that beam_candidates takes (cols [V] int64: the code column of each token,
  // or undefined: the columns are the tokens).
  at::Tensor trie_allowed(const at::Tensor& trie, const at::Tensor& offsets, const at::Tensor& tokens,
                          const at::Tensor& cols, int64_t num_words) const;
  // trie, next_tokens [...] int64 (one shape) -> the child along each token [...] int64 (-1: none)
  at::Tensor trie_advance(const at::Tensor& trie, const at::Tensor& next_tokens, const at::Tensor& offsets,
                          const at::Tensor& tokens, const at::Tensor& child) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace slmrank
