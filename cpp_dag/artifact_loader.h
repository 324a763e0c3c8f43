// Loads an artifact directory (service/artifact/artifact.py writes it) with no Python: the msgpack
// manifest (its sha256, manifest.sha256, verified before it is decoded; its fields checked against
// the schema), the model config and both DAGs, the safetensors weights (sha256-verified on request)
// and the RoPE tables, computed with the same ATen ops as service/model/layers.py::rope_table so that
// they are byte-identical to the Python runtime's.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "catalog_forest.h"
#include "dag.h"

namespace slmrank {

inline constexpr const char* kArtifactFormat = "slmrank-artifact";
inline constexpr int64_t kArtifactFormatVersion = 13;  // service/artifact/artifact.py FORMAT_VERSION

struct LoadedArtifact {
  std::string dir;
  ModelConfig cfg;
  at::Scalar rope_theta;  // as the manifest stores it (int or float), as Python would use it
  at::ScalarType dtype = at::kFloat;  // the compute dtype: the requested one, else the weights'
  WeightMap weights;                   // on the device, in dtype (fp8 weights e4m3, their NAME.scale float32)
  std::vector<std::string> fp8;        // weights.fp8: the e4m3 linear layers (mlp, attn, head), in order
  int64_t num_positions = 0;           // rows of the RoPE tables
  at::Tensor rope_cos, rope_sin;       // [num_positions, head_dim] in dtype
  std::vector<NodeSpec> score_dag, beam_dag;
  WeightMap catalogs;  // the catalogs' trie forest on the device (catalog_forest.h), catalog.* names
};

// Throws std::invalid_argument naming the file (and the field) for a missing, corrupted or
// mismatched artifact (a manifest whose sha256 does not match, unsupported format_version, a field
// of the wrong type or out of range, a file that is not a regular file, weights that do not match
// the config). verify: also check the weights' and the catalog tries' sha256 against the manifest.
// catalog_capacity: the room of the catalogs' forest (catalog_forest.h; default: exactly theirs).
LoadedArtifact load_artifact(const std::string& dir, at::Device device, std::optional<at::ScalarType> dtype,
                             bool verify, ForestCapacity catalog_capacity = {});

// service/model/layers.py::rope_table, op for op: cos, sin [num_positions, head_dim] float32.
std::pair<at::Tensor, at::Tensor> rope_table(int64_t head_dim, const at::Scalar& theta, int64_t num_positions,
                                             at::Device device);

// "float32" | "bfloat16" | "float16" (the manifest's names); throws std::invalid_argument otherwise.
at::ScalarType dtype_from_name(const std::string& name);

}  // namespace slmrank
