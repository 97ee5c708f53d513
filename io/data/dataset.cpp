// TokenSource (format detection, uniform reads) and GptDataset (split, stream, epoch shuffles).
#include "io/data/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "io/data/indexed_dataset.h"
#include "io/data/llmc_tokens.h"
#include "io/data/loss_mask.h"
#include "lib/core/error.h"
#include "lib/core/rng.h"

namespace mpigpt {

namespace fs = std::filesystem;

// ---- TokenSource -----------------------------------------------------------------------------

static bool has_mmidx_magic(const std::string& idx_path) {
  std::FILE* f = std::fopen(idx_path.c_str(), "rb");
  if (!f) return false;
  char magic[9];
  bool ok = std::fread(magic, 1, 9, f) == 9 && std::memcmp(magic, kMmidxMagic, 9) == 0;
  std::fclose(f);
  return ok;
}

std::shared_ptr<TokenSource> TokenSource::open(const std::string& path) {
  std::shared_ptr<TokenSource> src(new TokenSource());
  src->path_ = path;
  if (path.empty())
    fail("no dataset given: set data.path to a prefix written by `mpigpt prepare-data --output PREFIX` "
         "(PREFIX.bin + PREFIX.idx) or to an llm.c token file");
  // "data/x.bin" or "data/x.idx" of an indexed dataset: the user meant the prefix.
  for (const char* suffix : {".bin", ".idx"}) {
    if (path.ends_with(suffix)) {
      std::string prefix = path.substr(0, path.size() - 4);
      if (has_mmidx_magic(prefix + ".idx")) {
        src->indexed_ = std::make_unique<IndexedDataset>(prefix);
        src->mask_ = LossMask::open_if_present(prefix, src->indexed_->num_tokens());
        return src;
      }
    }
  }
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    if (is_llmc_token_file(path)) {
      src->llmc_ = std::make_unique<LlmcTokenFile>(path);
      return src;
    }
    std::string idx_hint;
    if (path.ends_with(".bin"))
      idx_hint = fmt::format(" (there is no MMIDIDX index {}.idx beside it)", path.substr(0, path.size() - 4));
    fail("dataset {} is neither an llm.c token file (it does not start with the magic number {}) "
         "nor the .bin/.idx of an indexed dataset{}; give the prefix PREFIX of PREFIX.bin + PREFIX.idx "
         "written by `mpigpt prepare-data --output PREFIX`", path, kLlmcMagic, idx_hint);
  }
  if (fs::exists(path + ".idx", ec) || fs::exists(path + ".bin", ec)) {
    src->indexed_ = std::make_unique<IndexedDataset>(path);  // validates both halves
    src->mask_ = LossMask::open_if_present(path, src->indexed_->num_tokens());
    return src;
  }
  fail("dataset {} not found: expected {}.bin + {}.idx (make them with `mpigpt prepare-data --output "
       "{} ...`) or an llm.c token file at {}", path, path, path, path, path);
}

TokenSource::~TokenSource() = default;

int64_t TokenSource::num_documents() const { return indexed_ ? indexed_->num_sequences() : 1; }

int64_t TokenSource::document_length(int64_t d) const {
  if (indexed_) return indexed_->sequence_length(d);
  MPIGPT_CHECK(d == 0, "document {} of the single-document llm.c file {}", d, path_);
  return llmc_->num_tokens();
}

int64_t TokenSource::num_tokens() const {
  return indexed_ ? indexed_->num_tokens() : llmc_->num_tokens();
}

void TokenSource::read(int64_t doc, int64_t offset, int64_t count, int32_t* out) const {
  if (indexed_) {
    indexed_->read(doc, offset, count, out);
  } else {
    MPIGPT_CHECK(doc == 0, "document {} of the single-document llm.c file {}", doc, path_);
    llmc_->read(offset, count, out);
  }
}

void TokenSource::read_mask(int64_t doc, int64_t offset, int64_t count, uint8_t* out) const {
  MPIGPT_CHECK(mask_ && indexed_, "dataset {} has no loss mask", path_);
  mask_->read(indexed_->sequence_pointer(doc) / mmidx_dtype_size(indexed_->dtype_code()) + offset, count, out);
}

