#include "beam_wire.h"

#include <cstring>
#include <stdexcept>

namespace slmrank {
namespace {

void put_varint(uint64_t v, std::string& out) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

// The length of the well-formed UTF-8 sequence at p (1-4), or 0 when it is ill-formed; then
// *subpart is the length of its maximal ill-formed subpart (>= 1), which becomes one U+FFFD.
size_t utf8_sequence(const unsigned char* p, size_t left, size_t* subpart) {
  const unsigned char b = p[0];
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    need = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 3;
    if (b == 0xE0) lo = 0xA0;   // no overlong forms
    if (b == 0xED) hi = 0x9F;   // no surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 4;
    if (b == 0xF0) lo = 0x90;   // no overlong forms
    if (b == 0xF4) hi = 0x8F;   // nothing above U+10FFFF
  } else {
    *subpart = 1;  // a continuation byte, C0, C1 or F5..FF: never the start of a character
    return 0;
  }
  size_t i = 1;
  for (; i < need && i < left; ++i) {
    const unsigned char c = p[i];
    const bool ok = i == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
    if (!ok) break;
  }
  if (i == need) return need;
  *subpart = i;  // the lead byte and the continuation bytes that could still have been valid
  return 0;
}

}  // namespace

void append_utf8_replaced(const char* data, size_t size, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  size_t i = 0, run = 0;  // [run, i): well-formed bytes not yet copied
  while (i < size) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    size_t subpart = 0;
    const size_t n = utf8_sequence(p + i, size - i, &subpart);
    if (n) {
      i += n;
      continue;
    }
    out.append(data + run, i - run);
    out.append("\xEF\xBF\xBD", 3);
    i += subpart;
    run = i;
  }
  out.append(data + run, size - run);
}

BeamWire::BeamWire(std::vector<std::optional<std::string>> tokens, int64_t model_vocab)
    : model_vocab_(model_vocab) {
  offsets_.reserve(tokens.size() + 1);
  known_.reserve(tokens.size());
  offsets_.push_back(0);
  for (auto& t : tokens) {
    if (t) bytes_ += *t;
    known_.push_back(t.has_value());
    offsets_.push_back(static_cast<int64_t>(bytes_.size()));
  }
}

std::optional<std::string> BeamWire::encode(const at::Tensor& seqs_in, const at::Tensor& scores_in) const {
  if (seqs_in.dim() != 2 || scores_in.dim() != 1 || seqs_in.size(0) != scores_in.size(0))
    throw std::invalid_argument("BeamWire.encode: seqs must be [w, n] and scores [w]");
  if (!seqs_in.device().is_cpu() || !scores_in.device().is_cpu())
    throw std::invalid_argument("BeamWire.encode: tensors must be on the CPU");
  const at::Tensor seqs = seqs_in.to(at::kLong).contiguous();
  const at::Tensor scores = scores_in.to(at::kFloat).contiguous();
  const int64_t w = seqs.size(0), n = seqs.size(1);
  const int64_t* ids = seqs.data_ptr<int64_t>();
  const float* lps = scores.data_ptr<float>();
  const int64_t table = num_tokens();
  for (int64_t k = 0; k < w * n; ++k) {
    const int64_t id = ids[k];
    if (id < 0 || id >= model_vocab_ || id >= table || !known_[id]) return std::nullopt;
  }
  std::string out, body, text, raw;
  out.reserve(static_cast<size_t>(w) * static_cast<size_t>(n * 3 + 40));
  for (int64_t b = 0; b < w; ++b) {
    const int64_t* row = ids + b * n;
    body.clear();
    if (n > 0) {  // field 1, ids: packed varints
      size_t packed = 0;
      for (int64_t j = 0; j < n; ++j) packed += varint_size(static_cast<uint64_t>(row[j]));
      body.push_back('\x0a');
      put_varint(packed, body);
      for (int64_t j = 0; j < n; ++j) put_varint(static_cast<uint64_t>(row[j]), body);
    }
    uint32_t bits;
    std::memcpy(&bits, lps + b, 4);
    if (bits != 0) {  // field 2, logprob: float32, left out at +0.0 as proto3 does
      body.push_back('\x15');
      for (int s = 0; s < 4; ++s) body.push_back(static_cast<char>((bits >> (8 * s)) & 0xFF));
    }
    raw.clear();
    for (int64_t j = 0; j < n; ++j) raw.append(bytes_, offsets_[row[j]], offsets_[row[j] + 1] - offsets_[row[j]]);
    text.clear();
    append_utf8_replaced(raw.data(), raw.size(), text);
    if (!text.empty()) {  // field 3, text
      body.push_back('\x1a');
      put_varint(text.size(), body);
      body += text;
    }
    out.push_back('\x0a');  // the response's field 1: one Beam
    put_varint(body.size(), out);
    out += body;
  }
  return out;
}

}  // namespace slmrank
