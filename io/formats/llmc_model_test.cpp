// llm.c GPT-2 model files: header and tensor order checked byte by byte, bit-exact round trip,
// re-padding the vocabulary, bf16 (version 5) reading, and one clear error per kind of damage.
#include "io/formats/llmc_model.h"

#include <doctest/doctest.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <random>

#include "io/formats/hf_format.h"
#include "io/io_testing.h"
#include "lib/core/error.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

constexpr int V = 50, Vp = 64, C = 8, L = 2, NH = 2, maxT = 6;

ModelConfig tiny() {
  ModelConfig m;
  m.family = "gpt2";
  m.num_layers = L;
  m.hidden = C;
  m.num_heads = NH;
  m.seq_len = maxT;
  return m;
}

// Random parameters; values on a 1/64 grid below 4 so that they are exact in bf16 too.
TensorMap random_ours(uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> u(-255, 255);
  TensorMap out;
  for (const auto& [name, s] : param_shapes(tiny(), Vp)) {
    HostTensor t{s, std::vector<float>(size_t(s.numel()))};
    for (float& x : t.data) x = float(u(gen)) / 64.0f;
    if (name == "embedding.word.weight") std::fill(t.data.begin() + V * C, t.data.end(), 0.f);
    out[name] = std::move(t);
  }
  return out;
}

void check_bit_identical(const TensorMap& a, const TensorMap& b) {
  REQUIRE(a.size() == b.size());
  for (const auto& [name, t] : a) {
    CAPTURE(name);
    REQUIRE(b.count(name));
    CHECK(b.at(name).shape == t.shape);
    REQUIRE(b.at(name).data.size() == t.data.size());
    CHECK(std::memcmp(b.at(name).data.data(), t.data.data(), t.data.size() * 4) == 0);
  }
}

int64_t num_params() {
  int64_t n = 0;
  for (const auto& [name, s] : param_shapes(tiny(), Vp)) n += s.numel();
  return n;
}

}  // namespace

TEST_CASE("llm.c model: header, stacked tensor order and bit-exact round trip") {
  TempDir tmp;
  const TensorMap ours = random_ours(1);
  write_llmc_model(tmp / "m.bin", ours, tiny(), V, Vp);
  const std::string bytes = read_file(tmp / "m.bin");
  REQUIRE(bytes.size() == 1024 + 4 * size_t(num_params()));
  int32_t h[9];
  std::memcpy(h, bytes.data(), sizeof h);
  CHECK(h[0] == 20240326);
  CHECK(h[1] == 3);
  CHECK(h[2] == maxT);
  CHECK(h[3] == V);
  CHECK(h[4] == L);
  CHECK(h[5] == NH);
  CHECK(h[6] == C);
  CHECK(h[7] == Vp);
  CHECK(h[8] == 0);
  // Layer 1's qkv weight follows wte, wpe, ln1w (L,C), ln1b (L,C) and layer 0's qkv weight.
  auto floats_at = [&](int64_t offset) { return reinterpret_cast<const float*>(bytes.data() + 1024) + offset; };
  const int64_t qkv1 = int64_t(Vp) * C + maxT * C + 2 * L * C + 3 * C * C;
  CHECK(std::memcmp(floats_at(qkv1), ours.at("layers.1.attn.qkv.weight").data.data(), 3 * C * C * 4) == 0);
  // ln2b of layer 1 after the attention tensors: ... attprojw (L,C,C), attprojb (L,C), ln2w (L,C), ln2b[0].
  const int64_t ln2b1 = int64_t(Vp) * C + maxT * C + 2 * L * C + L * 3 * C * C + L * 3 * C + L * C * C + L * C + L * C + C;
  CHECK(std::memcmp(floats_at(ln2b1), ours.at("layers.1.mlp_norm.bias").data.data(), C * 4) == 0);
  // The final norm closes the file.
  CHECK(std::memcmp(floats_at(num_params() - C), ours.at("final_norm.bias").data.data(), C * 4) == 0);

  ModelConfig m;
  int vocab = 0, padded = 0;
  const TensorMap back = read_llmc_model(tmp / "m.bin", &m, &vocab, &padded);
  CHECK(vocab == V);
  CHECK(padded == Vp);
  CHECK(m.family == "gpt2");
  CHECK(m.num_layers == L);
  CHECK(m.hidden == C);
  CHECK(m.num_heads == NH);
  CHECK(m.num_kv_heads == NH);
  CHECK(m.ffn_hidden == 4 * C);
  CHECK(m.max_position == maxT);
  CHECK(m.seq_len == maxT);
  CHECK(m.tie_embeddings);
  check_bit_identical(ours, back);
  // Same parameters as the HF route: llm.c file -> ours -> HF -> ours.
  check_bit_identical(ours, from_hf(to_hf(back, m, vocab), m, vocab, padded));
}

