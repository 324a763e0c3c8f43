"""Exact merge of two partial attention results through their log-sum-exps (plain torch).

The C++ runtime's cpp_dag/attention_merge.cpp runs the very same ATen ops in the very same
order, so the two agree byte for byte on one device: change one only together with the other.
"""

import torch


def merge_attention_states_ref(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over disjoint key sets A and B into attention over A ∪ B.

    out_*: [N, H, E] of one floating dtype (math in float32, result in out_a's dtype).
    lse_*: [N, H] float32, natural-log LSE of the scaled scores; -inf means "no keys" and that
    side contributes nothing. Rows empty on both sides give out 0 and lse -inf.
    Returns (out [N, H, E], lse [N, H] float32). Inputs are not validated here; the C++ path is.
    """
    m = lse_a.maximum(lse_b)  # [N, H]
    # Both sides empty: shift by 0 instead of -inf so the weights are exp(-inf) = 0, not NaN.
    m_safe = m.masked_fill(m.isneginf(), 0.0)
    w_a = lse_a.sub(m_safe).exp()  # in [0, 1]; one side is 1 unless both are empty
    w_b = lse_b.sub(m_safe).exp()
    w_sum = w_a.add(w_b)  # in [1, 2], or 0 when both sides are empty
    lse = m_safe.add(w_sum.log())
    # An empty side's out rows may hold anything (NaN included): zero them, as 0 * NaN = NaN.
    x_a = out_a.to(torch.float32).masked_fill(lse_a.isneginf().unsqueeze(-1), 0.0)
    x_b = out_b.to(torch.float32).masked_fill(lse_b.isneginf().unsqueeze(-1), 0.0)
    denom = w_sum.masked_fill(w_sum.eq(0), 1.0).unsqueeze(-1)  # [N, H, 1]
    out = w_a.unsqueeze(-1).mul(x_a).add(w_b.unsqueeze(-1).mul(x_b)).div(denom)
    return out.to(out_a.dtype), lse
