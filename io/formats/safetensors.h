// safetensors, the Hugging Face weight format: single files and sharded model directories, read
// and written (byte layout in safetensors.cpp and docs/checkpoint-format.md). We write F32 and
// read F32, BF16, F16 and F64 into fp32; every other dtype is listed but refused when read.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/formats/tensor_map.h"
#include "io/mapped_file.h"

namespace mpigpt {

using SafetensorsMetadata = std::map<std::string, std::string>;

// Hugging Face's default max_shard_size ("5GB" = 5e9 bytes of tensor data per shard).
inline constexpr uint64_t kHfShardBytes = 5000000000ull;
inline constexpr const char* kSafetensorsFile = "model.safetensors";
inline constexpr const char* kSafetensorsIndex = "model.safetensors.index.json";

// One tensor as the header describes it.
struct SafetensorsEntry {
  std::string dtype;            // "F32", "BF16", "F16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

// A memory-mapped safetensors file, validated on open: header length within the file and below
// 100 MB, JSON an object, every dtype known, shape non-negative, offsets inside the data section,
// end - begin = numel * dtype size, no two tensors overlapping. Errors name the file and tensor.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsMetadata& metadata() const { return metadata_; }
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  const SafetensorsEntry& entry(const std::string& name) const;  // error naming file and tensor
  // The tensor converted to fp32 (F32, BF16, F16, F64); at most 4 dimensions.
  HostTensor read(const std::string& name) const;

 private:
  std::unique_ptr<MappedFile> file_;
  uint64_t data_begin_ = 0;
  std::map<std::string, SafetensorsEntry> entries_;
  SafetensorsMetadata metadata_;
};

// One file with every tensor as F32. Hugging Face transformers refuses files whose metadata
// "format" is not "pt"/"tf"/"flax"/"mlx", hence the default. Written to PATH.tmp, then renamed.
void write_safetensors(const std::string& path, const TensorMap& tensors,
                       const SafetensorsMetadata& metadata = {{"format", "pt"}});
TensorMap read_safetensors(const std::string& path, SafetensorsMetadata* metadata = nullptr);

// Saves a model into directory `dir` (created if needed) the way transformers' save_pretrained
// does: model.safetensors when the tensor data fits in `shard_bytes`, else shards filled in name
// order (a new shard starts when the next tensor would overflow; a tensor larger than
// `shard_bytes` gets a shard of its own) plus the index. Stale model.safetensors / index /
// model-*-of-*.safetensors from an earlier save are removed first. Returns the files written.
std::vector<std::string> save_safetensors_model(const std::string& dir, const TensorMap& tensors,
                                                uint64_t shard_bytes = kHfShardBytes,
                                                const SafetensorsMetadata& metadata = {{"format", "pt"}});
// Loads every tensor from `path`: a .safetensors file, an index .json, or a directory holding
// model.safetensors or model.safetensors.index.json (both at once is an error). With an index,
// each listed tensor must be in its shard and each shard tensor listed.
TensorMap load_safetensors_model(const std::string& path);

}  // namespace mpigpt
