// The catalogs' tries as one CSR forest: the constants of the beam_allowed node.
// service/artifact/catalog.py::trie_forest builds the same tensors from the same files.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "dag.h"

namespace slmrank {

// One catalog's trie (service/artifact/catalog.py): BFS CSR, child of edge e is node e + 1.
struct CatalogTrie {
  at::Tensor offsets;  // int64 [nodes + 1]
  at::Tensor tokens;   // int32 [edges]
};

// catalog.offsets [nodes + 1], catalog.tokens / catalog.child [edges + 1] (one padding edge: token 0,
// child -1), catalog.roots [C + 1] (then -1: unconstrained), catalog.window = arange(K), K the most
// children a node has; all int64 on `device`.
WeightMap catalog_forest(const std::vector<CatalogTrie>& tries, at::Device device);

}  // namespace slmrank
