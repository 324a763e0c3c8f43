#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "artifact_loader.h"
#include "catalog_forest.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/sin.h>
#include <c10/util/StringUtil.h>

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>

#include "msgpack_reader.h"
#include "safetensors_reader.h"
#include "sha256.h"

namespace slmrank {
namespace {

const char* kManifest = "manifest.msgpack";
const char* kAcceptance = "acceptance.json";  // service/artifact/manifest.py ACCEPTANCE
const char* kManifestSha256 = "manifest.sha256";  // "<64 hex>  manifest.msgpack\n", as sha256sum writes it
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;  // service/artifact/manifest.py MAX_MANIFEST_BYTES

// service/artifact/manifest.py's bounds (MAX_COUNT, MAX_VOCAB): beyond them a RoPE table, a buffer or
// a weight would not fit in any host's memory
constexpr int64_t kMaxCount = int64_t{1} << 20;
constexpr int64_t kMaxVocab = int64_t{1} << 22;

// The size of path, which must be a regular file once links are followed (a link to /dev/zero or a
// FIFO would make the load read, or wait, forever).
int64_t regular_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) throw std::invalid_argument(path + ": missing artifact file");
    throw std::invalid_argument(path + ": cannot read it (" + std::strerror(errno) + ")");
  }
  if (!S_ISREG(st.st_mode)) throw std::invalid_argument(path + ": an artifact's files must be regular files");
  return static_cast<int64_t>(st.st_size);
}