TEST_CASE("llm.c model: another padded vocabulary, and bf16 files (version 5)") {
  TempDir tmp;
  const TensorMap ours = random_ours(2);
  write_llmc_model(tmp / "p.bin", ours, tiny(), V, 56);  // llm.c pads to 128; any Vp >= V is valid
  int vocab = 0, padded = 0;
  TensorMap back = read_llmc_model(tmp / "p.bin", nullptr, &vocab, &padded);
  CHECK(padded == 56);
  CHECK(back.at("embedding.word.weight").shape == Shape{56, C});
  repad_vocab(back, vocab, Vp);
  check_bit_identical(ours, back);

  // A version 5 file: the same values as bf16 (exact: they lie on a 1/64 grid).
  write_llmc_model(tmp / "f.bin", ours, tiny(), V, Vp);
  const std::string f32 = read_file(tmp / "f.bin");
  std::string bf16 = f32.substr(0, 1024);
  bf16[4] = 5;
  for (size_t i = 1024; i < f32.size(); i += 4) {
    uint32_t bits;
    std::memcpy(&bits, f32.data() + i, 4);
    const uint16_t hi = uint16_t(bits >> 16);
    REQUIRE((bits & 0xffff) == 0);
    bf16.append(reinterpret_cast<const char*>(&hi), 2);
  }
  write_file(tmp / "b.bin", bf16);
  check_bit_identical(ours, read_llmc_model(tmp / "b.bin", nullptr, nullptr, nullptr));
}

TEST_CASE("llm.c model: errors name the file, the field or the tensor") {
  TempDir tmp;
  const TensorMap ours = random_ours(3);
  write_llmc_model(tmp / "m.bin", ours, tiny(), V, Vp);
  const std::string good = read_file(tmp / "m.bin");
  const std::string p = tmp / "x.bin";
  auto fails = [&](const std::string& bytes, const char* what) {
    CAPTURE(what);
    write_file(p, bytes);
    CHECK_THROWS_WITH_AS(read_llmc_model(p, nullptr, nullptr, nullptr), doctest::Contains(what), Error);
    CHECK_THROWS_WITH_AS(read_llmc_model(p, nullptr, nullptr, nullptr), doctest::Contains("x.bin"), Error);
  };
  std::string bad = good;
  const int32_t token_magic = 20240520;
  std::memcpy(bad.data(), &token_magic, 4);
  fails(bad, "is not an llm.c model file: magic number 20240520 instead of 20240326 (it is an llm.c token file)");
  bad = good;
  bad[4] = 1;
  fails(bad, "unsupported version 1");
  bad = good;
  bad[4 * 7] = 10;  // padded vocab 10 < vocab 50
  fails(bad, "padded_vocab_size 10 is smaller than vocab_size 50");
  bad = good;
  std::memset(bad.data() + 4 * 4, 0, 4);
  fails(bad, "header num_layers = 0 must be positive");
  // A corrupt header promising a billion layers of 2^30 channels is refused at once: nothing of that
  // size is built first, and 4 * channels does not overflow.
  bad = good;
  const int32_t huge[] = {1000000000, 1, 1 << 30};  // num_layers, num_heads, channels
  std::memcpy(bad.data() + 4 * 4, huge, sizeof huge);
  fails(bad, "L 1000000000, C 1073741824");
  fails(bad, "the file is truncated");
  fails(good.substr(0, 1000), "shorter than the 1024-byte header");
  fails(good.substr(0, good.size() - 4), "the file is truncated");
  fails(good + "abcd", "longer than that");
  CHECK_THROWS_WITH_AS(read_llmc_model(tmp / "missing.bin", nullptr, nullptr, nullptr), doctest::Contains("missing.bin"), Error);

  ModelConfig m = tiny();
  m.family = "llama";
  CHECK_THROWS_WITH_AS(write_llmc_model(p, ours, m, V, Vp), doctest::Contains("model.family = 'llama'"), Error);
  m = tiny();
  m.tie_embeddings = false;
  CHECK_THROWS_WITH_AS(write_llmc_model(p, ours, m, V, Vp), doctest::Contains("model.tie_embeddings = false"), Error);
  m = tiny();
  m.ffn_hidden = 3 * C;
  CHECK_THROWS_WITH_AS(write_llmc_model(p, ours, m, V, Vp), doctest::Contains("model.ffn_hidden = 24"), Error);
  CHECK_THROWS_WITH_AS(write_llmc_model(p, ours, tiny(), V, V - 1), doctest::Contains("padded vocabulary 49"), Error);
  TensorMap t = ours;
  t.erase("layers.1.mlp.fc.bias");
  CHECK_THROWS_WITH_AS(write_llmc_model(p, t, tiny(), V, Vp), doctest::Contains("tensor layers.1.mlp.fc.bias of shape (32,) is missing"), Error);
  t = ours;
  t["lm_head.weight"] = ours.at("embedding.word.weight");
  CHECK_THROWS_WITH_AS(write_llmc_model(p, t, tiny(), V, Vp), doctest::Contains("tensor lm_head.weight is not a parameter"), Error);
  t = ours;
  t["layers.0.attn.proj.weight"].shape = Shape{C * C};
  CHECK_THROWS_WITH_AS(write_llmc_model(p, t, tiny(), V, Vp), doctest::Contains("layers.0.attn.proj.weight has shape (64,)"), Error);
  CHECK_FALSE(std::filesystem::exists(p + ".tmp"));
}