std::string TokenSource::format() const { return indexed_ ? "indexed dataset" : "llm.c token file"; }

// ---- GptDataset ------------------------------------------------------------------------------

// A uniform draw from [0, n) out of 64 random bits (multiply-high: no modulo bias worth naming).
static uint64_t below(uint64_t bits, uint64_t n) {
  return uint64_t((static_cast<unsigned __int128>(bits) * n) >> 64);
}

static const char* split_name(Split s) { return s == Split::Train ? "train" : "validation"; }

GptDataset::GptDataset(std::shared_ptr<const TokenSource> src, Split split, double valid_fraction,
                       int seq_len, uint64_t seed, int vocab_size, bool shuffle)
    : src_(std::move(src)), split_(split), seq_len_(seq_len), seed_(seed), vocab_size_(vocab_size), shuffle_(shuffle) {
  MPIGPT_CHECK(src_ != nullptr, "GptDataset needs a TokenSource");
  const std::string& path = src_->path();
  if (!(valid_fraction >= 0.0 && valid_fraction < 1.0))
    fail("data.valid_fraction = {} must lie in [0, 1) (dataset {})", valid_fraction, path);
  if (seq_len < 1) fail("model.seq_len = {} must be at least 1", seq_len);
  if (vocab_size < 1) fail("model.vocab_size = {} must be at least 1", vocab_size);
  const int64_t num_docs = src_->num_documents();
  if (num_docs == 0 || src_->num_tokens() == 0)
    fail("dataset {} is empty ({} documents, {} tokens); prepare it from non-empty text with "
         "`mpigpt prepare-data`", path, num_docs, src_->num_tokens());
  if (num_docs > int64_t(std::numeric_limits<uint32_t>::max()))
    fail("dataset {} has {} documents; at most 2^32 - 1 are supported, split it into several", path,
         num_docs);

  if (num_docs == 1) {
    const int64_t total = src_->document_length(0);
    const int64_t valid = valid_fraction > 0 ? std::llround(valid_fraction * double(total)) : 0;
    first_token_ = split == Split::Train ? 0 : total - valid;
    tokens_ = split == Split::Train ? total - valid : valid;
    docs_ = {0};
    starts_ = {0, tokens_};
  } else {
    // One seed-fixed order of all documents; train and validation are its two ends, so they are
    // disjoint for any seed and every instance agrees on them.
    std::vector<uint32_t> order(static_cast<size_t>(num_docs));
    for (size_t i = 0; i < order.size(); ++i) order[i] = uint32_t(i);
    const uint64_t stream = stream_of("data.documents");
    for (size_t j = order.size() - 1; shuffle && j > 0; --j)
      std::swap(order[j], order[below(bits_at(seed, stream, j), j + 1)]);
    int64_t valid = 0;
    if (valid_fraction > 0)
      valid = std::clamp<int64_t>(std::llround(valid_fraction * double(num_docs)), 1, num_docs - 1);
    auto first = split == Split::Train ? order.begin() : order.end() - valid;
    auto last = split == Split::Train ? order.end() - valid : order.end();
    docs_.assign(first, last);
    starts_.reserve(docs_.size() + 1);
    for (uint32_t d : docs_) {
      starts_.push_back(tokens_);
      tokens_ += src_->document_length(d);
    }
    starts_.push_back(tokens_);
  }

  if (tokens_ < int64_t(seq_len) + 1) {
    std::string hint = split == Split::Valid
                           ? " (raise data.valid_fraction or give data.valid_path)"
                           : "";
    fail("the {} split of dataset {} has {} tokens, a sample needs seq_len+1 = {}; use more data{} "
         "or a smaller model.seq_len", split_name(split), path, tokens_, int64_t(seq_len) + 1, hint);
  }
  windows_ = (tokens_ - 1) / seq_len;
  if (windows_ > int64_t(std::numeric_limits<uint32_t>::max()))
    fail("dataset {} gives {} samples per epoch; at most 2^32 - 1 are supported, split it into "
         "several", path, windows_);
}