// All of a regular file of at most max_bytes.
std::string read_bounded(const std::string& path, int64_t max_bytes) {
  const int64_t size = regular_size(path);
  if (size > max_bytes) {
    throw std::invalid_argument(path + ": " + std::to_string(size) + " bytes is more than such a file can be (" +
                                std::to_string(max_bytes) + ")");
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  std::ifstream in(path, std::ios::binary);
  in.read(bytes.data(), size);
  if (in.gcount() != size) throw std::invalid_argument(path + ": read error (the file changed while it was read)");
  return bytes;
}

bool is_sha256_hex(const std::string& s) {
  const auto is_hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return s.size() == 64 && std::all_of(s.begin(), s.end(), is_hex);
}

// The manifest's bytes, once their sha256 matches manifest.sha256 (before a byte is decoded).
std::string verified_manifest_bytes(const std::string& dir) {
  const std::string path = dir + "/" + kManifest, sidecar_path = dir + "/" + kManifestSha256;
  struct stat st;
  if (::lstat(sidecar_path.c_str(), &st) != 0 && errno == ENOENT) {
    throw std::invalid_argument(sidecar_path + ": missing (artifacts of format_version 8 and later have it); "
                                "rebuild the artifact with `slmrank build`");
  }
  const std::string sidecar = read_bounded(sidecar_path, 128);
  const std::string tail = std::string("  ") + kManifest;
  const bool has_newline = !sidecar.empty() && sidecar.back() == '\n';
  const std::string line = sidecar.substr(0, sidecar.size() - has_newline);
  if (line.size() != 64 + tail.size() || !is_sha256_hex(line.substr(0, 64)) || line.substr(64) != tail) {
    throw std::invalid_argument(sidecar_path + ": not a sha256 line for " + kManifest +
                                " (<64 lower-case hex digits>, two spaces, the name)");
  }
  const std::string want = line.substr(0, 64);
  const std::string bytes = read_bounded(path, kMaxManifestBytes);
  Sha256 h;
  h.update(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  const auto digest = h.finish();
  const std::string actual = to_hex(digest.data(), digest.size());
  if (actual != want) {
    throw std::invalid_argument(path + ": sha256 mismatch (" + kManifestSha256 + " " + want.substr(0, 12) +
                                "…, file " + actual.substr(0, 12) + "…): the manifest is corrupted or was modified");
  }
  return bytes;
}

// Typed access to the manifest with errors that name the file and the field ("model.vocab_size").
class Manifest {
 public:
  Manifest(std::string path, Value root) : path_(std::move(path)), root_(std::move(root)) {}

  [[noreturn]] void fail(const std::string& what) const { throw std::invalid_argument(path_ + ": " + what); }

  const Value& get(const std::string& dotted) const {
    const Value* v = &root_;
    size_t start = 0;
    while (start <= dotted.size()) {
      const size_t dot = std::min(dotted.find('.', start), dotted.size());
      const std::string key = dotted.substr(start, dot - start);
      if (v->type() != Value::Type::kMap) fail("malformed manifest (" + dotted.substr(0, start) + " is not a map)");
      v = v->find(key);
      if (!v) fail("malformed manifest (no " + dotted.substr(0, dot) + ")");
      start = dot + 1;
    }
    return *v;
  }

  // Applies an accessor, turning a type mismatch into an error naming the field.
  template <typename F>
  auto as(const Value& v, const std::string& field, F&& accessor) const {
    try {
      return accessor(v);
    } catch (const std::runtime_error& e) {
      fail("malformed manifest (" + field + ": " + e.what() + ")");
    }
  }
  int64_t integer(const std::string& f) const { return as(get(f), f, [](const Value& v) { return v.as_int64(); }); }
  double number(const std::string& f) const { return as(get(f), f, [](const Value& v) { return v.as_double(); }); }
  bool boolean(const std::string& f) const { return as(get(f), f, [](const Value& v) { return v.as_bool(); }); }
  std::string str(const std::string& f) const { return as(get(f), f, [](const Value& v) { return v.as_str(); }); }

  const Value& root() const { return root_; }

 private:
  std::string path_;
  Value root_;
};

std::string shown(const Value* v) {
  if (!v) return "(missing)";
  if (v->type() == Value::Type::kUint) return std::to_string(v->raw_uint());
  if (v->type() == Value::Type::kInt) return std::to_string(v->raw_int());
  if (v->type() == Value::Type::kStr) return "'" + v->as_str() + "'";
  return std::string("(a ") + v->type_name() + ")";
}

// The fields this loader reads, each with its type and range, checked in one place before any is
// used: service/artifact/manifest.py's SCHEMA for the same fields, with the same bounds (the DAG
// nodes' attrs are checked where dag() reads them).
enum class Kind { kInteger, kNumber, kBoolean, kString, kSha256 };
struct FieldRule {
  const char* field;
  Kind kind;
  double lo = 0, hi = 0;  // an integer in [lo, hi]; a finite number in (lo, hi]
};
const FieldRule kSchema[] = {
    {"model.arch", Kind::kString},
    {"model.vocab_size", Kind::kInteger, 1, kMaxVocab},
    {"model.hidden_size", Kind::kInteger, 1, kMaxCount},
    {"model.num_layers", Kind::kInteger, 1, kMaxCount},
    {"model.num_heads", Kind::kInteger, 1, kMaxCount},
    {"model.num_kv_heads", Kind::kInteger, 1, kMaxCount},
    {"model.head_dim", Kind::kInteger, 1, kMaxCount},
    {"model.intermediate_size", Kind::kInteger, 1, kMaxCount},
    {"model.max_positions", Kind::kInteger, 1, kMaxCount},
    {"model.num_labels", Kind::kInteger, 0, kMaxCount},
    {"model.rope_theta", Kind::kNumber, 0, 1e12},
    {"model.rms_norm_eps", Kind::kNumber, 0, 1},
    {"model.tie_word_embeddings", Kind::kBoolean},
    {"model.attention_bias", Kind::kBoolean},
    {"limits.max_prompt_tokens", Kind::kInteger, 1, kMaxCount},
    {"limits.max_beam_width", Kind::kInteger, 1, kMaxCount},
    {"limits.max_new_tokens", Kind::kInteger, 1, kMaxCount},
    {"limits.max_samples", Kind::kInteger, 1, kMaxCount},
    {"limits.max_score_tokens", Kind::kInteger, 1, kMaxCount},
    {"limits.max_labels", Kind::kInteger, 1, kMaxCount},
    {"weights.file", Kind::kString},
    {"weights.dtype", Kind::kString},
    {"weights.sha256", Kind::kSha256},
};

// The acceptance record's reference (service/artifact/manifest.py _ACCEPTANCE; `slmrank evaluate`
// writes it), checked when the manifest has one; load_artifact checks the file's name and sha256.
const FieldRule kAcceptanceSchema[] = {
    {"acceptance.file", Kind::kString},
    {"acceptance.sha256", Kind::kSha256},
    {"acceptance.passed", Kind::kBoolean},
    {"acceptance.baseline_sha256", Kind::kSha256},
    {"acceptance.requests_sha256", Kind::kSha256},
    {"acceptance.date", Kind::kString},
};

std::string bound(double x) { return std::to_string(static_cast<int64_t>(x)); }

// An integer in [lo, hi], else an error naming the field.
int64_t in_range(const Manifest& m, const Value& v, const std::string& field, int64_t lo, int64_t hi) {
  const bool ok = (v.type() == Value::Type::kInt && v.raw_int() >= lo && v.raw_int() <= hi) ||
                  (v.type() == Value::Type::kUint && v.raw_uint() <= static_cast<uint64_t>(hi) &&
                   static_cast<int64_t>(v.raw_uint()) >= lo);
  if (!ok) {
    m.fail(field + ": must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
           "], got " + shown(&v));
  }
  return v.type() == Value::Type::kInt ? v.raw_int() : static_cast<int64_t>(v.raw_uint());
}

template <size_t N>
void check_rules(const Manifest& m, const FieldRule (&rules)[N]) {
  for (const FieldRule& rule : rules) {
    const std::string field = rule.field;
    const Value& v = m.get(field);
    switch (rule.kind) {
      case Kind::kInteger:
        in_range(m, v, field, static_cast<int64_t>(rule.lo), static_cast<int64_t>(rule.hi));
        break;
      case Kind::kNumber: {
        const double x = v.is_number() ? v.as_double() : NAN;
        if (!(std::isfinite(x) && x > rule.lo && x <= rule.hi)) {
          m.fail(field + ": must be a number in (" + bound(rule.lo) + ", " + bound(rule.hi) + "], got " + shown(&v));
        }
        break;
      }
      case Kind::kBoolean:
        if (v.type() != Value::Type::kBool) m.fail(field + ": must be true or false, got " + shown(&v));
        break;
      case Kind::kString:
        if (v.type() != Value::Type::kStr || v.as_str().empty()) {
          m.fail(field + ": must be a non-empty string, got " + shown(&v));
        }
        break;
      case Kind::kSha256:
        if (v.type() != Value::Type::kStr || !is_sha256_hex(v.as_str())) {
          m.fail(field + ": must be 64 lower-case hex digits, got " + shown(&v));
        }
        break;
    }
  }
}

// weights.fp8 (service/artifact/manifest.py _fp8_parts): the e4m3 linear layers, distinct parts of these.
const char* const kFp8Parts[] = {"mlp", "attn", "head"};  // service/model/checkpoint.py FP8_PARTS

std::vector<std::string> fp8_parts(const Manifest& m) {
  const Value& v = m.get("weights.fp8");
  if (v.type() != Value::Type::kArray || v.as_array().size() > std::size(kFp8Parts)) {
    m.fail("weights.fp8: must be an array of 0 to " + std::to_string(std::size(kFp8Parts)) + " items, got " + shown(&v));
  }
  std::vector<std::string> parts;
  for (size_t i = 0; i < v.as_array().size(); ++i) {
    const Value& p = v.as_array()[i];
    const std::string field = "weights.fp8[" + std::to_string(i) + "]";
    const bool known = p.type() == Value::Type::kStr &&
                       std::any_of(std::begin(kFp8Parts), std::end(kFp8Parts), [&](const char* k) { return p.as_str() == k; });
    if (!known) m.fail(field + ": must be one of mlp, attn, head, got " + shown(&p));
    if (std::find(parts.begin(), parts.end(), p.as_str()) != parts.end()) {
      m.fail("weights.fp8: must be distinct parts of mlp, attn, head, got '" + p.as_str() + "' twice");
    }
    parts.push_back(p.as_str());
  }
  return parts;
}

void check_schema(const Manifest& m) {
  check_rules(m, kSchema);
  fp8_parts(m);
  const Value* acceptance = m.root().find("acceptance");  // optional: an artifact `slmrank evaluate` recorded
  if (acceptance) {
    if (acceptance->type() != Value::Type::kMap) m.fail("acceptance: must be a map, got " + shown(acceptance));
    check_rules(m, kAcceptanceSchema);
    if (m.str("acceptance.file") != kAcceptance) {
      m.fail("acceptance.file: must be one of " + std::string(kAcceptance) + ", got '" + m.str("acceptance.file") + "'");
    }
  }
}


Manifest read_manifest(const std::string& dir) {
  const std::string path = dir + "/" + kManifest;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT) {
    throw std::invalid_argument(dir + ": not an artifact (no " + kManifest + "); build one with `slmrank build`");
  }
  const std::string bytes = verified_manifest_bytes(dir);
  Value root;
  try {
    root = decode_msgpack(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(path + ": corrupted manifest (" + e.what() + ")");
  }
  Manifest m(path, std::move(root));
  if (m.root().type() != Value::Type::kMap) m.fail(std::string("not a ") + kArtifactFormat + " manifest");
  const Value* format = m.root().find("format");
  if (!format || format->type() != Value::Type::kStr || format->as_str() != kArtifactFormat) {
    m.fail(std::string("not a ") + kArtifactFormat + " manifest");
  }
  const Value* version = m.root().find("format_version");
  const bool is_supported = version && version->type() == Value::Type::kUint &&
                            version->raw_uint() == static_cast<uint64_t>(kArtifactFormatVersion);
  if (!is_supported) {
    m.fail("format_version " + shown(version) + " is not supported (this slmrank reads version " +
           std::to_string(kArtifactFormatVersion) + "); rebuild the artifact");
  }
  check_schema(m);
  return m;
}

// service/model/config.py::ModelConfig, including its checks.
ModelConfig model_config(const Manifest& m) {
  ModelConfig c;
  const std::string arch = m.str("model.arch");
  if (arch != "qwen2" && arch != "qwen3") m.fail("model.arch: '" + arch + "' is not one of qwen2, qwen3");
  c.vocab_size = m.integer("model.vocab_size");
  c.hidden_size = m.integer("model.hidden_size");
  c.num_layers = m.integer("model.num_layers");
  c.num_heads = m.integer("model.num_heads");
  c.num_kv_heads = m.integer("model.num_kv_heads");
  c.head_dim = m.integer("model.head_dim");
  c.intermediate_size = m.integer("model.intermediate_size");
  c.num_labels = m.integer("model.num_labels");
  c.rms_norm_eps = m.number("model.rms_norm_eps");
  c.qk_norm = arch == "qwen3";
  // each field's range is the schema's (check_schema); what no single field shows:
  if (c.num_heads % c.num_kv_heads) m.fail("model.num_heads must be a multiple of model.num_kv_heads");
  if (c.head_dim % 2) m.fail("model.head_dim: RoPE needs an even head_dim");
  return c;
}

std::vector<std::string> strings(const Manifest& m, const Value& v, const std::string& field) {
  std::vector<std::string> out;
  for (const Value& s : m.as(v, field, [](const Value& x) { return x.as_array(); })) {
    out.push_back(m.as(s, field, [](const Value& x) { return x.as_str(); }));
  }
  return out;
}

// service/artifact/dag.py::Node.to_dict -> NodeSpec.
std::vector<NodeSpec> dag(const Manifest& m, const std::string& which) {
  const std::string field = "dags." + which;
  std::vector<NodeSpec> nodes;
  const auto& items = m.as(m.get(field), field, [](const Value& x) { return x.as_array(); });
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string at = field + "[" + std::to_string(i) + "]";
    const Value& d = items[i];
    auto need = [&](const char* key) -> const Value& {
      const Value* v = d.type() == Value::Type::kMap ? d.find(key) : nullptr;
      if (!v) m.fail("malformed manifest (no " + at + "." + key + ")");
      return *v;
    };
    NodeSpec s;
    s.name = m.as(need("name"), at + ".name", [](const Value& x) { return x.as_str(); });
    s.type = m.as(need("type"), at + ".type", [](const Value& x) { return x.as_str(); });
    s.inputs = strings(m, need("inputs"), at + ".inputs");
    s.outputs = strings(m, need("outputs"), at + ".outputs");
    const Value& attrs = need("attrs");
    auto attr = [&](const char* key) {
      return m.as(attrs, at + ".attrs", [&](const Value& x) { return x.find(key); });
    };
    const std::string af = at + ".attrs.";
    if (const Value* v = attr("layer")) s.layer = in_range(m, *v, af + "layer", 0, kMaxCount);
    if (const Value* v = attr("step")) s.step = in_range(m, *v, af + "step", 0, kMaxCount);
    if (const Value* v = attr("mode")) s.mode = m.as(*v, af + "mode", [](const Value& x) { return x.as_str(); });
    if (const Value* v = attr("max_rows")) s.max_rows = in_range(m, *v, af + "max_rows", 0, kMaxCount);
    if (const Value* v = attr("weight")) s.weight = m.as(*v, af + "weight", [](const Value& x) { return x.as_str(); });
    nodes.push_back(std::move(s));
  }
  return nodes;
}

bool has_part(const std::vector<std::string>& fp8, const char* part) {
  return std::find(fp8.begin(), fp8.end(), part) != fp8.end();
}

// service/model/checkpoint.py::fp8_weight_names: the weights stored as e4m3, each with NAME.scale.
std::vector<std::string> fp8_weight_names(const ModelConfig& c, const std::vector<std::string>& fp8) {
  std::vector<std::string> names;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    if (has_part(fp8, "attn")) names.insert(names.end(), {p + "wqkv", p + "wo"});
    if (has_part(fp8, "mlp")) names.insert(names.end(), {p + "wgu", p + "wdown"});
  }
  if (has_part(fp8, "head")) names.push_back(c.num_labels > 0 ? "cls_head" : "lm_head");
  return names;
}

