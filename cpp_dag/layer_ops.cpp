#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "layer_ops.h"

#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_mm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/where.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/constant_pad_nd.h>

#include <limits>

#include "attention_merge.h"
#include "triton_kernels.h"

namespace slmrank {
namespace {

c10::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// k: [..., G, E] -> [..., H, E]; query head h reads kv head h / (H/G)
at::Tensor expand_kv(const at::Tensor& k, int64_t num_heads) {
  auto sizes = k.sizes().vec();
  const int64_t e = sizes.back(), g = sizes[sizes.size() - 2];
  std::vector<int64_t> expanded(sizes.begin(), sizes.end() - 1);
  expanded.push_back(num_heads / g);
  expanded.push_back(e);
  std::vector<int64_t> merged(sizes.begin(), sizes.end() - 2);
  merged.push_back(num_heads);
  merged.push_back(e);
  return k.unsqueeze(-2).expand(expanded).reshape(merged);
}

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf.mul(xf.pow(2).mean({-1}, /*keepdim=*/true).add(eps).rsqrt());
  return weight.mul(xf.to(x.scalar_type()));
}

constexpr double kE4m3Max = 448.0;  // kernels/fp8_linear.py E4M3_MAX

std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& t) {
  at::Tensor tf = t.to(at::kFloat);
  at::Tensor amax = tf.abs().amax({-1}, /*keepdim=*/true);  // [M, 1]
  // a tensor divisor: CUDA multiplies by a CPU scalar's reciprocal instead (kernels/fp8_linear.py)
  at::Tensor scale = at::where(amax.gt(0), amax.div(at::full_like(amax, kE4m3Max)), at::ones_like(amax));
  at::Tensor q = tf.div(scale).clamp(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
  return {q, scale.squeeze(-1)};
}

namespace {
// kernels/fp8_linear.py::uses_scaled_mm: CUDA, bfloat16 activations, the weight's K and N multiples of 16
bool uses_scaled_mm(const at::Tensor& x, const at::Tensor& w_q) {
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && w_q.size(1) % 16 == 0 && w_q.size(0) % 16 == 0;
}
}  // namespace

at::Tensor scaled_linear(const at::Tensor& a_q, const at::Tensor& s_a, const at::Tensor& w_q, const at::Tensor& w_scale,
                         const at::Tensor& bias) {
  at::Tensor y = at::_scaled_mm(a_q, w_q.t(), s_a.unsqueeze(1), w_scale.unsqueeze(0), c10::nullopt, c10::nullopt,
                                at::kBFloat16);
  return bias.defined() ? y.add(bias) : y;
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale, const at::Tensor& bias) {
  auto [a_q, s_a] = quantize_rows(x);
  if (uses_scaled_mm(x, w_q)) return scaled_linear(a_q, s_a, w_q, w_scale, bias);
  at::Tensor y = at::mm(a_q.to(at::kFloat), w_q.to(at::kFloat).t()).mul(s_a.unsqueeze(1)).mul(w_scale.unsqueeze(0));
  if (bias.defined()) y = y.add(bias.to(at::kFloat));
  return y.to(x.scalar_type());
}

LayerWeights at_rows(const Context& ctx, int64_t layer, int64_t rows) {
  LayerWeights v = ctx.layers.at(layer);
  const std::string p = "layers." + std::to_string(layer) + ".";
  std::tie(v.wqkv, v.wqkv_scale) = ctx.gemm_weight(p + "wqkv", rows);
  std::tie(v.wo, v.wo_scale) = ctx.gemm_weight(p + "wo", rows);
  std::tie(v.wgu, v.wgu_scale) = ctx.gemm_weight(p + "wgu", rows);
  std::tie(v.wdown, v.wdown_scale) = ctx.gemm_weight(p + "wdown", rows);
  return v;
}

bool fp8_in_kernel(const TritonKernels* fused, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_scale) {
  return fused != nullptr && w_scale.defined() && w_q.scalar_type() == at::kFloat8_e4m3fn && uses_scaled_mm(x, w_q);
}

// model/layers.py::linear: on the CPU, a call of fewer than 12 rows that are no multiple of 4 gets zero
// rows up to the next multiple of 4 (MKL rounds the rows past the last 4 of such a call differently).
at::Tensor linear(const Activation& a, const at::Tensor& w, const at::Tensor& bias, const at::Tensor& scale) {
  if (a.scale.defined()) return scaled_linear(a.x, a.scale, w, scale, bias);  // quantized by the kernel before
  const at::Tensor& x = a.x;
  const int64_t m = x.size(0);
  const int64_t pad = (x.dim() == 2 && x.device().is_cpu() && m < 12) ? (4 - m % 4) % 4 : 0;
  const at::Tensor in = pad ? at::constant_pad_nd(x, {0, 0, 0, pad}) : x;
  at::Tensor y = scale.defined() ? fp8_linear(in, w, scale, bias) : at::linear(in, w, opt(bias));
  return pad ? y.slice(0, 0, m) : y;
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({x.slice(-1, half).neg(), x.slice(-1, 0, half)}, -1);
  return x.mul(cos.unsqueeze(1)).add(rotated.mul(sin.unsqueeze(1)));
}

std::pair<at::Tensor, at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& pending,
                                                   const at::Tensor& weight, double eps, const TritonKernels* fused) {
  if (fused) {
    if (!pending.defined()) return {x, fused->rms_norm(x, weight, eps)};
    auto [h, total] = fused->rms_norm_residual(pending, x, weight, eps);
    return {total, h};
  }
  at::Tensor y = pending.defined() ? x.add(pending) : x;
  return {y, rms_norm(y, weight, eps)};
}

