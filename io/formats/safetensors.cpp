// safetensors reader and writer, single files and sharded models with an index.
#include "io/formats/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace fs = std::filesystem;
using nlohmann::json;

// A file: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
// "data_offsets": [begin, end]}, "__metadata__": {str: str}} (padded with spaces so the data
// starts 8-byte aligned), then the raw little-endian tensor bytes, offsets relative to the data
// start. A model above a size threshold is split into `model-00001-of-0000K.safetensors` shards
// listed by `model.safetensors.index.json` {"metadata": {"total_size": bytes}, "weight_map":
// {name: shard file}}.
namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

// Bytes per element of every dtype the safetensors specification names.
int dtype_bytes(const std::string& t) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"F64", 8}, {"I64", 8},
      {"U64", 8}};
  auto it = sizes.find(t);
  return it == sizes.end() ? 0 : it->second;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = std::ldexp(float(man), -24);
    bits = sign | std::bit_cast<uint32_t>(v);
  }
  return std::bit_cast<float>(bits);
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// One header entry, validated against the data section of `data_bytes` bytes.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v, uint64_t data_bytes) {
  const char* fix = "the file is damaged or not written by a safetensors writer; download or export it again";
  if (!v.is_object()) fail("safetensors file {}: tensor '{}': header entry {} is not an object; {}", path, name, v.dump(), fix);
  SafetensorsEntry e;
  if (!v.contains("dtype") || !v["dtype"].is_string())
    fail("safetensors file {}: tensor '{}' has no \"dtype\" string; {}", path, name, fix);
  e.dtype = v["dtype"].get<std::string>();
  const int esize = dtype_bytes(e.dtype);
  if (esize == 0)
    fail("safetensors file {}: tensor '{}' has unknown dtype '{}' (known: BOOL, U8, I8, F8_E4M3, F8_E5M2, I16, U16, "
         "F16, BF16, I32, U32, F32, F64, I64, U64); {}", path, name, e.dtype, fix);
  if (!v.contains("shape") || !v["shape"].is_array())
    fail("safetensors file {}: tensor '{}' has no \"shape\" array; {}", path, name, fix);
  uint64_t numel = 1;
  for (const json& d : v["shape"]) {
    if (!d.is_number_unsigned())
      fail("safetensors file {}: tensor '{}': shape {} holds {}, not a non-negative integer; {}", path, name,
           v["shape"].dump(), d.dump(), fix);
    e.shape.push_back(int64_t(d.get<uint64_t>()));
    if (__builtin_mul_overflow(numel, d.get<uint64_t>(), &numel) || numel > (uint64_t(1) << 62))
      fail("safetensors file {}: tensor '{}': shape {} has an impossible element count; {}", path, name,
           v["shape"].dump(), fix);
  }
  const json& off = v.contains("data_offsets") ? v["data_offsets"] : json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    fail("safetensors file {}: tensor '{}': \"data_offsets\" {} is not [begin, end] of non-negative integers; {}",
         path, name, off.dump(), fix);
  e.begin = off[0].get<uint64_t>();
  e.end = off[1].get<uint64_t>();
  if (e.begin > e.end || e.end > data_bytes)
    fail("safetensors file {}: tensor '{}': data_offsets [{}, {}] lie outside the {}-byte data section (truncated "
         "download?); {}", path, name, e.begin, e.end, data_bytes, fix);
  if (e.end - e.begin != numel * uint64_t(esize))
    fail("safetensors file {}: tensor '{}': shape {} of {} needs {} bytes but data_offsets [{}, {}] span {}; {}",
         path, name, shape_text(e.shape), e.dtype, numel * esize, e.begin, e.end, e.end - e.begin, fix);
  return e;
}

