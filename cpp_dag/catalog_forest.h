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

// Room in the forest (catalog.py::ForestCapacity): trie nodes, edges, children at a node; 0 = exactly
// what the tries need.
struct ForestCapacity {
  int64_t nodes = 0, edges = 0, window = 0;
};

// catalog.offsets [nodes + 1] (nodes past the last real one: no children), catalog.tokens /
// catalog.child [edges + 1] (past the real edges, padding edges: token 0, child -1), catalog.roots
// [C + 1] (then -1: unconstrained), catalog.window = arange(K), K the most children a node has; the
// sizes from `capacity` where set; all int64 on `device`. std::invalid_argument when the tries need
// more room than `capacity` holds.
WeightMap catalog_forest(const std::vector<CatalogTrie>& tries, at::Device device, ForestCapacity capacity = {});

}  // namespace slmrank
