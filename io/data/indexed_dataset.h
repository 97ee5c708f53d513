// Megatron-compatible indexed dataset ("MMIDIDX"): PREFIX.bin holds the tokens of every sequence
// back to back, PREFIX.idx says where each one starts. Files written here are read by
// Megatron-LM's megatron/core/datasets/indexed_dataset.py and the other way round.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/mapped_file.h"
#include "lib/core/new_file.h"

namespace mpigpt {

// PREFIX.idx, all little-endian, no padding (so the arrays sit at unaligned offsets):
//   char[9]  "MMIDIDX\0\0"
//   uint64   version = 1
//   uint8    dtype code of the .bin tokens (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)
//   uint64   S = number of sequences
//   uint64   D = number of document indices = documents + 1 (a leading 0, as Megatron writes it)
//   int32    sequence_lengths[S]     tokens per sequence
//   int64    sequence_pointers[S]    byte offset of each sequence in PREFIX.bin
//   int64    document_indices[D]     0, then the sequence index that ends each document
inline constexpr char kMmidxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kMmidxVersion = 1;
inline constexpr uint8_t kMmidxUint16 = 8;  // Megatron's DType.uint16
inline constexpr uint8_t kMmidxInt32 = 4;   // Megatron's DType.int32
inline constexpr size_t kMmidxHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Bytes per token of a dtype code; 0 when the code is not an integer type we read.
int mmidx_dtype_size(int code);
// The dtype Megatron's preprocessing picks for a vocabulary (DType.optimal_dtype): uint16 below
// 65500 ids, int32 otherwise.
uint8_t mmidx_dtype_for_vocab(int vocab_size);

// Streams documents into PREFIX.bin and writes PREFIX.idx on finish(). Both are written new under
// temporary names and renamed at the end (lib/core/new_file.h), so an interrupted run never leaves
// a dataset that looks complete.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(std::string prefix, int vocab_size);
  ~IndexedDatasetWriter();  // without finish(): nothing is left
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // One document = one sequence. Every id must lie in [0, vocab_size).
  void add_document(std::span<const int32_t> tokens);
  // Writes PREFIX.idx and moves both files into place.
  void finish();

  int64_t num_documents() const { return int64_t(lengths_.size()); }
  int64_t num_tokens() const { return tokens_; }
  uint8_t dtype_code() const { return dtype_; }

 private:
  std::string prefix_;
  int vocab_size_;
  uint8_t dtype_;
  std::unique_ptr<NewFile> bin_;
  std::vector<int32_t> lengths_;
  std::vector<uint8_t> buffer_;
  int64_t tokens_ = 0;
  bool finished_ = false;
};

// Read-only view of PREFIX.bin/.idx, validated on open: every sequence lies inside the .bin.
// prepare-data writes one sequence per document; Megatron's GPT dataset, and ours (TokenSource),
// treats each sequence as a document, so multi-sequence documents read as consecutive documents.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  const std::string& idx_path() const { return idx_->path(); }
  const std::string& bin_path() const { return bin_->path(); }
  int dtype_code() const { return dtype_; }

  int64_t num_sequences() const { return num_sequences_; }
  // Documents as Megatron counts them: document_indices has one more entry.
  int64_t num_documents() const { return num_doc_indices_ - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sequence_length(int64_t i) const;
  int64_t sequence_pointer(int64_t i) const;
  int64_t document_index(int64_t k) const;  // k in [0, num_documents()]

  // tokens [offset, offset + count) of sequence `seq`, widened to int32.
  void read(int64_t seq, int64_t offset, int64_t count, int32_t* out) const;

 private:
  std::string prefix_;
  std::unique_ptr<MappedFile> idx_, bin_;
  int dtype_ = 0, dtype_size_ = 0;
  int64_t num_sequences_ = 0, num_doc_indices_ = 0, num_tokens_ = 0;
  size_t lengths_at_ = 0, pointers_at_ = 0, docs_at_ = 0;  // byte offsets of the arrays in .idx
};

}  // namespace mpigpt