json read_json_file(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) fail("cannot open {} {}: {}", what, path, std::strerror(errno));
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail("{} {} is not valid JSON: {}; download or export it again", what, path, e.what());
  }
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) {
  file_ = std::make_unique<MappedFile>(path, "safetensors file");
  const size_t size = file_->size();
  const char* fix = "the file is damaged or not a safetensors file; download or export it again";
  if (size < 8) fail("safetensors file {} is truncated: {} bytes, shorter than the 8-byte header length; {}", path, size, fix);
  const uint64_t n = file_->at<uint64_t>(0);
  if (n > kMaxHeaderBytes)
    fail("safetensors file {}: header length {} exceeds the {}-byte limit (not a safetensors file?); {}", path, n,
         kMaxHeaderBytes, fix);
  if (n > size - 8)
    fail("safetensors file {}: header length {} runs beyond the end of the {}-byte file (truncated?); {}", path, n,
         size, fix);
  const std::string text(reinterpret_cast<const char*>(file_->data()) + 8, n);
  if (text.empty() || text[0] != '{') fail("safetensors file {}: the header does not start with '{{'; {}", path, fix);
  json header;
  try {
    header = json::parse(text);
  } catch (const json::exception& e) {
    fail("safetensors file {}: the header is not valid JSON ({}); {}", path, e.what(), fix);
  }
  if (!header.is_object()) fail("safetensors file {}: the header is not a JSON object; {}", path, fix);
  data_begin_ = 8 + n;
  const uint64_t data_bytes = size - data_begin_;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail("safetensors file {}: \"__metadata__\" is not an object; {}", path, fix);
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string())
          fail("safetensors file {}: metadata '{}' = {} is not a string; {}", path, k, s.dump(), fix);
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    entries_[name] = parse_entry(path, name, v, data_bytes);
  }
  std::vector<std::pair<const std::string*, const SafetensorsEntry*>> order;
  for (const auto& [name, e] : entries_) order.push_back({&name, &e});
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin : a.second->end < b.second->end;
  });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i].second->begin < order[i - 1].second->end)
      fail("safetensors file {}: tensors '{}' (bytes [{}, {})) and '{}' (bytes [{}, {})) overlap; {}", path,
           *order[i - 1].first, order[i - 1].second->begin, order[i - 1].second->end, *order[i].first,
           order[i].second->begin, order[i].second->end, fix);
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) fail("safetensors file {} has no tensor '{}'", path(), name);
  return it->second;
}

HostTensor SafetensorsFile::read(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  if (e.shape.size() > size_t(kMaxDims))
    fail("safetensors file {}: tensor '{}' has {} dimensions {}; at most {} are supported", path(), name,
         e.shape.size(), shape_text(e.shape), kMaxDims);
  HostTensor t;
  for (int64_t d : e.shape) t.shape.d[t.shape.ndim++] = d;
  const int64_t n = t.shape.numel();
  t.data.resize(size_t(n));
  const uint8_t* src = file_->data() + data_begin_ + e.begin;
  float* dst = t.data.data();
  if (e.dtype == "F32") {
    if (n > 0) std::memcpy(dst, src, size_t(n) * 4);  // an empty tensor's vector has no data pointer
  } else if (e.dtype == "BF16") {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = std::bit_cast<float>(uint32_t(h) << 16);
    }
  } else if (e.dtype == "F16") {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = f16_to_f32(h);
    }
  } else if (e.dtype == "F64") {
    for (int64_t i = 0; i < n; ++i) {
      double v;
      std::memcpy(&v, src + 8 * i, 8);
      dst[i] = float(v);
    }
  } else {
    fail("safetensors file {}: tensor '{}' is {}; only floating-point weights (F32, BF16, F16, F64) can be read",
         path(), name, e.dtype);
  }
  return t;
}

void write_safetensors(const std::string& path, const TensorMap& tensors, const SafetensorsMetadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__") fail("safetensors file {}: a tensor may not be named '__metadata__'", path);
    if (t.shape.numel() != int64_t(t.data.size()))
      fail("writing safetensors file {}: tensor '{}' has shape {} ({} elements) but holds {} values", path, name,
           t.shape.str(), t.shape.numel(), t.data.size());
    std::vector<int64_t> shape(t.shape.d.begin(), t.shape.d.begin() + t.shape.ndim);
    const uint64_t bytes = t.data.size() * sizeof(float);
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const uint64_t n = text.size();
  NewFile f(path);
  f.write(&n, 8);
  f.write(text);
  for (const auto& [name, t] : tensors) f.write(t.data.data(), t.data.size() * sizeof(float));
  f.commit();
}

