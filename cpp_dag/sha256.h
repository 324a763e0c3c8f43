// SHA-256 (FIPS 180-4), streamed: verifies the artifact's files against the manifest's digests.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace slmrank {

class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t size);
  std::array<uint8_t, 32> finish();  // the object is spent afterwards

 private:
  void compress(const uint8_t* block);  // one 64-byte block
  uint32_t state_[8];
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string to_hex(const uint8_t* data, size_t size);
// Lower-case hex digest of a file, read in 1 MiB chunks; throws std::runtime_error naming the path.
std::string sha256_file(const std::string& path);

}  // namespace slmrank
