// GPU test (CTest label gpu; skipped without a GPU): the tensor-core primitives of cuda_mma.cuh
// (ldmatrix with and without .trans, mma.sync m16n8k16, an accumulator reused as the next
// product's operand) against exact products; and Hopper's warpgroup products (cuda_wgmma.cuh) the
// same way, on GPUs that run sm_90a code. The inputs are small integers, so every product and
// sum is exact in bf16 and fp32 and the results must match exactly: any fragment-layout mistake
// moves elements and fails here, before it could pass for rounding in the attention tests.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/cuda_mma_check.h"
#include "lib/kernels/cuda/cuda_wgmma_check.h"
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

TEST_CASE("cuda wgmma primitives: canonical tiles, descriptors and warpgroup fragments give exact products") {
  auto ops = cuda_ops_or_skip();
#ifdef MPIGPT_WITH_CUDA
  if (!cuda::attention_wgmma_available()) {
    MESSAGE("this GPU does not run sm_90a code (wgmma): nothing to check");
    return;
  }
  // d = A X^T (64 x 32 by 32 x 64), e = d Y (64 x 64 by 64 x 64). Values in [-2, 2]: |d| <= 128 is
  // exact in bf16 (e's operand), |e| <= 16384 in fp32.
  const auto A = small_integers(4, 64 * 32, 2), X = small_integers(5, 64 * 32, 2), Y = small_integers(6, 64 * 64, 2);
  std::vector<float> D(64 * 64, 0.f), E(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j)
      for (int k = 0; k < 32; ++k) D[size_t(i * 64 + j)] += A[size_t(i * 32 + k)] * X[size_t(j * 32 + k)];
  for (int i = 0; i < 64; ++i)
    for (int j = 0; j < 64; ++j)
      for (int k = 0; k < 64; ++k) E[size_t(i * 64 + j)] += D[size_t(i * 64 + k)] * Y[size_t(k * 64 + j)];
  auto dA = to_device(*ops, A, {64, 32}, DType::BF16), dX = to_device(*ops, X, {64, 32}, DType::BF16),
       dY = to_device(*ops, Y, {64, 64}, DType::BF16);
  auto d = zeros(*ops, {64, 64}), e = zeros(*ops, {64, 64}), f = zeros(*ops, {64, 64});
  ops->synchronize();
  cuda::wgmma_primitives_check(dA.t.ptr, dX.t.ptr, dY.t.ptr, static_cast<float*>(d.t.ptr),
                               static_cast<float*>(e.t.ptr), static_cast<float*>(f.t.ptr));
  const auto hd = to_host(*ops, d.t), he = to_host(*ops, e.t), hf = to_host(*ops, f.t);
  int bad_d = 0, bad_e = 0, bad_f = 0;
  for (size_t i = 0; i < hd.size(); ++i) {
    bad_d += hd[i] != D[i];
    bad_e += he[i] != E[i];
    bad_f += hf[i] != D[i];
  }
  CHECK(bad_d == 0);  // SS, both operands K-major
  CHECK(bad_e == 0);  // RS from an accumulator, B MN-major
  CHECK(bad_f == 0);  // RS from load_a_regs, B K-major
#endif
}
