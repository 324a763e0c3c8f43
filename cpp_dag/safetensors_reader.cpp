#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "safetensors_reader.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <unordered_set>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian; so must the host be");

namespace slmrank {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference implementation's limit
constexpr uint64_t kPageBytes = 4096;

// ---- a minimal JSON parser: objects, arrays, strings, integers (all a header holds) ----------

struct Json {
  enum class Kind { kObject, kArray, kString, kInt } kind = Kind::kInt;
  std::string str;
  int64_t integer = 0;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;  // in document order

  const char* kind_name() const {
    switch (kind) {
      case Kind::kObject: return "an object";
      case Kind::kArray: return "an array";
      case Kind::kString: return "a string";
      case Kind::kInt: return "an integer";
    }
    return "?";
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& text) : s_(text) {}

  Json document() {
    Json v = value(0);
    skip_space();  // writers pad the header with spaces to an 8-byte boundary
    if (pos_ != s_.size()) fail("trailing characters after the header object");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("header JSON: " + what + " at header byte " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  Json value(int depth) {
    if (depth > 32) fail("nesting too deep");
    const char c = peek();
    Json v;
    if (c == '{') {
      v.kind = Json::Kind::kObject;
      ++pos_;
      if (peek() == '}') return ++pos_, v;
      for (;;) {
        if (peek() != '"') fail("expected a string key");
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value(depth + 1));
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Json::Kind::kArray;
      ++pos_;
      if (peek() == ']') return ++pos_, v;
      for (;;) {
        v.items.push_back(value(depth + 1));
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Json::Kind::kString;
      v.str = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.kind = Json::Kind::kInt;
      v.integer = integer();
      return v;
    }
    fail(std::string("unsupported JSON value starting with '") + c + "'");
  }

  int64_t integer() {
    const bool negative = s_[pos_] == '-';
    if (negative) ++pos_;
    const size_t first = pos_;
    uint64_t x = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const uint64_t digit = static_cast<uint64_t>(s_[pos_] - '0');
      if (x > (static_cast<uint64_t>(INT64_MAX) - digit) / 10) fail("integer out of range");
      x = x * 10 + digit;
      ++pos_;
    }
    if (pos_ == first) fail("expected digits");
    if (s_[first] == '0' && pos_ - first > 1) fail("leading zero in an integer");
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E')) {
      fail("only integers are supported");
    }
    return negative ? -static_cast<int64_t>(x) : static_cast<int64_t>(x);
  }

  uint32_t hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      cp <<= 4;
      if (h >= '0' && h <= '9') cp |= h - '0';
      else if (h >= 'a' && h <= 'f') cp |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') cp |= h - 'A' + 10;
      else fail("bad hex digit in a \\u escape");
    }
    return cp;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      switch (s_[pos_++]) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a surrogate pair
            if (s_.compare(pos_, 2, "\\u") != 0) fail("unpaired surrogate");
            pos_ += 2;
            const uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }

  const std::string& s_;
  size_t pos_ = 0;
};

// ---- the header ------------------------------------------------------------------------------

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  uint64_t itemsize;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", at::kDouble, 8},  {"F32", at::kFloat, 4},       {"F16", at::kHalf, 2},
    {"BF16", at::kBFloat16, 2}, {"I64", at::kLong, 8},      {"I32", at::kInt, 4},
    {"I16", at::kShort, 2},   {"I8", at::kChar, 1},         {"U8", at::kByte, 1},
    {"U16", at::kUInt16, 2},  {"U32", at::kUInt32, 4},      {"U64", at::kUInt64, 8},
    {"BOOL", at::kBool, 1},   {"F8_E4M3", at::kFloat8_e4m3fn, 1}, {"F8_E5M2", at::kFloat8_e5m2, 1},
};

