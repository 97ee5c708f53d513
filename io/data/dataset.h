// Training data: a corpus of token documents (TokenSource, from either on-disk format) and the
// fixed-length samples cut from it (GptDataset).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace mpigpt {

class IndexedDataset;
class LlmcTokenFile;
class LossMask;

// A corpus of documents of int32 token ids. Reads are const and thread-safe (memory maps).
class TokenSource {
 public:
  // `path` is a dataset prefix (PREFIX.bin + PREFIX.idx, also accepted with either suffix) or an
  // llm.c token file (recognised by its magic number); anything else fails with a message that
  // says how to make one.
  static std::shared_ptr<TokenSource> open(const std::string& path);
  ~TokenSource();

  // Documents are MMIDIDX sequences (one per document as prepare-data writes them); an llm.c
  // file is a single document holding its whole stream.
  int64_t num_documents() const;
  int64_t document_length(int64_t d) const;
  int64_t num_tokens() const;
  // tokens [offset, offset + count) of document `doc`.
  void read(int64_t doc, int64_t offset, int64_t count, int32_t* out) const;
  const std::string& path() const { return path_; }
  std::string format() const;  // "indexed dataset" or "llm.c token file", for messages
  // The loss mask beside an indexed dataset (PREFIX.mask, io/data/loss_mask.h), or null.
  const LossMask* loss_mask() const { return mask_.get(); }
  // Mask bytes of tokens [offset, offset + count) of document `doc` (with a loss mask).
  void read_mask(int64_t doc, int64_t offset, int64_t count, uint8_t* out) const;

 private:
  TokenSource() = default;
  std::string path_;
  std::unique_ptr<IndexedDataset> indexed_;
  std::unique_ptr<LlmcTokenFile> llmc_;
  std::unique_ptr<LossMask> mask_;
};

enum class Split { Train, Valid };

// Fixed-length training samples from one split of a TokenSource. Sample i is a pure function of
// (seed, i), so the data order depends only on the global sample index, never on the rank layout
// (DESIGN principle 3), and a resumed run continues with exactly the samples it would have seen.
//
// Split: the documents are put in one order drawn from `seed`; the last `valid_fraction` of them
// (at least one when valid_fraction > 0, at most all but one) are the validation split, the rest
// train. A source with a single document (an llm.c file) splits its token stream instead: the
// last valid_fraction of the tokens. For a separate validation corpus (data.valid_path) use
// Split::Train with valid_fraction 0: the whole source.
//
// Samples: the split's documents, concatenated in that order (each ends with the EOD token that
// prepare-data appended), form one stream cut into windows of T+1 tokens with stride T, so
// samples_per_epoch = (tokens - 1) / T and no token is a target twice. Epoch e visits the windows
// in a permutation drawn from (seed, e); global sample i is window perm_{i / S}[i % S].
//
// Without `shuffle` (data.shuffle = false) nothing is drawn: the documents stay in the source's
// order (validation = the last ones) and every epoch reads the windows in stream order, sample i =
// window i % S, as llm.c's loader reads its token files.
class GptDataset {
 public:
  GptDataset(std::shared_ptr<const TokenSource> src, Split split, double valid_fraction, int seq_len,
             uint64_t seed, int vocab_size, bool shuffle = true);

  int64_t samples_per_epoch() const { return windows_; }
  int64_t num_tokens() const { return tokens_; }          // in this split
  int64_t num_documents() const { return int64_t(docs_.size()); }  // in this split
  int seq_len() const { return seq_len_; }
  Split split() const { return split_; }
  const TokenSource& source() const { return *src_; }

  // tokens (T) and targets (T) = the window's tokens shifted by one, for global sample
  // `index` >= 0. Fails, naming the file, if an id is not below the model's vocabulary size.
  // With `positions` (T) given, the sample is a packed row: positions restart at 0 at the row's
  // start and at every document that begins inside it, and the target of a document's last token
  // (its EOD, whose next token opens another document) is -1, so no loss crosses documents.
  // With a loss mask, a target the mask marks 0 (a prompt token) is -1 too.
  void get(int64_t index, int32_t* tokens, int32_t* targets, int32_t* positions = nullptr) const;
  // Which window (0 .. samples_per_epoch - 1) global sample `index` reads.
  int64_t window_of(int64_t index) const;
  // The source documents of this split, in stream order.
  const std::vector<uint32_t>& documents() const { return docs_; }

 private:
  // Calls piece(doc, offset in doc, count, offset in the request) for the documents that stream
  // tokens [pos, pos + count) lie in, in order.
  template <class F>
  void for_pieces(int64_t pos, int64_t count, F&& piece) const;
  void read_stream(int64_t pos, int64_t count, int32_t* out) const;

  std::shared_ptr<const TokenSource> src_;
  Split split_;
  int seq_len_;
  uint64_t seed_;
  int vocab_size_;
  bool shuffle_;
  std::vector<uint32_t> docs_;   // source document ids in stream order
  std::vector<int64_t> starts_;  // stream offset of each document, then the total
  int64_t first_token_ = 0;      // single-document sources: where this split starts in it
  int64_t tokens_ = 0, windows_ = 0;

  // The window permutations of the two most recently used epochs: a pure cache (each is a
  // function of (seed, epoch) alone), two so that loaders straddling an epoch boundary do not
  // rebuild it on every call.
  struct EpochOrder {
    int64_t epoch = -1;
    uint64_t last_use = 0;
    std::vector<uint32_t> window;
  };
  mutable std::mutex mutex_;
  mutable EpochOrder orders_[2];
  mutable uint64_t uses_ = 0;
};

}  // namespace mpigpt
