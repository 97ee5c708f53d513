// Tests of the counter-based RNG: known-answer vector, purity, and the moments of normal_at.
#include "lib/core/rng.h"

#include <doctest/doctest.h>

#include <cmath>

using namespace mpigpt;

TEST_CASE("philox4x32-10 known-answer vectors (Random123 kat_vectors)") {
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  CHECK(r == std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  r = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  CHECK(r == std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
}

TEST_CASE("values depend only on (seed, stream, index)") {
  CHECK(normal_at(1, 2, 3) == normal_at(1, 2, 3));
  CHECK(normal_at(1, 2, 3) != normal_at(1, 2, 4));
  CHECK(normal_at(1, 2, 3) != normal_at(1, 3, 3));
  CHECK(normal_at(1, 2, 3) != normal_at(2, 2, 3));
  CHECK(stream_of("a") != stream_of("b"));
}

TEST_CASE("normal_at has mean 0 and variance 1; uniform_at lies in (0,1)") {
  const int n = 200000;
  double s = 0, s2 = 0;
  for (int i = 0; i < n; ++i) {
    double x = normal_at(42, 7, i);
    s += x;
    s2 += x * x;
    double u = uniform_at(42, 7, i);
    REQUIRE(u > 0.0);
    REQUIRE(u < 1.0);
  }
  CHECK(std::abs(s / n) < 0.01);
  CHECK(std::abs(s2 / n - 1.0) < 0.01);
}
