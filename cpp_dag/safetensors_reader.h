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
// cast to `dtype` when given (integer and bool tensors keep theirs).
SafetensorsFile read_safetensors(const std::string& path, at::Device device = at::kCPU,
                                 std::optional<at::ScalarType> dtype = std::nullopt);

}  // namespace slmrank
