// The scale-free agreement test that engine.attention_backend = auto applies to each candidate
// kernel's output against the reference kernel's.
#include "lib/kernels/agreement.h"

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
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

namespace {
// The definition (agreement.h) as one pass in order: what the chunked, threaded one must give.
Agreement in_order(const std::vector<float>& want, const std::vector<float>& got, AgreementBounds b) {
  const size_t n = want.size(), group = b.group > 0 ? b.group : n;
  auto rms = [&](size_t begin, size_t end) {
    double sum_sq = 0;
    for (size_t i = begin; i < end; ++i) sum_sq += double(want[i]) * want[i];
    return std::sqrt(sum_sq / double(end - begin));
  };
  Agreement a;
  a.rms = rms(0, n);
  double diff_sq = 0, want_sq = 0;
  for (size_t begin = 0; begin < n; begin += group) {
    const size_t end = std::min(n, begin + group);
    const double scale = std::max(rms(begin, end), a.rms);
    for (size_t i = begin; i < end; ++i) {
      const double err = std::abs(double(got[i]) - want[i]), ratio = err / (b.element * (std::abs(want[i]) + scale));
      diff_sq += err * err;
      want_sq += double(want[i]) * want[i];
      a.disagreeing += ratio > 1.0;
      if (i == 0 || ratio > a.ratio) {
        a.ratio = ratio;
        a.worst = i;
      }
    }
  }
  a.norm_ratio = std::sqrt(diff_sq / want_sq);
  return a;
}
}  // namespace

TEST_CASE("agreement: a large output is judged in chunks and threads as a pass in order judges it") {
  // Over a megabyte of elements (several of the fixed chunks, the last one partial), magnitudes
  // that change every 96 elements (so that each group's rms matters, and a chunk that cut a group
  // would change it), errors of about 1% of each value, and some elements over their bound, the
  // largest twice in different chunks (the first is the worst).
  const size_t n = 3 * (size_t(1) << 18) + 1000;
  std::vector<float> want(n), got(n);
  uint64_t state = 12345;
  auto uniform = [&state] {  // in [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return float(int64_t(state >> 40) - (int64_t(1) << 23)) / float(1 << 23);
  };
  for (size_t i = 0; i < n; ++i) {
    want[i] = std::ldexp(uniform(), int(i / 96 % 11) - 5);
    got[i] = want[i] * (1.0f + 0.01f * uniform());
  }
  for (size_t i : {size_t(5), size_t(262143), size_t(262144), size_t(500000), size_t(786431)})
    got[i] = want[i] + 0.05f * std::ldexp(1.0f, int(i / 96 % 11) - 5);
  // The tie: a block of 96000 elements (a multiple of every group size below) copied into another
  // chunk, each with the same outlier, so that both see the same values around them.
  const size_t block = 96000, from = 3 * block, to = 7 * block, first = from + 12001, second = to + 12001;
  got[first] = want[first] + 64.0f;
  std::copy(want.begin() + from, want.begin() + from + block, want.begin() + to);
  std::copy(got.begin() + from, got.begin() + from + block, got.begin() + to);
  const int threads = omp_get_max_threads();
  for (size_t group : {size_t(0), size_t(64), size_t(96), size_t(1000)}) {  // 96 and 1000 do not divide a chunk
    CAPTURE(group);
    const AgreementBounds b{2e-2, 1.0, group};
    const Agreement want_a = in_order(want, got, b);
    omp_set_num_threads(1);
    const Agreement one = agree(want, got, b);
    omp_set_num_threads(4);
    const Agreement four = agree(want, got, b);
    omp_set_num_threads(threads);
    CHECK(want_a.worst == first);
    CHECK(want_a.disagreeing >= 2);
    {  // a tie: without the first outlier, the second is the worst, by the same ratio
      std::vector<float> untied = got;
      untied[first] = want[first];
      const Agreement u = in_order(want, untied, b);
      CHECK(u.worst == second);
      CHECK(u.ratio == doctest::Approx(want_a.ratio).epsilon(1e-12));
    }
    for (const Agreement& a : {one, four}) {
      CHECK(a.n == n);
      CHECK(a.disagreeing == want_a.disagreeing);
      CHECK(a.worst == first);
      CHECK(a.ratio == doctest::Approx(want_a.ratio).epsilon(1e-12));
      CHECK(a.want == double(want[first]));
      CHECK(a.got == double(got[first]));
      CHECK(a.rms == doctest::Approx(want_a.rms).epsilon(1e-12));
      CHECK(a.norm_ratio == doctest::Approx(want_a.norm_ratio).epsilon(1e-12));
    }
    // The same sums in the same order, whatever the threads: bitwise equal.
    CHECK(one.rms == four.rms);
    CHECK(one.norm_ratio == four.norm_ratio);
    CHECK(one.str() == four.str());
  }
}
