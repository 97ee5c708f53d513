// MMIDIDX writer and reader (layout in indexed_dataset.h).
#include "io/data/indexed_dataset.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "lib/core/error.h"
#include "lib/core/new_file.h"

namespace mpigpt {

namespace fs = std::filesystem;

int mmidx_dtype_size(int code) {
  switch (code) {
    case 1: case 2: return 1;   // uint8, int8
    case 3: case 8: return 2;   // int16, uint16
    case 4: return 4;           // int32
    case 5: return 8;           // int64
    default: return 0;          // 6 float64, 7 float32 and unknown codes hold no token ids
  }
}

uint8_t mmidx_dtype_for_vocab(int vocab_size) {
  return vocab_size < 65500 ? kMmidxUint16 : kMmidxInt32;
}

// ---- writer ----------------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, int vocab_size)
    : prefix_(std::move(prefix)), vocab_size_(vocab_size), dtype_(mmidx_dtype_for_vocab(vocab_size)) {
  if (vocab_size <= 0) fail("indexed dataset {}: vocabulary size {} must be positive", prefix_, vocab_size);
  fs::path parent = fs::path(prefix_).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) fail("cannot create the directory {} for dataset {}: {}", parent.string(), prefix_, ec.message());
  bin_ = std::make_unique<NewFile>(prefix_ + ".bin");
}

IndexedDatasetWriter::~IndexedDatasetWriter() = default;

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  MPIGPT_CHECK(!finished_, "add_document after finish() on dataset {}", prefix_);
  MPIGPT_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
               "document of {} tokens does not fit MMIDIDX's int32 sequence length", tokens.size());
  const int size = mmidx_dtype_size(dtype_);
  buffer_.resize(tokens.size() * size);
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    if (t < 0 || t >= vocab_size_)
      fail("indexed dataset {}: token id {} of document {} is outside the vocabulary [0, {})",
           prefix_, t, lengths_.size(), vocab_size_);
    if (size == 2) {
      uint16_t v = uint16_t(t);
      std::memcpy(&buffer_[i * 2], &v, 2);
    } else {
      std::memcpy(&buffer_[i * 4], &t, 4);
    }
  }
  bin_->write(buffer_.data(), buffer_.size());
  lengths_.push_back(int32_t(tokens.size()));
  tokens_ += int64_t(tokens.size());
}

template <class T>
static void put(std::vector<uint8_t>& out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.insert(out.end(), b, b + sizeof(T));
}

void IndexedDatasetWriter::finish() {
  MPIGPT_CHECK(!finished_, "finish() called twice on dataset {}", prefix_);

  const uint64_t n = lengths_.size();
  std::vector<uint8_t> out;
  out.reserve(kMmidxHeaderBytes + n * 20 + 16);
  out.insert(out.end(), kMmidxMagic, kMmidxMagic + 9);
  put<uint64_t>(out, kMmidxVersion);
  put<uint8_t>(out, dtype_);
  put<uint64_t>(out, n);
  put<uint64_t>(out, n + 1);  // document_indices = [0, 1, ..., n]: one sequence per document
  for (int32_t len : lengths_) put<int32_t>(out, len);
  int64_t pointer = 0;
  for (int32_t len : lengths_) {
    put<int64_t>(out, pointer);
    pointer += int64_t(len) * mmidx_dtype_size(dtype_);
  }
  for (uint64_t k = 0; k <= n; ++k) put<int64_t>(out, int64_t(k));

  NewFile idx(prefix_ + ".idx");
  idx.write(out.data(), out.size());
  bin_->commit();
  idx.commit();
  finished_ = true;
}

// ---- reader ----------------------------------------------------------------------------------