std::pair<at::Tensor, Activation> residual_rms_norm_for(const at::Tensor& x, const at::Tensor& pending,
                                                        const at::Tensor& weight, double eps,
                                                        const TritonKernels* fused, const at::Tensor& w_q,
                                                        const at::Tensor& w_scale) {
  if (!fp8_in_kernel(fused, x, w_q, w_scale)) return residual_rms_norm(x, pending, weight, eps, fused);
  if (!pending.defined()) {
    auto [q, s] = fused->rms_norm_fp8(x, weight, eps);
    return {x, Activation(q, s)};
  }
  auto [q, s, total] = fused->rms_norm_residual_fp8(pending, x, weight, eps);
  return {total, Activation(q, s)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_projection(const ModelConfig& cfg, const LayerWeights& w,
                                                              const Activation& h, const at::Tensor& positions,
                                                              int64_t pos_offset, const at::Tensor& rope_cos,
                                                              const at::Tensor& rope_sin, const TritonKernels* fused,
                                                              const at::Tensor& k_out, const at::Tensor& v_out) {
  const int64_t n = h.x.size(0);
  const double eps = cfg.rms_norm_eps;
  at::Tensor qkv = linear(h, w.wqkv, w.bqkv, w.wqkv_scale);  // the bias rides in the GEMM's epilogue: one rounding
  if (fused) {
    const bool norm = cfg.qk_norm;
    return fused->qkv_rope(qkv, positions, pos_offset, rope_cos, rope_sin, cfg.num_heads, cfg.num_kv_heads,
                           norm ? w.q_norm : at::Tensor(), norm ? w.k_norm : at::Tensor(), eps, k_out, v_out);
  }
  auto parts = qkv.split_with_sizes({cfg.q_size(), cfg.kv_size(), cfg.kv_size()}, -1);
  at::Tensor q = parts[0].reshape({n, cfg.num_heads, cfg.head_dim});
  at::Tensor k = parts[1].reshape({n, cfg.num_kv_heads, cfg.head_dim});
  at::Tensor v = parts[2].reshape({n, cfg.num_kv_heads, cfg.head_dim});
  if (cfg.qk_norm) {
    q = rms_norm(q, w.q_norm, eps);
    k = rms_norm(k, w.k_norm, eps);
  }
  const at::Tensor rows = pos_offset != 0 ? positions.add(pos_offset) : positions;
  const at::Tensor cos = rope_cos.index_select(0, rows), sin = rope_sin.index_select(0, rows);
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  v = v.contiguous();
  if (k_out.defined()) k = k_out.copy_(k);
  if (v_out.defined()) v = v_out.copy_(v);
  return {q, k, v};
}

std::pair<at::Tensor, at::Tensor> attention_output_and_mlp(const ModelConfig& cfg, const LayerWeights& w,
                                                           const at::Tensor& x, const at::Tensor& attn,
                                                           const TritonKernels* fused) {
  Activation a(attn.reshape({x.size(0), cfg.q_size()}));
  if (fp8_in_kernel(fused, a.x, w.wo, w.wo_scale)) {  // the attention's output quantized in one kernel
    auto [q, s] = fused->quantize_rows(a.x);
    a = Activation(q, s);
  }
  const at::Tensor o = linear(a, w.wo, at::Tensor(), w.wo_scale);
  if (fused) {  // residual add + norm in one kernel, then SiLU(gate)*up in one (each quantizing for an FP8 GEMM)
    auto [y, h] = residual_rms_norm_for(x, o, w.mlp_norm, cfg.rms_norm_eps, fused, w.wgu, w.wgu_scale);
    const at::Tensor gate_up = linear(h, w.wgu, at::Tensor(), w.wgu_scale);
    Activation act;
    if (fp8_in_kernel(fused, gate_up, w.wdown, w.wdown_scale)) {
      auto [q, s] = fused->silu_mul_fp8(gate_up);
      act = Activation(q, s);
    } else {
      act = Activation(fused->silu_mul(gate_up));
    }
    return {y, linear(act, w.wdown, at::Tensor(), w.wdown_scale)};
  }
  at::Tensor y = x.add(o);
  at::Tensor h = rms_norm(y, w.mlp_norm, cfg.rms_norm_eps);
  auto gate_up = linear(h, w.wgu, at::Tensor(), w.wgu_scale).chunk(2, -1);
  return {y, linear(at::silu(gate_up[0]).mul(gate_up[1]), w.wdown, at::Tensor(), w.wdown_scale)};
}

std::tuple<at::Tensor, at::Tensor> masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& mask, double scale) {
  const int64_t h = q.size(1);
  at::Tensor kx = expand_kv(k, h), vx = expand_kv(v, h);
  at::Tensor s = q.transpose(0, 1).matmul(kx.permute({1, 2, 0})).to(at::kFloat).mul(scale);  // [H, N, M]
  at::Tensor hidden = mask.bitwise_not();
  s = s.masked_fill(hidden, kNegInf);
  at::Tensor lse = s.logsumexp({-1});  // [H, N]
  at::Tensor p = s.sub(lse.unsqueeze(-1)).exp().masked_fill(hidden, 0.0);
  at::Tensor out = p.to(v.scalar_type()).matmul(vx.transpose(0, 1));  // [H, N, E]
  return {out.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()};
}

at::Tensor segment_bounds(const at::Tensor& seg, int64_t num_segments, int64_t pad_chunk) {
  const int64_t t = seg.size(0);
  at::Tensor rows = at::arange(t, seg.options().dtype(at::kLong));
  at::Tensor first = at::ones({1}, seg.options().dtype(at::kBool));
  at::Tensor starts = at::cat({first, seg.slice(0, 1).ne(seg.slice(0, 0, t - 1))});
  if (pad_chunk > 0) starts = starts.logical_or(seg.lt(0).logical_and(rows.remainder(pad_chunk).eq(0)));
  at::Tensor index = starts.cumsum(0).sub(1);
  at::Tensor bounds = at::full({num_segments + 1}, t, seg.options().dtype(at::kInt));
  return bounds.scatter_reduce(0, index, rows.to(at::kInt), "amin");
}

at::Tensor segment_key_ranges(const at::Tensor& seg, const at::Tensor& ctx, const at::Tensor& request_rows,
                              const at::Tensor& prefix_rows) {
  const int64_t t = seg.size(0);
  at::Tensor rows = at::arange(t, seg.options().dtype(at::kLong));
  at::Tensor first = at::ones({1}, seg.options().dtype(at::kBool));
  at::Tensor starts = at::cat({first, seg.slice(0, 1).ne(seg.slice(0, 0, t - 1))});
  at::Tensor run_start = std::get<0>(rows.mul(starts).cummax(0));  // each row's run's first row
  at::Tensor self_start = run_start.where(seg.ge(0), rows.add(1));
  at::Tensor prefix_start, prefix_end;
  if (!ctx.defined()) {
    prefix_start = prefix_end = at::zeros_like(rows);
  } else {
    // each row's request: how many requests end at or before it
    at::Tensor request = at::searchsorted(request_rows.slice(0, 1).contiguous(), rows, false, true);
    at::Tensor has_prefix = ctx.ge(0);
    prefix_start = request_rows.index_select(0, request).mul(has_prefix);  // the request's first row
    prefix_end = prefix_start.add(prefix_rows.index_select(0, request).mul(has_prefix));
  }
  return at::stack({prefix_start, prefix_end, self_start}).to(at::kInt);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                                                    int64_t max_k, bool causal, double scale,
                                                    const at::Tensor& seqused_k) {
  auto result = at::_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, false, scale,
                                             std::nullopt, std::nullopt, opt(seqused_k));
  return {std::get<0>(result), std::get<1>(result).t()};
}

