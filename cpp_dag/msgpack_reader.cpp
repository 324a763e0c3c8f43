#include "msgpack_reader.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <unordered_set>

namespace slmrank {

// ---- Value -----------------------------------------------------------------------------------

Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.bool_ = b;
  return v;
}
Value Value::int64(int64_t i) {
  Value v;
  v.type_ = Type::kInt;
  v.int_ = i;
  return v;
}
Value Value::uint64(uint64_t u) {
  Value v;
  v.type_ = Type::kUint;
  v.uint_ = u;
  return v;
}
Value Value::float32(float f) {
  Value v;
  v.type_ = Type::kFloat32;
  v.double_ = f;
  return v;
}
Value Value::float64(double d) {
  Value v;
  v.type_ = Type::kFloat64;
  v.double_ = d;
  return v;
}
Value Value::str(std::string s) {
  Value v;
  v.type_ = Type::kStr;
  v.bytes_ = std::move(s);
  return v;
}
Value Value::bin(std::string bytes) {
  Value v;
  v.type_ = Type::kBin;
  v.bytes_ = std::move(bytes);
  return v;
}
Value Value::array(Array items) {
  Value v;
  v.type_ = Type::kArray;
  v.array_ = std::move(items);
  return v;
}
Value Value::map(Map items) {
  Value v;
  v.type_ = Type::kMap;
  v.map_ = std::move(items);
  return v;
}

const char* Value::type_name() const {
  switch (type_) {
    case Type::kNil: return "nil";
    case Type::kBool: return "bool";
    case Type::kInt:
    case Type::kUint: return "integer";
    case Type::kFloat32:
    case Type::kFloat64: return "float";
    case Type::kStr: return "string";
    case Type::kBin: return "bin";
    case Type::kArray: return "array";
    case Type::kMap: return "map";
  }
  return "?";
}

namespace {
// "an integer", "a map": for messages.
std::string with_article(const char* name) {
  return (std::strchr("aeiou", name[0]) ? "an " : "a ") + std::string(name);
}

[[noreturn]] void mismatch(const Value& v, const char* want) {
  throw std::runtime_error("msgpack value is " + with_article(v.type_name()) + ", not " + want);
}
}  // namespace