static constexpr const char* kRemake = "re-create it with `mpigpt prepare-data --output PREFIX ...`";

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  for (const std::string& p : {idx_path, bin_path}) {
    if (!fs::exists(p))
      fail("indexed dataset {}: {} does not exist; a dataset is the pair PREFIX.bin + PREFIX.idx "
           "written by `mpigpt prepare-data --output {}` (or Megatron's preprocess_data.py)",
           prefix, p, prefix);
  }
  idx_ = std::make_unique<MappedFile>(idx_path, "index file");
  bin_ = std::make_unique<MappedFile>(bin_path, "token file");
  const MappedFile& idx = *idx_;
  const size_t size = idx.size();

  if (size >= 9 && std::memcmp(idx.data(), kMmidxMagic, 9) != 0)
    fail("{} is not an MMIDIDX index (it does not start with \"MMIDIDX\\0\\0\"); {}", idx_path,
         kRemake);
  if (size < kMmidxHeaderBytes)
    fail("{} is truncated: {} bytes, shorter than the {}-byte header; {}", idx_path, size,
         kMmidxHeaderBytes, kRemake);
  uint64_t version = idx.at<uint64_t>(9);
  if (version != kMmidxVersion)
    fail("{}: unsupported MMIDIDX version {} (only version 1 exists); {}", idx_path, version, kRemake);
  dtype_ = idx.at<uint8_t>(17);
  dtype_size_ = mmidx_dtype_size(dtype_);
  if (dtype_size_ == 0)
    fail("{}: unsupported token dtype code {} (integer codes 1-5 and 8 hold token ids); {}", idx_path,
         dtype_, kRemake);
  uint64_t n = idx.at<uint64_t>(18), d = idx.at<uint64_t>(26);

  // Sizes come from the file: bound them by the file size before multiplying.
  const uint64_t room = size - kMmidxHeaderBytes;
  if (n > room / 12 || d > (room - n * 12) / 8)
    fail("{} is truncated: it lists {} sequences and {} document indices, which need {} bytes, "
         "but the file has {}; {}", idx_path, n, d,
         double(kMmidxHeaderBytes) + 12.0 * double(n) + 8.0 * double(d), size, kRemake);
  num_sequences_ = int64_t(n);
  num_doc_indices_ = int64_t(d);
  lengths_at_ = kMmidxHeaderBytes;
  pointers_at_ = lengths_at_ + 4 * n;
  docs_at_ = pointers_at_ + 8 * n;

  if (d < 1 || document_index(0) != 0 || document_index(int64_t(d) - 1) != int64_t(n))
    fail("{} is inconsistent: document_indices must run from 0 to the sequence count {} (found {} "
         "entries{}); {}", idx_path, n, d,
         d >= 1 ? fmt::format(", first {}, last {}", document_index(0), document_index(int64_t(d) - 1))
                : std::string(),
         kRemake);
  for (int64_t k = 1; k < int64_t(d); ++k)
    if (document_index(k) < document_index(k - 1))
      fail("{} is inconsistent: document_indices decrease at entry {}; {}", idx_path, k, kRemake);

  const int64_t bin_size = int64_t(bin_->size());
  for (int64_t i = 0; i < num_sequences_; ++i) {
    int64_t len = sequence_length(i), ptr = sequence_pointer(i);
    if (len < 0 || ptr < 0)
      fail("{} is corrupt: sequence {} has length {} at byte {}; {}", idx_path, i, len, ptr, kRemake);
    if (ptr > bin_size || len > (bin_size - ptr) / dtype_size_)
      fail("{} is shorter than its index says: sequence {} needs {} bytes from byte {} but the file has {} "
           "bytes (truncated copy, or a .bin from another run); {}", bin_path, i, len * dtype_size_, ptr,
           bin_size, kRemake);
    num_tokens_ += len;
  }
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  MPIGPT_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {} in {}", i, num_sequences_, prefix_);
  return idx_->at<int32_t>(lengths_at_ + 4 * size_t(i));
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  MPIGPT_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {} in {}", i, num_sequences_, prefix_);
  return idx_->at<int64_t>(pointers_at_ + 8 * size_t(i));
}

int64_t IndexedDataset::document_index(int64_t k) const {
  MPIGPT_CHECK(k >= 0 && k < num_doc_indices_, "document index {} of {} in {}", k, num_doc_indices_,
               prefix_);
  return idx_->at<int64_t>(docs_at_ + 8 * size_t(k));
}

template <class T>
static void widen(const uint8_t* p, int64_t count, int32_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, p + i * int64_t(sizeof(T)), sizeof(T));
    out[i] = int32_t(v);
  }
}

void IndexedDataset::read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const {
  int64_t len = sequence_length(seq);
  MPIGPT_CHECK(offset >= 0 && count >= 0 && offset + count <= len,
               "read of tokens [{}, {}) from sequence {} of length {} in {}", offset, offset + count,
               seq, len, prefix_);
  const uint8_t* p = bin_->data() + sequence_pointer(seq) + offset * dtype_size_;
  switch (dtype_) {
    case 1: widen<uint8_t>(p, count, out); break;
    case 2: widen<int8_t>(p, count, out); break;
    case 3: widen<int16_t>(p, count, out); break;
    case 4: widen<int32_t>(p, count, out); break;
    case 8: widen<uint16_t>(p, count, out); break;
    case 5:
      for (int64_t i = 0; i < count; ++i) {
        int64_t v;
        std::memcpy(&v, p + 8 * i, 8);
        // A wider id than int32 cannot be in any vocabulary; -1 makes the caller's range check fire.
        out[i] = (v < 0 || v > std::numeric_limits<int32_t>::max()) ? -1 : int32_t(v);
      }
      break;
  }
}

}  // namespace mpigpt
