// A small, strict MessagePack decoder for the artifact manifest: the formats Python's
// msgpack.packb emits (no ext types, map keys are strings), into a tagged Value.
// Malformed input throws std::runtime_error naming the byte offset.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace slmrank {

class Value {
 public:
  enum class Type { kNil, kBool, kInt, kUint, kFloat32, kFloat64, kStr, kBin, kArray, kMap };
  using Array = std::vector<Value>;
  using Map = std::vector<std::pair<std::string, Value>>;  // in encoded order

  Value() = default;
  static Value boolean(bool b);
  static Value int64(int64_t i);
  static Value uint64(uint64_t u);
  static Value float32(float f);
  static Value float64(double d);
  static Value str(std::string s);
  static Value bin(std::string bytes);
  static Value array(Array items);
  static Value map(Map items);

  Type type() const { return type_; }
  const char* type_name() const;
  bool is_nil() const { return type_ == Type::kNil; }
  bool is_integer() const { return type_ == Type::kInt || type_ == Type::kUint; }
  bool is_number() const { return is_integer() || type_ == Type::kFloat32 || type_ == Type::kFloat64; }

  // Typed accessors: throw std::runtime_error("... is a <type>, not a ...") on a type mismatch.
  bool as_bool() const;
  int64_t as_int64() const;    // any integer in int64 range
  uint64_t as_uint64() const;  // any non-negative integer
  double as_double() const;    // floats, and integers widened
  const std::string& as_str() const;
  const std::string& as_bin() const;
  const Array& as_array() const;
  const Map& as_map() const;
  // Raw integer storage: uint64 holds kUint, int64 holds kInt (for exact conversions).
  int64_t raw_int() const { return int_; }
  uint64_t raw_uint() const { return uint_; }

  // Map lookup: nullptr when absent; at() throws naming the key.
  const Value* find(const std::string& key) const;
  const Value& at(const std::string& key) const;

 private:
  Type type_ = Type::kNil;
  bool bool_ = false;
  int64_t int_ = 0;
  uint64_t uint_ = 0;
  double double_ = 0;
  std::string bytes_;  // str (UTF-8) or bin
  Array array_;
  Map map_;
};

// Decodes exactly one object spanning all of data[0, size); trailing bytes are an error.
Value decode_msgpack(const uint8_t* data, size_t size);
// Reads and decodes a file; errors are prefixed with the path.
Value read_msgpack_file(const std::string& path);

}  // namespace slmrank
