// Helpers for the GPU tests of the matrix products (cuda_matmul_test.cpp, cuda_fused_test.cpp):
// their tolerances against the CPU reference, the check, and random inputs in the data dtype.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"

namespace mpigpt::testing {

// Tolerances of a GPU result against the CPU's computed from the SAME inputs (bf16 inputs are
// rounded with round_bf16 before the CPU sees them, so both sides multiply identical numbers; a
// product of two bf16 values is exact in fp32). `scale` is the typical size of an output (sqrt(K)
// for sums of K products of unit normals).
//  - f32 outputs (f32 data, and the f32 weight/bias gradients of bf16 data): both sides accumulate
//    in fp32 (CUBLAS_COMPUTE_32F, no TF32) and differ only in summation order, whose error grows
//    like sqrt(K) * 2^-24 * scale; the worst of a few thousand elements stays below ~2e-7 sqrt(K)
//    scale, so atol = 5e-7 sqrt(K) scale and rtol = 1e-5.
//  - bf16 outputs: the GPU rounds its fp32 result once to bf16 (relative error <= 2^-8 = 0.39%),
//    twice where the bias is added after the product (a bias pointer the epilogue cannot take);
//    atol/rtol 1e-2 (~2.5 x 2^-8) covers both, with the absolute part at the output's scale for
//    elements that cancel to near zero. The fp32 accumulation error (~1e-6) is negligible here.
struct Tol {
  double atol, rtol;
};
inline Tol tol_for(DType out, int64_t K, double scale) {
  if (out == DType::BF16) return {1e-2 * scale, 1e-2};
  return {5e-7 * std::sqrt(double(std::max<int64_t>(K, 1))) * scale, 1e-5};
}
inline double scale_of(int64_t K) { return std::sqrt(double(std::max<int64_t>(K, 1))); }

inline void check_close(const std::vector<float>& got, const std::vector<float>& want, Tol t, const char* what) {
  auto r = allclose(got, want, t.atol, t.rtol);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}

// Random normal host data, rounded to bf16 when the GPU will hold it in bf16.
inline std::vector<float> input(size_t n, uint64_t seed, uint64_t stream, DType dt, float stddev = 1.0f,
                                float mean = 0.0f) {
  auto v = random_normal(n, seed, stream, stddev, mean);
  return dt == DType::BF16 ? rounded_bf16(v) : v;
}

}  // namespace mpigpt::testing
