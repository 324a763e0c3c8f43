// See catalog_forest.h.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "catalog_forest.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace slmrank {

WeightMap catalog_forest(const std::vector<CatalogTrie>& tries, at::Device device, ForestCapacity capacity) {
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
  const int64_t nodes = capacity.nodes > 0 ? capacity.nodes : node_base;
  const int64_t edges = capacity.edges > 0 ? capacity.edges : edge_base;
  const int64_t window = capacity.window > 0 ? capacity.window : widest;
  if (nodes < node_base || edges < edge_base || window < widest) {
    throw std::invalid_argument("the catalogs need " + std::to_string(node_base) + " trie nodes, " +
                                std::to_string(edge_base) + " edges, " + std::to_string(widest) +
                                " children at a node; the forest holds room for " + std::to_string(nodes) + ", " +
                                std::to_string(edges) + ", " + std::to_string(window));
  }
  offsets.push_back(at::full({nodes - node_base}, edge_base, i64));
  tokens.push_back(at::zeros({edges - edge_base + 1}, i64));
  child.push_back(at::full({edges - edge_base + 1}, -1, i64));
  roots.push_back(-1);
  return {{"catalog.offsets", at::cat(offsets).to(device)},
          {"catalog.tokens", at::cat(tokens).to(device)},
          {"catalog.child", at::cat(child).to(device)},
          {"catalog.roots", at::tensor(roots, i64).to(device)},
          {"catalog.window", at::arange(window, i64.device(device))}};
}

}  // namespace slmrank
