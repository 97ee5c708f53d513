// Tokenizers: text <-> token ids. Two are built in: raw bytes (no files needed, the default for
// the small demo corpus) and GPT-2's byte-level BPE, which reproduces OpenAI's encoder.py exactly
// so that datasets and checkpoints interoperate with GPT-2, Megatron-LM and llm.c.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mpigpt {

struct DataConfig;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Plain text to ids; never emits eod() (the caller appends it between documents).
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Ids back to bytes; decode(encode(s)) == s for every byte string s. Fails on an id outside
  // [0, vocab_size()).
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual int vocab_size() const = 0;  // including eod()
  virtual int32_t eod() const = 0;     // the end-of-document id
  virtual std::string name() const = 0;
};

// Ids 0..255 are the bytes, 256 is the end of document; vocabulary 257.
std::unique_ptr<Tokenizer> make_byte_tokenizer();

// GPT-2 byte-level BPE from its vocabulary (vocab.json / encoder.json: token -> id) and merges
// (merges.txt / vocab.bpe: "#version" line, then one "left right" pair per line, by rank).
// EOD is <|endoftext|> (50256 in GPT-2's files); the vocabulary size is that of the file (50257).
std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& vocab_json, const std::string& merges_txt);

// By cfg.tokenizer: "byte" or "gpt2" (which needs cfg.vocab_file and cfg.merges_file).
std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& cfg);

// GPT-2's pre-tokenizer: splits `text` into the pieces that BPE encodes separately, exactly as
// the pattern 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ does
// under Python's `regex` module (\s = Unicode White_Space). Bytes that are not valid UTF-8 count
// as punctuation, so any byte string is covered. The pieces are views into `text`.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

}  // namespace mpigpt