int64_t GptDataset::window_of(int64_t index) const {
  MPIGPT_CHECK(index >= 0, "sample index {} must be non-negative", index);
  const int64_t epoch = index / windows_, pos = index % windows_;
  if (!shuffle_) return pos;
  std::lock_guard<std::mutex> lock(mutex_);
  EpochOrder* slot = nullptr;
  for (EpochOrder& o : orders_)
    if (o.epoch == epoch) slot = &o;
  if (!slot) {
    slot = orders_[0].last_use <= orders_[1].last_use ? &orders_[0] : &orders_[1];
    slot->epoch = epoch;
    slot->window.resize(static_cast<size_t>(windows_));
    for (size_t i = 0; i < slot->window.size(); ++i) slot->window[i] = uint32_t(i);
    const uint64_t stream = stream_of(fmt::format("data.{}.epoch.{}", split_name(split_), epoch));
    for (size_t j = slot->window.size() - 1; j > 0; --j)
      std::swap(slot->window[j], slot->window[below(bits_at(seed_, stream, j), j + 1)]);
  }
  slot->last_use = ++uses_;
  return slot->window[static_cast<size_t>(pos)];
}

template <class F>
void GptDataset::for_pieces(int64_t pos, int64_t count, F&& piece) const {
  // The document holding `pos`: the last start at or before it.
  size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin()) - 1;
  for (int64_t done = 0; done < count; ++k) {
    const int64_t take = std::min(count - done, starts_[k + 1] - pos);
    piece(docs_[k], first_token_ + pos - starts_[k], take, done);
    pos += take;
    done += take;
  }
}

void GptDataset::read_stream(int64_t pos, int64_t count, int32_t* out) const {
  for_pieces(pos, count, [&](uint32_t doc, int64_t offset, int64_t take, int64_t at) {
    int32_t* o = out + at;
    src_->read(doc, offset, take, o);
    for (int64_t i = 0; i < take; ++i) {
      if (o[i] < 0 || o[i] >= vocab_size_)
        fail("dataset {}: token id {} (document {}) is not below the model's vocabulary size {}; the "
             "data was prepared with another tokenizer — re-run `mpigpt prepare-data` with the "
             "tokenizer named in data.tokenizer, or check model.vocab_size", src_->path(), o[i],
             doc, vocab_size_);
    }
  });
}

void GptDataset::get(int64_t index, int32_t* tokens, int32_t* targets, int32_t* positions) const {
  const int64_t w = window_of(index);
  std::vector<int32_t> buf(static_cast<size_t>(seq_len_) + 1);
  read_stream(w * seq_len_, seq_len_ + 1, buf.data());
  std::memcpy(tokens, buf.data(), sizeof(int32_t) * size_t(seq_len_));
  std::memcpy(targets, buf.data() + 1, sizeof(int32_t) * size_t(seq_len_));
  if (src_->loss_mask()) {  // the targets' mask bytes: tokens 1 .. T of the window
    std::vector<uint8_t> mask(static_cast<size_t>(seq_len_));
    for_pieces(w * seq_len_ + 1, seq_len_, [&](uint32_t doc, int64_t offset, int64_t take, int64_t at) {
      src_->read_mask(doc, offset, take, mask.data() + at);
    });
    for (int t = 0; t < seq_len_; ++t)
      if (!mask[size_t(t)]) targets[t] = -1;
  }
  if (!positions) return;
  // Document boundaries come from the split's document starts (not from scanning for an EOD id,
  // which a tokenizer may also produce inside a document).
  const int64_t first = w * seq_len_;
  size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), first) - starts_.begin());  // next start
  int32_t p = 0;
  for (int64_t t = 0; t < seq_len_; ++t, ++p) {
    if (k < starts_.size() && starts_[k] == first + t) {
      p = 0;
      ++k;
    }
    positions[t] = p;
    // Token t's target is token t+1: when a document starts there, the pair crosses documents.
    if (k < starts_.size() && starts_[k] == first + t + 1) targets[t] = -1;
  }
}

}  // namespace mpigpt
