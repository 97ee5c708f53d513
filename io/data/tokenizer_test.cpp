// Tests of the byte tokenizer, the tokenizer factory and GPT-2's pre-tokenizer (the expected
// pieces were produced by the reference pattern under Python's `regex` module).
#include "io/data/tokenizer.h"

#include <doctest/doctest.h>

#include "io/config/config.h"
#include "lib/core/error.h"

using namespace mpigpt;

TEST_CASE("byte tokenizer: ids are the bytes, EOD is 256, round trip") {
  auto tok = make_byte_tokenizer();
  CHECK(tok->vocab_size() == 257);
  CHECK(tok->eod() == 256);
  CHECK(tok->name() == "byte");
  std::string text = "Hi\n\xff\x00 caf\xc3\xa9";
  text += '\0';
  auto ids = tok->encode(text);
  REQUIRE(ids.size() == text.size());
  CHECK(ids[0] == 'H');
  CHECK(ids[3] == 255);
  CHECK(tok->decode(ids) == text);
  std::vector<int32_t> with_eod = {'a', 256};
  CHECK(tok->decode(with_eod) == "a<|endoftext|>");
  std::vector<int32_t> bad = {'a', 300};
  CHECK_THROWS_WITH_AS(tok->decode(bad), doctest::Contains("token id 300"), Error);
}

TEST_CASE("make_tokenizer: picks by name and names the field on errors") {
  DataConfig cfg;
  cfg.tokenizer = "byte";
  CHECK(make_tokenizer(cfg)->name() == "byte");
  cfg.tokenizer = "sentencepiece";
  CHECK_THROWS_WITH_AS(make_tokenizer(cfg), doctest::Contains("data.tokenizer = 'sentencepiece'"), Error);
  cfg.tokenizer = "gpt2";
  CHECK_THROWS_WITH_AS(make_tokenizer(cfg), doctest::Contains("data.vocab_file"), Error);
  cfg.vocab_file = "/nonexistent/vocab.json";
  cfg.merges_file = "/nonexistent/merges.txt";
  CHECK_THROWS_WITH_AS(make_tokenizer(cfg), doctest::Contains("/nonexistent/vocab.json"), Error);
}

static std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (auto p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

TEST_CASE("GPT-2 pre-tokenizer matches the reference pattern") {
  using V = std::vector<std::string>;
  CHECK(pieces("Hello world") == V{"Hello", " world"});
  CHECK(pieces("I'm can't we'll they're I've she'd it's") ==
        V{"I", "'m", " can", "'t", " we", "'ll", " they", "'re", " I", "'ve", " she", "'d", " it", "'s"});
  CHECK(pieces("'S 'LL") == V{"'", "S", " '", "LL"});  // contractions are case-sensitive
  CHECK(pieces("''s") == V{"''", "s"});
  CHECK(pieces("a  b   c") == V{"a", " ", " b", "  ", " c"});
  CHECK(pieces("x\n\ny") == V{"x", "\n", "\n", "y"});
  CHECK(pieces("tab\there") == V{"tab", "\t", "here"});
  CHECK(pieces("end  ") == V{"end", "  "});
  CHECK(pieces(" ") == V{" "});
  CHECK(pieces("  lead") == V{" ", " lead"});
  CHECK(pieces("x \ty") == V{"x", " ", "\t", "y"});
  CHECK(pieces("a\n b") == V{"a", "\n", " b"});
  CHECK(pieces("a\xc2\xa0" "b") == V{"a", "\xc2\xa0", "b"});  // NBSP is \s
  CHECK(pieces("caf\xc3\xa9 123abc4.5!!") == V{"caf\xc3\xa9", " 123", "abc", "4", ".", "5", "!!"});
  CHECK(pieces("1,000,000") == V{"1", ",", "000", ",", "000"});
  CHECK(pieces("\xe4\xb8\xad\xe6\x96\x87") == V{"\xe4\xb8\xad\xe6\x96\x87"});  // 中文: letters
  CHECK(pieces("emoji \xf0\x9f\x98\x80\xf0\x9f\x98\x80 ok") ==
        V{"emoji", " \xf0\x9f\x98\x80\xf0\x9f\x98\x80", " ok"});
  CHECK(pieces("\xe2\x80\xa8x") == V{"\xe2\x80\xa8", "x"});  // U+2028 is White_Space
  CHECK(pieces("x\x1ey") == V{"x", "\x1e", "y"});           // U+001E is not (unlike Python's re)
  // ٣٤ Ⅻ ½: decimal digits, letter numbers and other numbers are all \p{N}
  CHECK(pieces("\xd9\xa3\xd9\xa4 \xe2\x85\xab \xc2\xbd") ==
        V{"\xd9\xa3\xd9\xa4", " \xe2\x85\xab", " \xc2\xbd"});
  // Ill-formed UTF-8 is punctuation and survives byte for byte.
  CHECK(pieces("a\xff\xfe b") == V{"a", "\xff\xfe", " b"});
  CHECK(pieces("").empty());
}
