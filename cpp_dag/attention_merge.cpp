#include "attention_merge.h"

#include <sstream>
#include <stdexcept>
#include <string>

namespace slmrank {
namespace {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream s;
  s << sizes;
  return s.str();
}

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("merge_attention_states: " + what);
}

void check_lse(const char* name, const at::Tensor& lse, at::IntArrayRef rows,
               const at::Device& device) {
  if (!lse.defined() || lse.sizes() != rows) {
    fail(std::string(name) + " must have shape [N, H] = " + shape_str(rows) + ", got " +
         (lse.defined() ? shape_str(lse.sizes()) : std::string("undefined")));
  }
  if (lse.scalar_type() != at::kFloat) fail(std::string(name) + " must be float32");
  if (lse.device() != device) fail(std::string(name) + " must be on out_a's device");
}

void check_inputs(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                  const at::Tensor& lse_b) {
  if (!out_a.defined() || out_a.dim() != 3) fail("out_a must be [N, H, E]");
  if (!at::isFloatingType(out_a.scalar_type())) fail("out_a must have a floating dtype");
  if (!out_b.defined() || out_b.sizes() != out_a.sizes()) {
    fail("out_b must have out_a's shape " + shape_str(out_a.sizes()) + ", got " +
         (out_b.defined() ? shape_str(out_b.sizes()) : std::string("undefined")));
  }
  if (out_b.scalar_type() != out_a.scalar_type()) fail("out_b must have out_a's dtype");
  const auto rows = out_a.sizes().slice(0, 2);  // [N, H]
  check_lse("lse_a", lse_a, rows, out_a.device());
  check_lse("lse_b", lse_b, rows, out_a.device());
  if (out_b.device() != out_a.device()) fail("out_b must be on out_a's device");
}

}  // namespace

at::Tensor merge_attention_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                  const at::Tensor& out_b, const at::Tensor& lse_b,
                                  at::Tensor* lse_out) {
  check_inputs(out_a, lse_a, out_b, lse_b);
  // Same ops, same order as merge_attention_states_ref: keep them in step.
  const at::Tensor m = lse_a.maximum(lse_b);  // [N, H]
  // Both sides empty: shift by 0 instead of -inf so the weights are exp(-inf) = 0, not NaN.
  const at::Tensor m_safe = m.masked_fill(m.isneginf(), 0.0);
  const at::Tensor w_a = lse_a.sub(m_safe).exp();  // in [0, 1]; one side is 1 unless both empty
  const at::Tensor w_b = lse_b.sub(m_safe).exp();
  const at::Tensor w_sum = w_a.add(w_b);  // in [1, 2], or 0 when both sides are empty
  at::Tensor lse = m_safe.add(w_sum.log());
  // An empty side's out rows may hold anything (NaN included): zero them, as 0 * NaN = NaN.
  const at::Tensor x_a = out_a.to(at::kFloat).masked_fill(lse_a.isneginf().unsqueeze(-1), 0.0);
  const at::Tensor x_b = out_b.to(at::kFloat).masked_fill(lse_b.isneginf().unsqueeze(-1), 0.0);
  const at::Tensor denom = w_sum.masked_fill(w_sum.eq(0), 1.0).unsqueeze(-1);  // [N, H, 1]
  at::Tensor out = w_a.unsqueeze(-1).mul(x_a).add(w_b.unsqueeze(-1).mul(x_b)).div(denom);
  if (lse_out != nullptr) *lse_out = std::move(lse);
  return out.to(out_a.scalar_type());
}

}  // namespace slmrank
