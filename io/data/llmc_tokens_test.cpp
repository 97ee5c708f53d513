// llm.c token files: round trip and one clear error per kind of damage.
#include "io/data/llmc_tokens.h"

#include <doctest/doctest.h>

#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("llm.c tokens: round trip, header layout") {
  TempDir tmp;
  std::vector<int32_t> toks = {50256, 0, 1, 65535, 42, 50256};
  write_llmc_tokens(tmp / "a.bin", toks);
  std::string bytes = read_file(tmp / "a.bin");
  REQUIRE(bytes.size() == 1024 + 2 * toks.size());
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 6);
  CHECK(is_llmc_token_file(tmp / "a.bin"));

  LlmcTokenFile f(tmp / "a.bin");
  CHECK(f.version() == 1);
  REQUIRE(f.num_tokens() == 6);
  std::vector<int32_t> back(6);
  f.read(0, 6, back.data());
  CHECK(back == toks);
  f.read(2, 2, back.data());
  CHECK(back[0] == 1);
  CHECK(back[1] == 65535);

  std::vector<int32_t> wide = {100000, 3};  // version 2 (Llama 3): uint32 ids
  write_llmc_tokens(tmp / "b.bin", wide, 2);
  LlmcTokenFile g(tmp / "b.bin");
  CHECK(g.version() == 2);
  g.read(0, 2, back.data());
  CHECK(back[0] == 100000);
  CHECK_THROWS_WITH_AS(write_llmc_tokens(tmp / "c.bin", wide, 1), doctest::Contains("token id 100000"), Error);
}

TEST_CASE("llm.c tokens: errors name the file") {
  TempDir tmp;
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "missing.bin"), doctest::Contains("missing.bin"), Error);

  std::vector<int32_t> toks = {1, 2, 3, 4};
  write_llmc_tokens(tmp / "t.bin", toks);
  std::string good = read_file(tmp / "t.bin");

  std::string bad = good;
  bad[0] = 'x';
  write_file(tmp / "t.bin", bad);
  CHECK_FALSE(is_llmc_token_file(tmp / "t.bin"));
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "t.bin"), doctest::Contains("t.bin is not an llm.c token file"), Error);

  bad = good;
  bad[4] = 7;
  write_file(tmp / "t.bin", bad);
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "t.bin"), doctest::Contains("unsupported version 7"), Error);

  write_file(tmp / "t.bin", good.substr(0, good.size() - 1));
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "t.bin"), doctest::Contains("is truncated"), Error);
  write_file(tmp / "t.bin", good.substr(0, 100));
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "t.bin"), doctest::Contains("shorter than the 1024-byte header"), Error);
  write_file(tmp / "t.bin", good + "xx");
  CHECK_THROWS_WITH_AS(LlmcTokenFile(tmp / "t.bin"), doctest::Contains("longer than its header says"), Error);
}
