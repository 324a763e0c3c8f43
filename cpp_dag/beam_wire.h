// A BeamSearchResponse written as protobuf wire bytes straight from a request's output rows: the
// beams' ids (packed varints), log-probs (float32) and texts (the tokens' bytes joined, made valid
// UTF-8 the way Python's bytes.decode("utf-8", errors="replace") does). The event loop spent ~4 us
// a beam doing this in Python; a W5 response has 400 beams.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace slmrank {

class BeamWire {
 public:
  // tokens[i]: token i's bytes, or nullopt for an id that is no token; model_vocab: ids at or
  // above it are not the model's (an error of the runtime, reported by the Python path)
  BeamWire(std::vector<std::optional<std::string>> tokens, int64_t model_vocab);

  // seqs [w, n] int64, scores [w] float32, both on the CPU. nullopt when a beam holds an id that
  // is no token or not the model's: the caller's slower path handles (or reports) those.
  std::optional<std::string> encode(const at::Tensor& seqs, const at::Tensor& scores) const;

  int64_t num_tokens() const { return static_cast<int64_t>(offsets_.size()) - 1; }

 private:
  std::string bytes_;             // every token's bytes, concatenated
  std::vector<int64_t> offsets_;  // token i is bytes_[offsets_[i], offsets_[i + 1])
  std::vector<uint8_t> known_;    // 1 where token i exists
  int64_t model_vocab_;
};

// bytes.decode("utf-8", errors="replace").encode("utf-8"): each maximal ill-formed subpart
// becomes one U+FFFD (Unicode's recommended practice, which CPython follows).
void append_utf8_replaced(const char* data, size_t size, std::string& out);

}  // namespace slmrank
