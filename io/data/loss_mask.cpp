// PREFIX.mask: the writer prepare-data uses and the reader the datasets use.
#include "io/data/loss_mask.h"

#include <cstring>
#include <filesystem>

#include "lib/core/error.h"

namespace mpigpt {

LossMaskWriter::LossMaskWriter(const std::string& prefix) : file_(prefix + ".mask") {
  char header[kMaskHeaderBytes] = {};
  std::memcpy(header, kMaskMagic, 8);
  std::memcpy(header + 8, &kMaskVersion, 8);
  file_.write(header, sizeof header);  // the count is written by finish()
}

void LossMaskWriter::add(std::span<const uint8_t> mask) {
  for (uint8_t m : mask) counted_ += m != 0;
  file_.write(mask.data(), mask.size());
  tokens_ += int64_t(mask.size());
}

void LossMaskWriter::finish() {
  const uint64_t n = uint64_t(tokens_);
  file_.rewrite(16, &n, 8);
  file_.commit();
}

std::unique_ptr<LossMask> LossMask::open_if_present(const std::string& prefix, int64_t tokens) {
  std::error_code ec;
  if (!std::filesystem::exists(prefix + ".mask", ec)) return nullptr;
  return std::unique_ptr<LossMask>(new LossMask(prefix + ".mask", tokens));
}

LossMask::LossMask(const std::string& path, int64_t tokens) : file_(path, "loss mask"), tokens_(tokens) {
  const char* fix = "re-run `mpigpt prepare-data` with --prompt-key/--response-key for this dataset, or remove "
                    "the file to train on every token";
  if (file_.size() < kMaskHeaderBytes || std::memcmp(file_.data(), kMaskMagic, 8) != 0)
    fail("loss mask {} does not start with the magic \"MPGTMASK\"; {}", path, fix);
  if (const uint64_t v = file_.at<uint64_t>(8); v != kMaskVersion)
    fail("loss mask {} has version {}, this mpigpt reads version {}; {}", path, v, kMaskVersion, fix);
  const uint64_t n = file_.at<uint64_t>(16);
  if (n != uint64_t(tokens) || file_.size() != kMaskHeaderBytes + n)
    fail("loss mask {} is for {} tokens ({} bytes), but its dataset has {} tokens: it belongs to another "
         "dataset; {}", path, n, file_.size(), tokens, fix);
  for (size_t i = kMaskHeaderBytes; i < file_.size(); ++i) {
    const uint8_t m = file_.data()[i];
    if (m > 1) fail("loss mask {}: byte {} of token {} is neither 0 nor 1; {}", path, int(m), i - kMaskHeaderBytes, fix);
    counted_ += m;
  }
}

void LossMask::read(int64_t first, int64_t count, uint8_t* out) const {
  MPIGPT_CHECK(first >= 0 && count >= 0 && first + count <= tokens_, "loss mask {}: tokens [{}, {}) of {}", path(),
               first, first + count, tokens_);
  std::memcpy(out, file_.data() + kMaskHeaderBytes + first, size_t(count));
}

}  // namespace mpigpt
