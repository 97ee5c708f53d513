// GPU test: the tensor-core primitives of cuda_mma.cuh (ldmatrix with and without .trans, mma.sync,
// an accumulator reused as the next product's operand) against exact products of small integers, so
// that a fragment-layout mistake fails here rather than passing for rounding in the attention tests.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_mma_check.h"
#endif

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// n values in [-r, r] (16 x 16 in [-3, 3] unless told).
std::vector<float> small_integers(uint64_t seed, size_t n = 256, int r = 3) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = float(int(x % uint64_t(2 * r + 1)) - r);
  }
  return v;
}

std::vector<float> product(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> c(256, 0.f);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j)
      for (int k = 0; k < 16; ++k) c[size_t(i * 16 + j)] += a[size_t(i * 16 + k)] * b[size_t(k * 16 + j)];
  return c;
}

}  // namespace

TEST_CASE("cuda mma primitives: ldmatrix and mma.sync fragments give exact products") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  const auto A = small_integers(1), B = small_integers(2), C = small_integers(3);
  std::vector<float> Bt(256);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) Bt[size_t(n * 16 + k)] = B[size_t(k * 16 + n)];
  const auto D = product(A, B), E = product(D, C);  // |D| <= 144: exact in bf16
  auto dA = to_device(*ops, A, {16, 16}, DType::BF16), dB = to_device(*ops, B, {16, 16}, DType::BF16),
       dBt = to_device(*ops, Bt, {16, 16}, DType::BF16), dC = to_device(*ops, C, {16, 16}, DType::BF16);
  for (bool transposed : {false, true}) {
    CAPTURE(transposed);
    auto d = zeros(*ops, {16, 16}), e = zeros(*ops, {16, 16});
    ops->synchronize();
    cuda::mma_primitives_check(dA.t.ptr, transposed ? dBt.t.ptr : dB.t.ptr, dC.t.ptr,
                               static_cast<float*>(d.t.ptr), static_cast<float*>(e.t.ptr), transposed);
    const auto hd = to_host(*ops, d.t), he = to_host(*ops, e.t);
    int bad_d = 0, bad_e = 0;
    for (size_t i = 0; i < 256; ++i) {
      bad_d += hd[i] != D[i];
      bad_e += he[i] != E[i];
    }
    CHECK(bad_d == 0);
    CHECK(bad_e == 0);
  }
#endif
}
