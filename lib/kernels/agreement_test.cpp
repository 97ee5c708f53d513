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
Agreement agree(const std::vector<float>& want, const std::vector<float>& got, AgreementBounds b) {
  return agreement(want.data(), got.data(), want.size(), DType::F32, b);
}
const AgreementBounds kLoose{2e-2, 1.0, 0};  // the norm bound out of the way
}  // namespace

TEST_CASE("agreement: the element bound scales with the reference, so gradients of any magnitude are judged alike") {
  for (double scale : {1.0, 1e-6, 1e4}) {
    CAPTURE(scale);
    // rms(want) = 1 * scale; the bound of element i is tol * (|want_i| + rms).
    std::vector<float> want = {float(1 * scale), float(-1 * scale), float(1 * scale), float(-1 * scale)};
    std::vector<float> got = want;
    got[2] = float(scale * (1 + 0.019 * 2));  // 0.95x the bound at tol 2e-2
    auto a = agree(want, got, kLoose);
    CHECK(a.ok);
    CHECK(a.worst == 2);
    CHECK(a.ratio == doctest::Approx(0.95).epsilon(1e-4));
    got[2] = float(scale * (1 + 0.021 * 2));  // 1.05x
    a = agree(want, got, kLoose);
    CHECK_FALSE(a.ok);
    CHECK(a.disagreeing == 1);
    CHECK(a.str().find("1 of 4 elements disagree") == 0);
  }
}

TEST_CASE("agreement: an element near zero is held to the rms, not to its own size") {
  std::vector<float> want = {0.0f, 3.0f, -4.0f, 0.0f};  // rms 2.5
  std::vector<float> got = {0.049f, 3.0f, -4.0f, -0.049f};  // 0.98x of 2e-2 * 2.5
  CHECK(agree(want, got, kLoose).ok);
  got[3] = -0.06f;
  const auto a = agree(want, got, kLoose);
  CHECK_FALSE(a.ok);
  CHECK(a.worst == 3);
}

TEST_CASE("agreement: grouped, an element is held to its group's rms where that is the larger") {
  // Two groups of two: rms 10 and 0 (overall rms sqrt(50) = 7.07).
  const std::vector<float> want = {10.0f, -10.0f, 0.0f, 0.0f};
  std::vector<float> got = want;
  got[0] = 10.39f;  // 0.39 of 2e-2 * (10 + 10) = 0.4: within; against the overall rms 0.34 it is not
  CHECK(agree(want, got, {2e-2, 1.0, 2}).ok);
  CHECK_FALSE(agree(want, got, {2e-2, 1.0, 0}).ok);
  got = want;
  got[3] = 0.14f;  // the zero group: held to the overall rms, 2e-2 * 7.07 = 0.141
  CHECK(agree(want, got, {2e-2, 1.0, 2}).ok);
  got[3] = 0.15f;
  const auto a = agree(want, got, {2e-2, 1.0, 2});
  CHECK_FALSE(a.ok);
  CHECK(a.worst == 3);
  // A last group shorter than the others is its own group.
  const std::vector<float> want5 = {1.0f, 1.0f, 1.0f, 1.0f, 30.0f};
  std::vector<float> got5 = want5;
  got5[4] = 31.0f;  // 1 against 2e-2 * (30 + 30) = 1.2
  CHECK(agree(want5, got5, {2e-2, 1.0, 2}).ok);
}

TEST_CASE("agreement: an error spread over every element fails the norm bound") {
  std::vector<float> want(1000), got(1000);
  for (size_t i = 0; i < want.size(); ++i) {
    want[i] = std::sin(float(i));
    got[i] = want[i] * 1.02f;  // 2% too large everywhere: each element within 5e-2 * (|w| + rms)
  }
  auto a = agree(want, got, {5e-2, 1e-2, 0});
  CHECK(a.disagreeing == 0);
  CHECK(a.norm_ratio == doctest::Approx(0.02).epsilon(1e-3));
  CHECK_FALSE(a.ok);
  CHECK(a.str().find("differs by 2% of the norm, over the bound 1%") == 0);
  for (size_t i = 0; i < want.size(); ++i) got[i] = want[i] * 1.005f;
  a = agree(want, got, {5e-2, 1e-2, 0});
  CHECK(a.ok);
  CHECK(a.str().find("agrees (difference 0.5% of the norm; ") == 0);
}

TEST_CASE("agreement: non-finite values agree only with themselves") {
  const float inf = INFINITY, nan = NAN;
  const AgreementBounds b{1e-3, 1e-3, 0};
  std::vector<float> want = {1.0f, -inf, nan, 2.0f};
  std::vector<float> got = want;
  auto a = agree(want, got, b);
  CHECK(a.ok);
  CHECK(a.rms == doctest::Approx(std::sqrt(2.5)));  // over the finite elements
  CHECK(a.norm_ratio == 0.0);
  got[3] = nan;  // a candidate that produced a NaN
  CHECK_FALSE(agree(want, got, b).ok);
  got = want;
  got[1] = inf;  // the wrong sign of infinity
  CHECK_FALSE(agree(want, got, b).ok);
  got = want;
  got[2] = 0.0f;  // a NaN the candidate did not reproduce
  CHECK_FALSE(agree(want, got, b).ok);
}

TEST_CASE("agreement: bf16 data is read as stored") {
  const AgreementBounds b{1e-2, 1.0, 0};
  std::vector<uint16_t> want = {bf16_bits(1.0f), bf16_bits(-2.0f), bf16_bits(0.5f)};
  std::vector<uint16_t> got = {bf16_bits(1.0f), bf16_bits(-2.0f), bf16_bits(0.5f)};
  CHECK(agreement(want.data(), got.data(), 3, DType::BF16, b).ok);
  got[1] = bf16_bits(-2.5f);
  const auto a = agreement(want.data(), got.data(), 3, DType::BF16, b);
  CHECK_FALSE(a.ok);
  CHECK(a.worst == 1);
  CHECK(a.got == -2.5);
  CHECK(a.want == -2.0);
  CHECK_THROWS_AS(agreement(want.data(), got.data(), 3, DType::I32, b), Error);
}
