// The scale-free agreement test that engine.attention_backend = auto applies to each candidate
// kernel's output against the reference kernel's.
#include "lib/kernels/agreement.h"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

using namespace mpigpt;

namespace {
uint16_t bf16_bits(float x) { return uint16_t(std::bit_cast<uint32_t>(x) >> 16); }  // exact for the values used
}  // namespace

TEST_CASE("agreement: the bound scales with the reference, so gradients of any magnitude are judged alike") {
  for (double scale : {1.0, 1e-6, 1e4}) {
    CAPTURE(scale);
    // rms(want) = 1 * scale; the bound of element i is tol * (|want_i| + rms).
    std::vector<float> want = {float(1 * scale), float(-1 * scale), float(1 * scale), float(-1 * scale)};
    std::vector<float> got = want;
    got[2] = float(scale * (1 + 0.019 * 2));  // 0.95x the bound at tol 2e-2
    auto a = agreement(want.data(), got.data(), want.size(), DType::F32, 2e-2);
    CHECK(a.ok);
    CHECK(a.worst == 2);
    CHECK(a.ratio == doctest::Approx(0.95).epsilon(1e-4));
    got[2] = float(scale * (1 + 0.021 * 2));  // 1.05x
    a = agreement(want.data(), got.data(), want.size(), DType::F32, 2e-2);
    CHECK_FALSE(a.ok);
    CHECK(a.disagreeing == 1);
    CHECK(a.str().find("1 of 4 elements disagree") == 0);
  }
}

TEST_CASE("agreement: an element near zero is held to the rms, not to its own size") {
  std::vector<float> want = {0.0f, 3.0f, -4.0f, 0.0f};  // rms 2.5
  std::vector<float> got = {0.049f, 3.0f, -4.0f, -0.049f};  // 0.98x of 2e-2 * 2.5
  CHECK(agreement(want.data(), got.data(), 4, DType::F32, 2e-2).ok);
  got[3] = -0.06f;
  const auto a = agreement(want.data(), got.data(), 4, DType::F32, 2e-2);
  CHECK_FALSE(a.ok);
  CHECK(a.worst == 3);
}

TEST_CASE("agreement: non-finite values agree only with themselves") {
  const float inf = INFINITY, nan = NAN;
  std::vector<float> want = {1.0f, -inf, nan, 2.0f};
  std::vector<float> got = want;
  auto a = agreement(want.data(), got.data(), 4, DType::F32, 1e-3);
  CHECK(a.ok);
  CHECK(a.rms == doctest::Approx(std::sqrt(2.5)));  // over the finite elements
  got[3] = nan;  // a candidate that produced a NaN
  CHECK_FALSE(agreement(want.data(), got.data(), 4, DType::F32, 1e-3).ok);
  got = want;
  got[1] = inf;  // the wrong sign of infinity
  CHECK_FALSE(agreement(want.data(), got.data(), 4, DType::F32, 1e-3).ok);
  got = want;
  got[2] = 0.0f;  // a NaN the candidate did not reproduce
  CHECK_FALSE(agreement(want.data(), got.data(), 4, DType::F32, 1e-3).ok);
}

TEST_CASE("agreement: bf16 data is read as stored") {
  std::vector<uint16_t> want = {bf16_bits(1.0f), bf16_bits(-2.0f), bf16_bits(0.5f)};
  std::vector<uint16_t> got = {bf16_bits(1.0f), bf16_bits(-2.0f), bf16_bits(0.5f)};
  CHECK(agreement(want.data(), got.data(), 3, DType::BF16, 1e-2).ok);
  got[1] = bf16_bits(-2.5f);
  const auto a = agreement(want.data(), got.data(), 3, DType::BF16, 1e-2);
  CHECK_FALSE(a.ok);
  CHECK(a.worst == 1);
  CHECK(a.got == -2.5);
  CHECK(a.want == -2.0);
  CHECK_THROWS_AS(agreement(want.data(), got.data(), 3, DType::I32, 1e-2), Error);
}
