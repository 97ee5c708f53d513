// llm.c token file reader and writer (format in llmc_tokens.h).
#include "io/data/llmc_tokens.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

static int token_bytes(int version) { return version == 1 ? 2 : version == 2 ? 4 : 0; }

bool is_llmc_token_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  int32_t magic = 0;
  bool ok = std::fread(&magic, sizeof magic, 1, f) == 1 && magic == kLlmcMagic;
  std::fclose(f);
  return ok;
}

LlmcTokenWriter::LlmcTokenWriter(const std::string& path, int version) : version_(version) {
  if (token_bytes(version) == 0) fail("llm.c token file {}: version {} is not 1 (uint16) or 2 (uint32)", path, version);
  file_ = std::make_unique<NewFile>(path);
  const std::vector<int32_t> header(256, 0);  // its magic, version and count are written by finish()
  file_->write(header.data(), kLlmcHeaderBytes);
}

LlmcTokenWriter::~LlmcTokenWriter() = default;

void LlmcTokenWriter::add(std::span<const int32_t> tokens) {
  const int bytes = token_bytes(version_);
  const int64_t max_id = version_ == 1 ? 65535 : std::numeric_limits<int32_t>::max();
  buffer_.resize(tokens.size() * size_t(bytes));
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] > max_id)
      fail("llm.c token file {}: token id {} at position {} does not fit version {}'s {}-byte ids", file_->path(),
           tokens[i], count_ + int64_t(i), version_, bytes);
    const uint32_t v = uint32_t(tokens[i]);
    std::memcpy(&buffer_[i * size_t(bytes)], &v, size_t(bytes));  // little-endian: the low bytes first
  }
  file_->write(buffer_.data(), buffer_.size());
  count_ += int64_t(tokens.size());
  if (count_ > std::numeric_limits<int32_t>::max())
    fail("llm.c token file {}: {} tokens exceed the header's int32 count; split the input into shards", file_->path(),
         count_);
}

void LlmcTokenWriter::finish() {
  const int32_t head[3] = {kLlmcMagic, version_, int32_t(count_)};
  file_->rewrite(0, head, sizeof head);
  file_->commit();
}

void write_llmc_tokens(const std::string& path, std::span<const int32_t> tokens, int version) {
  LlmcTokenWriter w(path, version);
  w.add(tokens);
  w.finish();
}

LlmcTokenFile::LlmcTokenFile(const std::string& path) {
  file_ = std::make_unique<MappedFile>(path, "llm.c token file");
  const size_t size = file_->size();
  const char* fix = "re-create it with llm.c's dev/data scripts (or use `mpigpt prepare-data`)";
  if (size >= 4 && file_->at<int32_t>(0) != kLlmcMagic)
    fail("{} is not an llm.c token file: magic number {} instead of {}; {}", path,
         file_->at<int32_t>(0), kLlmcMagic, fix);
  if (size < kLlmcHeaderBytes)
    fail("llm.c token file {} is truncated: {} bytes, shorter than the {}-byte header; {}", path, size,
         kLlmcHeaderBytes, fix);
  version_ = file_->at<int32_t>(4);
  const int bytes = token_bytes(version_);
  if (bytes == 0)
    fail("llm.c token file {}: unsupported version {} (1 = GPT-2 uint16 tokens, 2 = Llama 3 uint32 "
         "tokens); {}", path, version_, fix);
  int32_t count = file_->at<int32_t>(8);
  if (count < 0) fail("llm.c token file {}: negative token count {} in the header; {}", path, count, fix);
  num_tokens_ = count;
  const uint64_t expected = kLlmcHeaderBytes + uint64_t(count) * bytes;
  if (size < expected)
    fail("llm.c token file {} is truncated: the header promises {} tokens ({} bytes in all) but the "
         "file has {} bytes; {}", path, count, expected, size, fix);
  if (size > expected)
    fail("llm.c token file {} is longer than its header says: {} tokens need {} bytes, the file has "
         "{}; {}", path, count, expected, size, fix);
}

void LlmcTokenFile::read(int64_t offset, int64_t count, int32_t* out) const {
  MPIGPT_CHECK(offset >= 0 && count >= 0 && offset + count <= num_tokens_,
               "read of tokens [{}, {}) from {} with {} tokens", offset, offset + count, path(),
               num_tokens_);
  const uint8_t* p = file_->data() + kLlmcHeaderBytes;
  if (version_ == 1) {
    for (int64_t i = 0; i < count; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * (offset + i), 2);
      out[i] = v;
    }
  } else {
    for (int64_t i = 0; i < count; ++i) {
      uint32_t v;
      std::memcpy(&v, p + 4 * (offset + i), 4);
      out[i] = v > uint32_t(std::numeric_limits<int32_t>::max()) ? -1 : int32_t(v);
    }
  }
}

}  // namespace mpigpt