TensorMap read_safetensors(const std::string& path, SafetensorsMetadata* metadata) {
  SafetensorsFile f(path);
  TensorMap out;
  for (const auto& [name, e] : f.entries()) out[name] = f.read(name);
  if (metadata) *metadata = f.metadata();
  return out;
}

std::vector<std::string> save_safetensors_model(const std::string& dir, const TensorMap& tensors,
                                                uint64_t shard_bytes, const SafetensorsMetadata& metadata) {
  if (shard_bytes == 0) fail("save_safetensors_model: the shard size must be positive");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create the model directory {}: {}", dir, ec.message());
  static const std::regex shard_name(R"(model-\d{5}-of-\d{5}\.safetensors)");
  for (const auto& de : fs::directory_iterator(dir)) {
    const std::string name = de.path().filename().string();
    if (de.is_regular_file() && (name == kSafetensorsFile || name == kSafetensorsIndex ||
                                 std::regex_match(name, shard_name)))
      fs::remove(de.path());
  }
  // Shards in name order; a new one starts when the next tensor would overflow the current one.
  std::vector<TensorMap> shards(1);
  uint64_t current = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const uint64_t bytes = t.data.size() * sizeof(float);
    if (current > 0 && current + bytes > shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back()[name] = t;
    current += bytes;
    total += bytes;
  }
  std::vector<std::string> written;
  if (shards.size() == 1) {
    written.push_back((fs::path(dir) / kSafetensorsFile).string());
    write_safetensors(written.back(), tensors, metadata);
    return written;
  }
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
    written.push_back((fs::path(dir) / file).string());
    write_safetensors(written.back(), shards[i], metadata);
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  written.push_back((fs::path(dir) / kSafetensorsIndex).string());
  NewFile out(written.back());
  out.write(index.dump(2) + "\n");
  out.commit();
  return written;
}

namespace {

TensorMap load_index(const std::string& index_path) {
  const json index = read_json_file(index_path, "safetensors index");
  const char* fix = "download or export the model again";
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    fail("safetensors index {} has no \"weight_map\" object; {}", index_path, fix);
  std::map<std::string, std::set<std::string>> by_file;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      fail("safetensors index {}: weight_map['{}'] = {} is not a file name; {}", index_path, name, file.dump(), fix);
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
      fail("safetensors index {}: weight_map['{}'] = '{}' is not a file name in the model directory; {}", index_path,
           name, f, fix);
    by_file[f].insert(name);
  }
  if (by_file.empty()) fail("safetensors index {} lists no tensors; {}", index_path, fix);
  const fs::path dir = fs::path(index_path).parent_path();
  TensorMap out;
  for (const auto& [file, names] : by_file) {
    SafetensorsFile f((dir / file).string());
    for (const std::string& name : names)
      if (!f.has(name))
        fail("safetensors index {} puts tensor '{}' in {}, which does not hold it; {}", index_path, name, f.path(), fix);
    for (const auto& [name, e] : f.entries()) {
      if (!names.count(name))
        fail("safetensors shard {} holds tensor '{}', which the index {} does not list in this file; {}", f.path(),
             name, index_path, fix);
      out[name] = f.read(name);
    }
  }
  return out;
}

}  // namespace

TensorMap load_safetensors_model(const std::string& path) {
  if (!fs::is_directory(path)) {
    if (path.size() >= 5 && path.ends_with(".json")) return load_index(path);
    return read_safetensors(path);
  }
  const fs::path single = fs::path(path) / kSafetensorsFile, index = fs::path(path) / kSafetensorsIndex;
  const bool has_single = fs::exists(single), has_index = fs::exists(index);
  if (has_single && has_index)
    fail("model directory {} holds both {} and {}; it is unclear which is current, remove the stale one", path,
         kSafetensorsFile, kSafetensorsIndex);
  if (has_single) return read_safetensors(single.string());
  if (has_index) return load_index(index.string());
  fail("model directory {} holds neither {} nor {}; point to a Hugging Face model directory with safetensors "
       "weights (pytorch_model.bin is not read: convert it with transformers' save_pretrained(safe_serialization=True))",
       path, kSafetensorsFile, kSafetensorsIndex);
}

}  // namespace mpigpt