struct Entry {
  std::string name;
  DtypeInfo dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

const Json* member(const Json& obj, const char* key) {
  for (const auto& [k, v] : obj.members) {
    if (k == key) return &v;
  }
  return nullptr;
}

Entry parse_entry(const std::string& name, const Json& info) {
  auto bad = [&](const std::string& what) { return std::runtime_error("tensor '" + name + "': " + what); };
  if (info.kind != Json::Kind::kObject) {
    throw bad(std::string("header entry is ") + info.kind_name() + ", not an object");
  }
  const Json* dtype = member(info, "dtype");
  const Json* shape = member(info, "shape");
  const Json* offsets = member(info, "data_offsets");
  if (!dtype || !shape || !offsets) throw bad("needs dtype, shape and data_offsets");
  if (dtype->kind != Json::Kind::kString) throw bad("dtype must be a string");
  Entry e;
  e.name = name;
  auto known = std::find_if(std::begin(kDtypes), std::end(kDtypes),
                            [&](const DtypeInfo& d) { return dtype->str == d.name; });
  if (known == std::end(kDtypes)) throw bad("unsupported dtype '" + dtype->str + "'");
  e.dtype = *known;
  if (shape->kind != Json::Kind::kArray) throw bad("shape must be an array");
  uint64_t numel = 1;
  for (const Json& d : shape->items) {
    if (d.kind != Json::Kind::kInt || d.integer < 0) throw bad("shape must hold non-negative integers");
    const auto dim = static_cast<uint64_t>(d.integer);
    if (dim && numel > UINT64_MAX / dim / e.dtype.itemsize) throw bad("shape overflows");
    numel *= dim;
    e.shape.push_back(d.integer);
  }
  if (offsets->kind != Json::Kind::kArray || offsets->items.size() != 2 ||
      offsets->items[0].kind != Json::Kind::kInt || offsets->items[1].kind != Json::Kind::kInt ||
      offsets->items[0].integer < 0 || offsets->items[1].integer < offsets->items[0].integer) {
    throw bad("data_offsets must be [begin, end] with 0 <= begin <= end");
  }
  e.begin = static_cast<uint64_t>(offsets->items[0].integer);
  e.end = static_cast<uint64_t>(offsets->items[1].integer);
  if (e.end - e.begin != numel * e.dtype.itemsize) {
    throw bad("data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ") hold " +
              std::to_string(e.end - e.begin) + " bytes, but " + e.dtype.name + " of this shape needs " +
              std::to_string(numel * e.dtype.itemsize));
  }
  return e;
}

std::vector<Entry> parse_header(const std::string& text, std::map<std::string, std::string>* metadata) {
  const Json root = JsonParser(text).document();
  if (root.kind != Json::Kind::kObject) throw std::runtime_error("header JSON is not an object");
  std::vector<Entry> entries;
  std::unordered_set<std::string> seen;
  for (const auto& [name, info] : root.members) {
    if (!seen.insert(name).second) throw std::runtime_error("header JSON: duplicate key '" + name + "'");
    if (name == "__metadata__") {
      if (info.kind != Json::Kind::kObject) throw std::runtime_error("__metadata__ must be an object");
      for (const auto& [k, v] : info.members) {
        if (v.kind != Json::Kind::kString) throw std::runtime_error("__metadata__['" + k + "'] must be a string");
        (*metadata)[k] = v.str;
      }
      continue;
    }
    entries.push_back(parse_entry(name, info));
  }
  return entries;
}

// The tensors must tile [0, data_bytes) exactly, with no gap and no overlap.
void check_layout(const std::vector<Entry>& entries, uint64_t data_bytes) {
  std::vector<const Entry*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const Entry* e : by_offset) {
    if (e->end > data_bytes) {
      throw std::runtime_error("tensor '" + e->name + "': data_offsets [" + std::to_string(e->begin) + ", " +
                               std::to_string(e->end) + ") exceed the data section (" + std::to_string(data_bytes) +
                               " bytes)");
    }
    if (e->begin != expected) {
      throw std::runtime_error("tensor '" + e->name + "': data_offsets begin at " + std::to_string(e->begin) +
                               ", expected " + std::to_string(expected) + " (tensors must tile the data section)");
    }
    expected = e->end;
  }
  if (expected != data_bytes) {
    throw std::runtime_error("the tensors cover " + std::to_string(expected) + " of the data section's " +
                             std::to_string(data_bytes) + " bytes");
  }
}

