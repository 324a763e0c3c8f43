// The decoder's building blocks over ATen. Each mirrors, op for op, its Python reference
// (service/model/layers.py, kernels/attention.py) so the two runtimes agree byte for byte.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "dag.h"

namespace slmrank {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// t [M, K] -> (e4m3 [M, K], float32 scale [M]): per row scale = amax / 448 (a zero row: 1), the
// quotient clamped to +-448. kernels/fp8_linear.py::quantize_rows, op for op.
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& t);

// x [M, K] @ the e4m3 weight w_q [N, K] with per-output-channel scales w_scale [N] (float32), + bias
// -> [M, N] in x's dtype; the activations quantized per row here. The float32 emulation, or on CUDA
// in bfloat16 scaled_linear. kernels/fp8_linear.py::fp8_linear, op for op.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale, const at::Tensor& bias);

// The CUDA FP8 GEMM: e4m3 rows a_q [M, K] with their scales s_a [M] @ w_q [N, K] (scales w_scale [N])
// by at::_scaled_mm (float32 accumulation, bfloat16 out), + bias in bfloat16.
// kernels/fp8_linear.py::scaled_linear.
at::Tensor scaled_linear(const at::Tensor& a_q, const at::Tensor& s_a, const at::Tensor& w_q, const at::Tensor& w_scale,
                         const at::Tensor& bias);

// A GEMM's input: activations `x`, or, with `scale` defined, e4m3 rows `x` and their float32 scales,
// made for an FP8 GEMM by the kernel that produced them (fp8_in_kernel). layers.py::Quantized.
struct Activation {
  Activation(at::Tensor x_ = at::Tensor(), at::Tensor scale_ = at::Tensor())  // NOLINT: a tensor is an Activation
      : x(std::move(x_)), scale(std::move(scale_)) {}
  at::Tensor x, scale;
};

// Whether the fused path quantizes the activations of the FP8 GEMM (w_q, w_scale) inside the kernel
// that produces them: Triton kernels, an e4m3 weight, x (the activations' dtype and device) bfloat16
// on CUDA, the weight's K and N multiples of 16 (scaled_linear's conditions). layers.py::fp8_in_kernel.
bool fp8_in_kernel(const TritonKernels* fused, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale);

// Layer `layer` for activations of `rows` rows: each GEMM weight as Context::gemm_weight gives it (an e4m3
// one below its row floor, `--fp8 mlp:2048`: its model-dtype copy, without a scale). layers.py::LayerWeights.at_rows.
LayerWeights at_rows(const Context& ctx, int64_t layer, int64_t rows);

// Every GEMM of the model: at::linear, or fp8_linear when `scale` is defined (an e4m3 weight), or
// scaled_linear when the activation comes quantized. service/model/layers.py::linear.
at::Tensor linear(const Activation& x, const at::Tensor& w, const at::Tensor& bias = at::Tensor(),
                  const at::Tensor& scale = at::Tensor());

// x: [N, heads, E]; cos/sin: [N, E] gathered at the tokens' positions
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// (x + pending, rms_norm(x + pending)); pending: the previous layer's MLP output [N, D], or
// undefined (nothing pending). With `fused`, the add and the norm are one Triton kernel.
std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& pending,
                                                   const at::Tensor& weight, double eps,
                                                   const TritonKernels* fused = nullptr);

// residual_rms_norm whose normed rows feed the GEMM (w_q, w_scale): quantized in the norm's kernel
// when fp8_in_kernel, else as residual_rms_norm. layers.py::residual_rms_norm_for.
std::pair<at::Tensor, Activation> residual_rms_norm_for(const at::Tensor& x, const at::Tensor& pending,
                                                        const at::Tensor& weight, double eps,
                                                        const TritonKernels* fused, const at::Tensor& w_q,
                                                        const at::Tensor& w_scale);

// h: [N, D] normed (or quantized for an FP8 q/k/v GEMM: Activation) -> q [N, H, E], k [N, G, E]
// (normed, rotated), v [N, G, E]; RoPE at positions + pos_offset ([N] int64) from the tables
// rope_cos/rope_sin [P, E]. k_out/v_out: [N, G, E] views (a decode step's suffix slot) that receive
// k and v and are returned, or undefined. With `fused`, the split, q/k norm, RoPE and v copy are one
// Triton kernel over the GEMM's output.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_projection(const ModelConfig& cfg, const LayerWeights& w,
                                                              const Activation& h, const at::Tensor& positions,
                                                              int64_t pos_offset, const at::Tensor& rope_cos,
                                                              const at::Tensor& rope_sin,
                                                              const TritonKernels* fused = nullptr,
                                                              const at::Tensor& k_out = at::Tensor(),
                                                              const at::Tensor& v_out = at::Tensor());