// service/model/checkpoint.py::expected_shapes.
std::map<std::string, std::vector<int64_t>> expected_shapes(const ModelConfig& c, bool tied, bool bias,
                                                            const std::vector<std::string>& fp8) {
  const int64_t d = c.hidden_size, f = c.intermediate_size, qkv = c.q_size() + 2 * c.kv_size();
  std::map<std::string, std::vector<int64_t>> shapes = {{"embed", {c.vocab_size, d}}, {"final_norm", {d}}};
  if (c.num_labels > 0) {
    shapes["cls_head"] = {c.num_labels, d};
  } else if (!tied) {
    shapes["lm_head"] = {c.vocab_size, d};
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    shapes[p + "attn_norm"] = {d};
    shapes[p + "wqkv"] = {qkv, d};
    if (bias) shapes[p + "bqkv"] = {qkv};
    if (c.qk_norm) {
      shapes[p + "q_norm"] = {c.head_dim};
      shapes[p + "k_norm"] = {c.head_dim};
    }
    shapes[p + "wo"] = {d, c.q_size()};
    shapes[p + "mlp_norm"] = {d};
    shapes[p + "wgu"] = {2 * f, d};
    shapes[p + "wdown"] = {d, f};
  }
  for (const std::string& name : fp8_weight_names(c, fp8)) {
    if (name == "lm_head") shapes[name] = {c.vocab_size, d};  // an fp8 head of tied embeddings: its own table
    shapes[name + ".scale"] = {shapes[name][0]};
  }
  return shapes;
}

