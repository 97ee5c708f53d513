// llm.c token files (dev/data/*.bin from Karpathy's llm.c): a 1024-byte header of 256 int32
// (magic 20240520, version, token count, zeros), then one long token stream, documents separated
// by the EOT token: uint16 tokens for version 1 (GPT-2), uint32 for version 2 (Llama 3).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/mapped_file.h"
#include "lib/core/new_file.h"

namespace mpigpt {

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// True when `path` is a readable file that starts with the llm.c magic number.
bool is_llmc_token_file(const std::string& path);

// Streams token ids into an llm.c token file (version 1: uint16 ids, version 2: uint32 ids),
// written new and renamed into place by finish() (lib/core/new_file.h); the header's count is
// filled in last.
class LlmcTokenWriter {
 public:
  explicit LlmcTokenWriter(const std::string& path, int version = 1);
  ~LlmcTokenWriter();  // without finish(): nothing is left
  void add(std::span<const int32_t> tokens);  // errors name an id that does not fit the version
  void finish();
  int64_t num_tokens() const { return count_; }

 private:
  std::unique_ptr<NewFile> file_;
  int version_;
  int64_t count_ = 0;
  std::vector<uint8_t> buffer_;
};

// `tokens` as one llm.c token file.
void write_llmc_tokens(const std::string& path, std::span<const int32_t> tokens, int version = 1);

// Memory-mapped reader, validated on open (magic, version, size = header + count tokens).
class LlmcTokenFile {
 public:
  explicit LlmcTokenFile(const std::string& path);

  const std::string& path() const { return file_->path(); }
  int version() const { return version_; }
  int64_t num_tokens() const { return num_tokens_; }
  // tokens [offset, offset + count), widened to int32.
  void read(int64_t offset, int64_t count, int32_t* out) const;

 private:
  std::unique_ptr<MappedFile> file_;
  int version_ = 0;
  int64_t num_tokens_ = 0;
};

}  // namespace mpigpt
