// See catalog_forest.h.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "catalog_forest.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

namespace slmrank {

WeightMap catalog_forest(const std::vector<CatalogTrie>& tries, at::Device device) {
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  std::vector<at::Tensor> offsets = {at::zeros({1}, i64)}, tokens, child;
  std::vector<int64_t> roots;
  int64_t node_base = 0, edge_base = 0, widest = 1;
  for (const CatalogTrie& t : tries) {
    const at::Tensor off = t.offsets.to(at::kLong), tok = t.tokens.to(at::kLong);
    const int64_t nodes = off.size(0) - 1, edges = tok.size(0);
    offsets.push_back(off.slice(0, 1).add(edge_base));
    tokens.push_back(tok);
    child.push_back(at::arange(1, edges + 1, i64).add(node_base));
    roots.push_back(node_base);
    if (nodes > 0) widest = std::max(widest, off.slice(0, 1).sub(off.slice(0, 0, nodes)).max().item<int64_t>());
    node_base += nodes;
    edge_base += edges;
  }
  tokens.push_back(at::zeros({1}, i64));
  child.push_back(at::full({1}, -1, i64));
  roots.push_back(-1);
  return {{"catalog.offsets", at::cat(offsets).to(device)},
          {"catalog.tokens", at::cat(tokens).to(device)},
          {"catalog.child", at::cat(child).to(device)},
          {"catalog.roots", at::tensor(roots, i64).to(device)},
          {"catalog.window", at::arange(widest, i64.device(device))}};
}

}  // namespace slmrank