void check_weights(const std::string& path, const WeightMap& weights,
                   std::map<std::string, std::vector<int64_t>> want, const std::set<std::string>& quantized) {
  // an e4m3 weight's row floor (`--fp8 mlp:2048`): its model-dtype copy and the floor, both or neither
  // (service/model/checkpoint.py::check_weights)
  for (const std::string& name : quantized) {
    if (weights.count(name + ".full") || weights.count(name + ".min_rows")) {
      want[name + ".full"] = want.at(name);
      want[name + ".min_rows"] = {1};
    }
  }
  std::vector<std::string> missing, extra;
  for (const auto& [name, shape] : want) {
    if (!weights.count(name)) missing.push_back(name);
  }
  for (const auto& [name, t] : weights) {
    if (!want.count(name)) extra.push_back(name);
  }
  std::sort(extra.begin(), extra.end());
  auto first = [](const std::vector<std::string>& names) {
    std::string s;
    for (size_t i = 0; i < names.size() && i < 5; ++i) s += (i ? ", " : "") + names[i];
    return "[" + s + (names.size() > 5 ? ", ..." : "") + "]";
  };
  if (!missing.empty() || !extra.empty()) {
    throw std::invalid_argument(path + ": weights do not match the model config: missing " + first(missing) +
                                ", unexpected " + first(extra));
  }
  for (const auto& [name, shape] : want) {
    if (weights.at(name).sizes().vec() != shape) {
      throw std::invalid_argument(path + ": weight " + name + ": shape " + c10::str(weights.at(name).sizes()) +
                                  " != expected " + c10::str(at::IntArrayRef(shape)));
    }
  }
  // service/model/checkpoint.py::check_weights: the fp8 policy's weights e4m3 with float32 scales, no other fp8
  for (const auto& [name, t] : weights) {
    if ((t.scalar_type() == at::kFloat8_e4m3fn) != (quantized.count(name) > 0)) {
      throw std::invalid_argument(path + ": weight " + name + ": dtype " + c10::toString(t.scalar_type()) +
                                  " does not match the manifest's fp8 policy (weights.fp8)");
    }
    if (name.size() > 6 && name.compare(name.size() - 6, 6, ".scale") == 0 && t.scalar_type() != at::kFloat) {
      throw std::invalid_argument(path + ": weight " + name + ": an fp8 scale must be float32, got " +
                                  c10::toString(t.scalar_type()));
    }
    if (name.size() > 9 && name.compare(name.size() - 9, 9, ".min_rows") == 0 &&
        (t.scalar_type() != at::kLong || t.reshape({-1})[0].item<int64_t>() < 1)) {
      throw std::invalid_argument(path + ": weight " + name + ": a row floor must be one int64 >= 1, got " +
                                  c10::toString(t.scalar_type()));
    }
  }
}

