// Reads a .safetensors file with no Python: 8-byte little-endian header length, a JSON header
// ({name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}), then the tensor bytes.
// Offsets and sizes are validated against the file as the reference implementation does
// (tensors tile the data section exactly); any violation throws std::runtime_error naming the file.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace slmrank {

struct SafetensorsFile {
  std::vector<std::pair<std::string, at::Tensor>> tensors;  // in header order
  std::map<std::string, std::string> metadata;               // "__metadata__"
};

// Reads the tensor data into one host buffer (each tensor at its file offset modulo the page size,
// as load_file's mmap places it), then moves every tensor to `device`; floating-point tensors are
// cast to `dtype` when given (integer and bool tensors keep theirs, and so do the tensors named in
// `keep`: an artifact's fp8 weights and their float32 scales).
SafetensorsFile read_safetensors(const std::string& path, at::Device device = at::kCPU,
                                 std::optional<at::ScalarType> dtype = std::nullopt,
                                 const std::set<std::string>& keep = {});

}  // namespace slmrank
