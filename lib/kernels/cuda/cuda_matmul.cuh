// The cuBLASLt product behind cuda_matmul.cu's ops, and where it runs: run_matmul, through the
// plan cache, the heuristic and the autotuning of cuda_matmul_plans.cu. Included only by those two.
#pragma once
#include <algorithm>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

// The GELU epilogues: Forward D = gelu(AB + bias) with aux = AB + bias (the pre-activation kept
// for the backward); Backward D = AB * gelu'(aux). aux has D's dtype and layout (ld ldc).
enum class Gelu { None, Forward, Backward };

// One column-major product D (m,n) = alpha op(A) op(B) + beta C with D at C (ld ldc) and C read
// from Cin when given (same layout), else from D itself; op(A) (m,k), op(B) (k,n); bias (m) added
// by the epilogue when given.
struct LtMatmul {
  bool ta = false, tb = false;
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* C = nullptr;
  int64_t ldc = 0;
  const void* Cin = nullptr;
  DType ab = DType::F32, cd = DType::F32;
  const void* bias = nullptr;
  float alpha = 1.0f, beta = 0.0f;
  Gelu gelu = Gelu::None;
  void* aux = nullptr;
};

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing the address.
inline uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  return uint32_t(std::min<uintptr_t>(256, a & (~a + 1)));
}

// Runs the product; false (and nothing queued) when it has an epilogue (bias, GELU)
// and no algorithm supports it for this product, so the caller can do the epilogue's work itself.
bool run_matmul(CudaOps& ops, const LtMatmul& mm, const char* op);

}  // namespace mpigpt::cuda