void verify_file(const std::string& path, const std::string& digest) {
  regular_size(path);
  const std::string actual = sha256_file(path);
  if (actual != digest) {
    throw std::invalid_argument(path + ": sha256 mismatch (manifest " + digest.substr(0, 12) + "…, file " +
                                actual.substr(0, 12) + "…): the artifact is corrupted or was modified");
  }
}

}  // namespace

at::ScalarType dtype_from_name(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("dtype: '" + name + "' is not one of float32, bfloat16, float16");
}

std::pair<at::Tensor, at::Tensor> rope_table(int64_t head_dim, const at::Scalar& theta, int64_t num_positions,
                                             at::Device device) {
  // inv_freq = 1.0 / (theta ** (arange(0, e, 2, int64).float() / e)); Python's `1.0 / t` is
  // t.reciprocal() * 1.0 (Tensor.__rdiv__), and `theta ** t` is pow(Scalar, Tensor).
  const auto on = at::TensorOptions().device(device);
  const at::Tensor exponent = at::arange(0, head_dim, 2, on.dtype(at::kLong)).to(at::kFloat).div(head_dim);
  const at::Tensor inv_freq = at::mul(at::reciprocal(at::pow(theta, exponent)), 1.0);
  const at::Tensor pos = at::arange(num_positions, on.dtype(at::kFloat));
  const at::Tensor freqs = at::mul(pos.unsqueeze(1), inv_freq.unsqueeze(0));  // [P, E/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {at::cos(emb), at::sin(emb)};
}

