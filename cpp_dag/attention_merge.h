// Exact merge of two partial attention results over disjoint key sets (e.g. the shared
// prefix and the per-beam suffix) through their log-sum-exps.
//
// The plain-torch reference is kernels/attention_merge.py::merge_attention_states_ref. Both
// run the very same ATen ops in the very same order, so on one device they agree byte for
// byte; change one only together with the other.
#pragma once

#include <ATen/core/Tensor.h>

namespace slmrank {

// out_a, out_b: [N, H, E], same floating dtype (math runs in float32, result in out_a's dtype).
// lse_a, lse_b: [N, H] float32, natural-log LSE of the scaled scores; -inf means "no keys",
// and that side then contributes nothing (its out rows are ignored, even NaN).
// Returns out [N, H, E]; writes lse [N, H] float32 to *lse_out when lse_out is not null.
// Rows with no keys on either side give out 0 and lse -inf.
// Throws std::invalid_argument naming the offending argument.
at::Tensor merge_attention_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                  const at::Tensor& out_b, const at::Tensor& lse_b,
                                  at::Tensor* lse_out);

}  // namespace slmrank