// o_proj with its residual add, then the SwiGLU MLP. x: [N, D]; attn: [N, H, E] ->
// (x + o_proj(attn), mlp_out): the MLP's output is left for the next norm to add (residual_rms_norm).
// With `fused`, the residual add + RMSNorm and SiLU(gate)*up are its Triton kernels.
std::pair<at::Tensor, at::Tensor> attention_output_and_mlp(const ModelConfig& cfg, const LayerWeights& w,
                                                           const at::Tensor& x, const at::Tensor& attn,
                                                           const TritonKernels* fused = nullptr);

// q [N, H, E]; k, v [M, G, E]; mask [N, M] bool -> out [N, H, E], lse [N, H] float32
std::tuple<at::Tensor, at::Tensor> masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& mask, double scale);

// seg [T] -> cu_seqlens [num_segments + 1] int32: the runs of equal ids (with pad_chunk > 0 a padding
// run, ids < 0, also ends at every multiple of pad_chunk); entries past the last run are T. Static
// shapes, no host sync. kernels/attention.py::segment_bounds.
at::Tensor segment_bounds(const at::Tensor& seg, int64_t num_segments, int64_t pad_chunk = 0);

// seg [T] (ids; < 0: padding) -> key_ranges [3, T] int32 of the fused segment attention: row t sees keys
// [out[0][t], out[1][t]) (its prefix) and [out[2][t], t] (its own run, causal; t + 1 for padding: none).
// ctx [T] (Score): a sample's prefix segment id (< 0: none); request_rows [R+1] each request's first
// row, then T; prefix_rows [R] each request's prefix length; ctx undefined: no prefix. Static shapes,
// no host sync. kernels/attention.py::segment_key_ranges.
at::Tensor segment_key_ranges(const at::Tensor& seg, const at::Tensor& ctx = at::Tensor(),
                              const at::Tensor& request_rows = at::Tensor(), const at::Tensor& prefix_rows = at::Tensor());

// FlashAttention varlen (CUDA): q [N, H, E]; k, v [M, G, E]; segment i: queries cu_q[i]..cu_q[i+1],
// keys from cu_k[i] (seqused_k[i] of them when defined) -> out [N, H, E], lse [N, H] float32
// (a row with no keys: out 0, lse not -inf: callers mask it). kernels/attention.py::varlen_attention.
std::tuple<at::Tensor, at::Tensor> varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                                                    int64_t max_k, bool causal, double scale,
                                                    const at::Tensor& seqused_k = at::Tensor());

// q [N, H, E]; k, v [N, T, G, E] (each row its own keys) -> out [N, H, E], lse [N, H] float32
std::tuple<at::Tensor, at::Tensor> rowwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale);

// Part A (shared keys under mask_a) merged with part B (mask_b, or per-row keys if undefined).
at::Tensor two_part_attention(const at::Tensor& q, const at::Tensor& k_a, const at::Tensor& v_a,
                              const at::Tensor& mask_a, const at::Tensor& k_b, const at::Tensor& v_b,
                              const at::Tensor& mask_b, double scale);

// model/layers.py::attention_blocks: the row ranges [s, e) of a packed batch's self-attention (mask,
// OR-ed with mask_ctx when defined; [T, T] bool) whose rows see only keys inside their own range.
// On the host (CPU only: a CUDA graph cannot hold sizes it reads back).
std::vector<std::pair<int64_t, int64_t>> attention_blocks(const at::Tensor& mask, const at::Tensor& mask_ctx);

// model/layers.py::blockwise_self_attention: masked_attention under mask (two_part_attention with the
// shared-prefix part under mask_ctx when defined), a block of attention_blocks at a time: a request's
// rows compute with the same shapes packed as alone (the same bytes on a CPU).
at::Tensor blockwise_self_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& mask, const at::Tensor& mask_ctx, double scale);

// model/layers.py::attention_runs: mask [N, M] (each row one contiguous range of keys) -> runs
// (r0, r1, k0, k1) of consecutive rows that see the same range [k0, k1). On the host: CPU only.
std::vector<std::array<int64_t, 4>> attention_runs(const at::Tensor& mask);

// model/layers.py::two_part_attention_by_runs: two_part_attention with part B per row and part A a
// run of attention_runs(mask_a) at a time, each over its own keys only.
at::Tensor two_part_attention_by_runs(const at::Tensor& q, const at::Tensor& k_a, const at::Tensor& v_a,
                                      const at::Tensor& mask_a, const at::Tensor& k_b, const at::Tensor& v_b,
                                      double scale);

}  // namespace slmrank
