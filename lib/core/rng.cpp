// Philox4x32-10 and the helpers built on it.
#include "lib/core/rng.h"

#include <cmath>

namespace mpigpt {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(M0) * c[0], p1 = uint64_t(M1) * c[2];
    c = {uint32_t(p1 >> 32) ^ c[1] ^ k[0], uint32_t(p1), uint32_t(p0 >> 32) ^ c[3] ^ k[1], uint32_t(p0)};
    k[0] += W0;
    k[1] += W1;
  }
  return c;
}

uint64_t stream_of(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  return h;
}

static std::array<uint32_t, 4> draw(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32({uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)},
                    {uint32_t(seed), uint32_t(seed >> 32)});
}

// 53 random bits mapped into the open interval (0, 1).
static double to_open_unit(uint32_t hi, uint32_t lo) {
  uint64_t x = (uint64_t(hi) << 21) ^ (lo >> 11);
  return (double(x & ((1ull << 53) - 1)) + 0.5) / 9007199254740992.0;
}

double uniform_at(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = draw(seed, stream, index);
  return to_open_unit(r[0], r[1]);
}

float normal_at(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = draw(seed, stream, index);
  double u1 = to_open_unit(r[0], r[1]), u2 = to_open_unit(r[2], r[3]);
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

uint64_t bits_at(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = draw(seed, stream, index);
  return (uint64_t(r[0]) << 32) | r[1];
}

}  // namespace mpigpt
