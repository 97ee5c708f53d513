// Loss masks for instruction data: PREFIX.mask says which tokens of PREFIX.bin are loss targets
// (the responses) and which are not (the prompts). A sidecar: PREFIX.bin/.idx stay Megatron's.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "io/mapped_file.h"
#include "lib/core/new_file.h"

namespace mpigpt {

// PREFIX.mask, little-endian: char[8] "MPGTMASK", uint64 version = 1, uint64 N = the tokens of
// PREFIX.bin, then N bytes in .bin order (sequence after sequence), 1 where the token counts as a
// target of the loss and 0 where it does not.
inline constexpr char kMaskMagic[8] = {'M', 'P', 'G', 'T', 'M', 'A', 'S', 'K'};
inline constexpr uint64_t kMaskVersion = 1;
inline constexpr size_t kMaskHeaderBytes = 24;

// Streams the mask beside an IndexedDatasetWriter's tokens; written new and renamed on finish().
class LossMaskWriter {
 public:
  explicit LossMaskWriter(const std::string& prefix);
  void add(std::span<const uint8_t> mask);
  void finish();
  int64_t num_tokens() const { return tokens_; }
  int64_t counted() const { return counted_; }

 private:
  NewFile file_;
  int64_t tokens_ = 0, counted_ = 0;
};

// PREFIX.mask, validated on open against the dataset's token count.
class LossMask {
 public:
  // The mask beside the dataset PREFIX, or null when there is none.
  static std::unique_ptr<LossMask> open_if_present(const std::string& prefix, int64_t tokens);
  // Bytes [first, first + count) of the mask (token indices in .bin order).
  void read(int64_t first, int64_t count, uint8_t* out) const;
  int64_t counted() const { return counted_; }  // tokens that count
  const std::string& path() const { return file_.path(); }

 private:
  LossMask(const std::string& path, int64_t tokens);
  MappedFile file_;
  int64_t tokens_ = 0, counted_ = 0;
};

}  // namespace mpigpt