std::tuple<at::Tensor, at::Tensor> rowwise_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     double scale) {
  const int64_t h = q.size(1);
  at::Tensor kx = expand_kv(k, h), vx = expand_kv(v, h);  // [N, T, H, E]
  at::Tensor s = q.unsqueeze(2).matmul(kx.permute({0, 2, 3, 1})).to(at::kFloat).mul(scale);  // [N, H, 1, T]
  at::Tensor lse = s.logsumexp({-1});
  at::Tensor p = s.sub(lse.unsqueeze(-1)).exp();
  at::Tensor out = p.to(v.scalar_type()).matmul(vx.transpose(1, 2));  // [N, H, 1, E]
  return {out.squeeze(2).contiguous(), lse.squeeze(2).contiguous()};
}

at::Tensor two_part_attention(const at::Tensor& q, const at::Tensor& k_a, const at::Tensor& v_a,
                              const at::Tensor& mask_a, const at::Tensor& k_b, const at::Tensor& v_b,
                              const at::Tensor& mask_b, double scale) {
  auto [out_a, lse_a] = masked_attention(q, k_a, v_a, mask_a, scale);
  auto [out_b, lse_b] = mask_b.defined() ? masked_attention(q, k_b, v_b, mask_b, scale)
                                         : rowwise_attention(q, k_b, v_b, scale);
  return merge_attention_states(out_a, lse_a, out_b, lse_b, nullptr);
}