LoadedArtifact load_artifact(const std::string& dir, at::Device device, std::optional<at::ScalarType> dtype,
                             bool verify, ForestCapacity catalog_capacity) {
  const Manifest m = read_manifest(dir);
  LoadedArtifact a;
  a.dir = dir;
  a.cfg = model_config(m);
  const Value& theta = m.get("model.rope_theta");
  if (theta.type() == Value::Type::kInt) {
    a.rope_theta = theta.raw_int();
  } else if (theta.type() == Value::Type::kUint) {
    a.rope_theta = m.integer("model.rope_theta");
  } else {
    a.rope_theta = m.number("model.rope_theta");
  }
  a.score_dag = dag(m, "score");
  a.beam_dag = dag(m, "beam");

  const std::string file = m.str("weights.file");
  if (file.find('/') != std::string::npos || file == "." || file == "..") {
    m.fail("weights.file: '" + file + "' must be a file name inside the artifact directory");
  }
  const std::string weights_path = dir + "/" + file;
  if (verify) verify_file(weights_path, m.str("weights.sha256"));
  const std::string weights_dtype = m.str("weights.dtype");
  try {
    a.dtype = dtype.value_or(dtype_from_name(weights_dtype));  // an unknown name is refused even so
  } catch (const std::invalid_argument& e) {
    m.fail(std::string("weights.") + e.what());
  }
  regular_size(weights_path);  // a device or FIFO here would never finish loading
  a.fp8 = fp8_parts(m);
  const std::vector<std::string> quantized_names = fp8_weight_names(a.cfg, a.fp8);
  const std::set<std::string> quantized(quantized_names.begin(), quantized_names.end());
  std::set<std::string> keep = quantized;  // the e4m3 weights and their float32 scales are not cast to dtype
  for (const std::string& name : quantized_names) keep.insert(name + ".scale");
  try {
    for (auto& [name, t] : read_safetensors(weights_path, device, a.dtype, keep).tensors) a.weights[name] = std::move(t);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(e.what());  // already names the file
  }
  check_weights(weights_path, a.weights,
                expected_shapes(a.cfg, m.boolean("model.tie_word_embeddings"), m.boolean("model.attention_bias"), a.fp8),
                quantized);

  std::vector<CatalogTrie> tries;
  const Value& catalogs = m.get("catalogs");
  for (const Value& entry : m.as(catalogs, "catalogs", [](const Value& x) { return x.as_array(); })) {
    auto field = [&](const char* key) {
      const Value* v = entry.type() == Value::Type::kMap ? entry.find(key) : nullptr;
      if (!v) m.fail(std::string("malformed manifest (no catalogs[].") + key + ")");
      return m.as(*v, std::string("catalogs[].") + key, [](const Value& x) { return x.as_str(); });
    };
    const std::string rel = field("file");
    if (rel.find("..") != std::string::npos || rel.empty() || rel[0] == '/') {
      m.fail("catalogs[].file: '" + rel + "' must be a path inside the artifact directory");
    }
    const std::string path = dir + "/" + rel;
    if (verify) verify_file(path, field("sha256"));
    try {
      CatalogTrie t;
      for (auto& [name, tensor] : read_safetensors(path).tensors) (name == "offsets" ? t.offsets : t.tokens) = tensor;
      if (!t.offsets.defined() || !t.tokens.defined()) throw std::runtime_error(path + ": not a catalog trie");
      tries.push_back(std::move(t));
    } catch (const std::runtime_error& e) {
      throw std::invalid_argument(e.what());
    }
  }
  a.catalogs = catalog_forest(tries, device, catalog_capacity);
  if (verify && m.root().find("acceptance")) {  // the record itself is read by the Python side only
    verify_file(dir + "/" + kAcceptance, m.str("acceptance.sha256"));
  }

  // The positions any request can reach (service/runtime/python_runtime.py computes the same).
  const int64_t prompt = m.integer("limits.max_prompt_tokens"), new_tokens = m.integer("limits.max_new_tokens");
  a.num_positions = std::max(prompt + new_tokens, m.integer("limits.max_score_tokens"));
  auto [cos, sin] = rope_table(a.cfg.head_dim, a.rope_theta, a.num_positions, device);
  a.rope_cos = cos.to(a.dtype);
  a.rope_sin = sin.to(a.dtype);
  return a;
}

}  // namespace slmrank