using File = std::unique_ptr<FILE, int (*)(FILE*)>;

void read_exact(FILE* fh, void* dst, uint64_t size, uint64_t offset, const char* what) {
  if (fseeko(fh, static_cast<off_t>(offset), SEEK_SET) != 0 || std::fread(dst, 1, size, fh) != size) {
    throw std::runtime_error(std::string("short read of ") + what + " at file offset " + std::to_string(offset));
  }
}

SafetensorsFile read_file(const std::string& path, at::Device device, std::optional<at::ScalarType> dtype,
                          const std::set<std::string>& keep) {
  File fh(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!fh) throw std::runtime_error("cannot open");
  if (fseeko(fh.get(), 0, SEEK_END) != 0) throw std::runtime_error("cannot seek");
  const auto file_bytes = static_cast<uint64_t>(ftello(fh.get()));
  if (file_bytes < 8) throw std::runtime_error("file of " + std::to_string(file_bytes) + " bytes has no header length");
  uint8_t len_le[8];
  read_exact(fh.get(), len_le, 8, 0, "the header length");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_le[i];
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    throw std::runtime_error("header length " + std::to_string(header_bytes) + " exceeds the file (" +
                             std::to_string(file_bytes) + " bytes) or the " + std::to_string(kMaxHeaderBytes) +
                             "-byte limit");
  }
  std::string header(header_bytes, '\0');
  read_exact(fh.get(), header.data(), header_bytes, 8, "the header");

  SafetensorsFile out;
  const std::vector<Entry> entries = parse_header(header, &out.metadata);
  const uint64_t data_start = 8 + header_bytes;
  check_layout(entries, file_bytes - data_start);

  // One host buffer for the data section, placed so that every tensor's address is its file offset
  // modulo the page size: the layout safetensors' load_file (an mmap of the file) gives the Python
  // runtime. It matters: a CPU GEMV's rounding depends on its operand's alignment, so the two
  // runtimes stay byte-identical only if their weights sit at the same alignment.
  const uint64_t data_bytes = file_bytes - data_start;
  const at::Tensor backing = at::empty({static_cast<int64_t>(data_bytes + kPageBytes)}, at::kByte);
  auto* base = static_cast<uint8_t*>(backing.data_ptr());
  uint8_t* data = base + (data_start - reinterpret_cast<uintptr_t>(base)) % kPageBytes;
  if (data_bytes) read_exact(fh.get(), data, data_bytes, data_start, "the tensor data");

  for (const Entry& e : entries) {
    if (e.dtype.type == at::kBool) {
      for (uint64_t i = e.begin; i < e.end; ++i) {
        if (data[i] > 1) throw std::runtime_error("tensor '" + e.name + "': BOOL byte " + std::to_string(data[i]));
      }
    }
    // The views keep the buffer alive; it is freed once every tensor was copied (cast, moved) away.
    const at::Tensor host = at::from_blob(data + e.begin, e.shape, [backing](void*) {},
                                          at::TensorOptions().dtype(e.dtype.type));
    const bool cast = dtype && at::isFloatingType(e.dtype.type) && !keep.count(e.name);
    out.tensors.emplace_back(e.name, cast ? host.to(device, *dtype) : host.to(device));
  }
  return out;
}

}  // namespace

SafetensorsFile read_safetensors(const std::string& path, at::Device device, std::optional<at::ScalarType> dtype,
                                 const std::set<std::string>& keep) {
  try {
    return read_file(path, device, dtype, keep);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

}  // namespace slmrank