std::vector<std::pair<int64_t, int64_t>> attention_blocks(const at::Tensor& mask, const at::Tensor& mask_ctx) {
  const at::Tensor vis = mask_ctx.defined() ? mask.logical_or(mask_ctx) : mask;
  const int64_t n = vis.size(0);
  const at::Tensor rows = at::arange(n, vis.options().dtype(at::kLong));
  const at::Tensor first = at::where(vis.any(1), vis.to(at::kByte).argmax(1), rows);  // the first key each row sees
  const at::Tensor reach = std::get<0>(first.flip({0}).cummin(0)).flip({0});  // ... any row from i on sees
  const at::Tensor starts = rows.masked_select(reach.eq(rows)).contiguous();
  const int64_t* p = starts.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t j = 0; j < starts.numel(); ++j) out.emplace_back(p[j], j + 1 < starts.numel() ? p[j + 1] : n);
  return out;
}

at::Tensor blockwise_self_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& mask, const at::Tensor& mask_ctx, double scale) {
  at::Tensor out = at::empty_like(q);
  for (const auto& [s, e] : attention_blocks(mask, mask_ctx)) {
    const at::Tensor qb = q.slice(0, s, e), kb = k.slice(0, s, e), vb = v.slice(0, s, e);
    const at::Tensor mb = mask.slice(0, s, e).slice(1, s, e);
    if (!mask_ctx.defined()) {
      out.slice(0, s, e).copy_(std::get<0>(masked_attention(qb, kb, vb, mb, scale)));
    } else {
      out.slice(0, s, e).copy_(two_part_attention(qb, kb, vb, mask_ctx.slice(0, s, e).slice(1, s, e), kb, vb, mb, scale));
    }
  }
  return out;
}

std::vector<std::array<int64_t, 4>> attention_runs(const at::Tensor& mask) {
  const at::Tensor count = mask.sum(1);
  const at::Tensor first = at::where(count.gt(0), mask.to(at::kByte).argmax(1), 0).contiguous();
  const at::Tensor cnt = count.contiguous();
  const int64_t n = mask.size(0);
  const int64_t *f = first.data_ptr<int64_t>(), *c = cnt.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 4>> out;
  for (int64_t r = 0; r < n; ++r) {
    if (r == 0 || f[r] != f[r - 1] || c[r] != c[r - 1]) {
      out.push_back({r, r + 1, f[r], f[r] + c[r]});
    } else {
      out.back()[1] = r + 1;
    }
  }
  return out;
}

at::Tensor two_part_attention_by_runs(const at::Tensor& q, const at::Tensor& k_a, const at::Tensor& v_a,
                                      const at::Tensor& mask_a, const at::Tensor& k_b, const at::Tensor& v_b,
                                      double scale) {
  at::Tensor out_a = at::zeros_like(q);
  at::Tensor lse_a = at::full({q.size(0), q.size(1)}, -std::numeric_limits<double>::infinity(),
                              q.options().dtype(at::kFloat));
  for (const auto& [r0, r1, k0, k1] : attention_runs(mask_a)) {
    if (k1 <= k0) continue;
    auto [o, l] = masked_attention(q.slice(0, r0, r1), k_a.slice(0, k0, k1), v_a.slice(0, k0, k1),
                                   mask_a.slice(0, r0, r1).slice(1, k0, k1), scale);
    out_a.slice(0, r0, r1).copy_(o);
    lse_a.slice(0, r0, r1).copy_(l);
  }
  auto [out_b, lse_b] = rowwise_attention(q, k_b, v_b, scale);
  return merge_attention_states(out_a, lse_a, out_b, lse_b, nullptr);
}

}  // namespace slmrank