bool Value::as_bool() const {
  if (type_ != Type::kBool) mismatch(*this, "a bool");
  return bool_;
}
int64_t Value::as_int64() const {
  if (type_ == Type::kInt) return int_;
  if (type_ == Type::kUint && uint_ <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(uint_);
  if (type_ == Type::kUint) throw std::runtime_error("msgpack integer " + std::to_string(uint_) + " exceeds int64");
  mismatch(*this, "an integer");
}
uint64_t Value::as_uint64() const {
  if (type_ == Type::kUint) return uint_;
  if (type_ == Type::kInt && int_ >= 0) return static_cast<uint64_t>(int_);
  if (type_ == Type::kInt) throw std::runtime_error("msgpack integer " + std::to_string(int_) + " is negative");
  mismatch(*this, "an integer");
}
double Value::as_double() const {
  if (type_ == Type::kFloat32 || type_ == Type::kFloat64) return double_;
  if (type_ == Type::kInt) return static_cast<double>(int_);
  if (type_ == Type::kUint) return static_cast<double>(uint_);
  mismatch(*this, "a number");
}
const std::string& Value::as_str() const {
  if (type_ != Type::kStr) mismatch(*this, "a string");
  return bytes_;
}
const std::string& Value::as_bin() const {
  if (type_ != Type::kBin) mismatch(*this, "bin");
  return bytes_;
}
const Value::Array& Value::as_array() const {
  if (type_ != Type::kArray) mismatch(*this, "an array");
  return array_;
}
const Value::Map& Value::as_map() const {
  if (type_ != Type::kMap) mismatch(*this, "a map");
  return map_;
}

const Value* Value::find(const std::string& key) const {
  for (const auto& [k, v] : as_map()) {
    if (k == key) return &v;
  }
  return nullptr;
}

const Value& Value::at(const std::string& key) const {
  const Value* v = find(key);
  if (!v) throw std::runtime_error("msgpack map has no key '" + key + "'");
  return *v;
}

// ---- the decoder ------------------------------------------------------------------------------

namespace {

constexpr int kMaxDepth = 256;  // nesting deeper than this is refused (no stack exhaustion)

// Whole-string UTF-8 check (as Python's msgpack does for str with raw=False): no overlongs,
// no surrogates, nothing above U+10FFFF.
bool valid_utf8(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    const uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

class Decoder {
 public:
  Decoder(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  Value document() {
    Value v = value(0);
    if (pos_ != size_) fail(pos_, std::to_string(size_ - pos_) + " trailing bytes after the object");
    return v;
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& what) const {
    throw std::runtime_error("msgpack: " + what + " at byte offset " + std::to_string(at));
  }

  void need(size_t n, const char* what) const {
    if (size_ - pos_ < n) {
      fail(pos_, std::string("truncated ") + what + " (needs " + std::to_string(n) + " bytes, " +
                     std::to_string(size_ - pos_) + " left)");
    }
  }

  // Big-endian unsigned of n bytes (n = 1, 2, 4 or 8).
  uint64_t be(size_t n, const char* what) {
    need(n, what);
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x = (x << 8) | data_[pos_ + i];
    pos_ += n;
    return x;
  }

  std::string bytes(size_t n, const char* what) {
    need(n, what);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

  Value str(size_t n, size_t start) {
    need(n, "str");
    if (!valid_utf8(data_ + pos_, n)) fail(start, "str is not valid UTF-8");
    return Value::str(bytes(n, "str"));
  }

  // Each element takes at least one byte: a count beyond what is left is malformed (and must not
  // reserve a huge vector before failing).
  void check_count(uint64_t n, size_t per_item, size_t start, const char* what) const {
    if (n > (size_ - pos_) / per_item) {
      fail(start, std::string(what) + " claims " + std::to_string(n) + " elements but only " +
                      std::to_string(size_ - pos_) + " bytes are left");
    }
  }

  Value array(uint64_t n, size_t start, int depth) {
    check_count(n, 1, start, "array");
    Value::Array items;
    items.reserve(n);
    for (uint64_t i = 0; i < n; ++i) items.push_back(value(depth + 1));
    return Value::array(std::move(items));
  }

  Value map(uint64_t n, size_t start, int depth) {
    check_count(n, 2, start, "map");
    Value::Map items;
    items.reserve(n);
    std::unordered_set<std::string> seen;
    for (uint64_t i = 0; i < n; ++i) {
      const size_t key_at = pos_;
      Value key = value(depth + 1);
      if (key.type() != Value::Type::kStr) {
        fail(key_at, "map key is " + with_article(key.type_name()) + ", not a string");
      }
      if (!seen.insert(key.as_str()).second) fail(key_at, "duplicate map key '" + key.as_str() + "'");
      items.emplace_back(key.as_str(), value(depth + 1));
    }
    return Value::map(std::move(items));
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail(pos_, "nesting deeper than " + std::to_string(kMaxDepth));
    const size_t start = pos_;
    need(1, "value");
    const uint8_t tag = data_[pos_++];
    if (tag <= 0x7f) return Value::uint64(tag);  // positive fixint
    if (tag >= 0xe0) return Value::int64(static_cast<int8_t>(tag));  // negative fixint
    if ((tag & 0xf0) == 0x80) return map(tag & 0x0f, start, depth);
    if ((tag & 0xf0) == 0x90) return array(tag & 0x0f, start, depth);
    if ((tag & 0xe0) == 0xa0) return str(tag & 0x1f, start);
    switch (tag) {
      case 0xc0: return Value();
      case 0xc2: return Value::boolean(false);
      case 0xc3: return Value::boolean(true);
      case 0xc4: return Value::bin(bytes(be(1, "bin8 length"), "bin8"));
      case 0xc5: return Value::bin(bytes(be(2, "bin16 length"), "bin16"));
      case 0xc6: return Value::bin(bytes(be(4, "bin32 length"), "bin32"));
      case 0xca: {
        const uint32_t bits = static_cast<uint32_t>(be(4, "float32"));
        float f;
        std::memcpy(&f, &bits, 4);
        return Value::float32(f);
      }
      case 0xcb: {
        const uint64_t bits = be(8, "float64");
        double d;
        std::memcpy(&d, &bits, 8);
        return Value::float64(d);
      }
      case 0xcc: return Value::uint64(be(1, "uint8"));
      case 0xcd: return Value::uint64(be(2, "uint16"));
      case 0xce: return Value::uint64(be(4, "uint32"));
      case 0xcf: return Value::uint64(be(8, "uint64"));
      case 0xd0: return Value::int64(static_cast<int8_t>(be(1, "int8")));
      case 0xd1: return Value::int64(static_cast<int16_t>(be(2, "int16")));
      case 0xd2: return Value::int64(static_cast<int32_t>(be(4, "int32")));
      case 0xd3: return Value::int64(static_cast<int64_t>(be(8, "int64")));
      case 0xd9: return str(be(1, "str8 length"), start);
      case 0xda: return str(be(2, "str16 length"), start);
      case 0xdb: return str(be(4, "str32 length"), start);
      case 0xdc: return array(be(2, "array16 length"), start, depth);
      case 0xdd: return array(be(4, "array32 length"), start, depth);
      case 0xde: return map(be(2, "map16 length"), start, depth);
      case 0xdf: return map(be(4, "map32 length"), start, depth);
      case 0xc1: fail(start, "reserved type byte 0xc1");
      default: break;  // ext formats (0xc7-0xc9, 0xd4-0xd8)
    }
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", tag);
    fail(start, std::string("unsupported type byte ") + hex + " (ext types are not used by the manifest)");
  }

  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

Value decode_msgpack(const uint8_t* data, size_t size) { return Decoder(data, size).document(); }

Value read_msgpack_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::string buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error(path + ": read error");
  try {
    return decode_msgpack(reinterpret_cast<const uint8_t*>(buf.data()), buf.size());
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + ": " + e.what());
  }
}

}  // namespace slmrank
