// The host emulator's reference cuBLASLt (docs/testing.md, include/cublasLt.h): descriptors as plain
// structs, a heuristic that accepts every consistent product, and products computed by plain loops.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cublasLt.h"
#include "cuda_bf16.h"
#include "cuda_runtime.h"

struct cublasLtContext {};
struct EmuDesc {
  int ta = 0, tb = 0;
  uint32_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  void* aux = nullptr;
  int64_t aux_ld = 0;
};
struct EmuLayout {
  cudaDataType_t t;
  uint64_t rows, cols;
  int64_t ld;
};
struct EmuPref {};
cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasLtGetStatusString(cublasStatus_t) { return "emulated cublas error"; }
const char* cublasLtGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_EMULATED"; }
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t c, cudaDataType_t s) {
  if (c != CUBLAS_COMPUTE_32F || s != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new EmuDesc;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void* v,
                                              size_t n) {
  switch (a) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      if (n != 4) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->ta, v, 4);
      break;
    case CUBLASLT_MATMUL_DESC_TRANSB:
      if (n != 4) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->tb, v, 4);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      if (n != 4) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->epi, v, 4);
      break;
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      if (n != sizeof(void*)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->bias, v, n);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      if (n != sizeof(void*)) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->aux, v, n);
      break;
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      if (n != 8) return CUBLAS_STATUS_INVALID_VALUE;
      std::memcpy(&d->aux_ld, v, 8);
      break;
    default:
      return CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t t, uint64_t r, uint64_t c, int64_t ld) {
  if (ld < int64_t(r) || r == 0 || c == 0) return CUBLAS_STATUS_INVALID_VALUE;
  *l = new EmuLayout{t, r, c, ld};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = new EmuPref;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t,
                                                    const void*, size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
// The descriptors checked as cuBLASLt documents them: shapes, types, and the GELU input matrix's
// leading dimension, so that CudaOps' row-major mapping onto column-major products is exercised.
static bool shapes_ok(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                      cublasLtMatrixLayout_t D) {
  const uint64_t m = D->rows, n = D->cols;
  const uint64_t am = d->ta ? A->cols : A->rows, ak = d->ta ? A->rows : A->cols;
  const uint64_t bk = d->tb ? B->cols : B->rows, bn = d->tb ? B->rows : B->cols;
  if (am != m || bn != n || ak != bk || C->rows != m || C->cols != n || A->t != B->t || C->t != D->t) return false;
  if ((d->epi & 128) && (d->aux_ld % 8 != 0 || d->aux_ld < int64_t(m) || !d->aux)) return false;
  return true;
}
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A,
                                              cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t, int requested, cublasLtMatmulHeuristicResult_t* r,
                                              int* found) {
  if (!shapes_ok(d, A, B, C, D)) {
    fprintf(stderr, "emu cublasLt: inconsistent shapes\n");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  // Up to three candidates (one algorithm under three names), so that callers' autotuning runs.
  *found = requested < 3 ? requested : 3;
  std::memset(r, 0, sizeof(*r) * size_t(*found));
  return CUBLAS_STATUS_SUCCESS;
}
static double rd(const void* p, cudaDataType_t t, int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
static void wr(void* p, cudaDataType_t t, int64_t i, double v) {
  if (t == CUDA_R_32F)
    static_cast<float*>(p)[i] = float(v);
  else
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(float(v));
}
static double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double gelu_grad(double x) {
  const double k = 0.7978845608028654, t = std::tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x);
}
// D = alpha op(A) op(B) + beta C (double sums in order, rounded once to f32 as an fp32 accumulator
// would be), then the epilogue: + bias (per row of the column-major D), GELU (tanh approximation,
// writing its input to the aux matrix) or the GELU gradient (from the aux matrix).
cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void* alpha_p, const void* A,
                              cublasLtMatrixLayout_t la, const void* B, cublasLtMatrixLayout_t lb, const void* beta_p,
                              const void* C, cublasLtMatrixLayout_t lc, void* D, cublasLtMatrixLayout_t ld,
                              const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t) {
  if (!shapes_ok(d, la, lb, lc, ld)) return CUBLAS_STATUS_INVALID_VALUE;
  const float alpha = *static_cast<const float*>(alpha_p), beta = *static_cast<const float*>(beta_p);
  const int64_t m = int64_t(ld->rows), n = int64_t(ld->cols), k = d->ta ? int64_t(la->rows) : int64_t(la->cols);
  const bool has_bias = d->epi & 4, gelu_fwd = (d->epi & 32) != 0, dgelu = (d->epi & 64) != 0;
  if (has_bias && !d->bias) return CUBLAS_STATUS_INVALID_VALUE;

  // op(A) by rows and op(B) by columns, in double, so that each dot product reads two contiguous
  // rows; four columns at a time keep four independent sums in flight (each still summed in order
  // p = 0, 1, ..., k - 1, the result of the plain loop).
  std::vector<double> a(size_t(m * k)), b(size_t(n * k)), out(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t p = 0; p < k; ++p)
      a[size_t(i * k + p)] = d->ta ? rd(A, la->t, p + i * la->ld) : rd(A, la->t, i + p * la->ld);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t p = 0; p < k; ++p)
      b[size_t(j * k + p)] = d->tb ? rd(B, lb->t, j + p * lb->ld) : rd(B, lb->t, p + j * lb->ld);
  auto finish = [&](int64_t i, int64_t j, double s) {
    float acc = alpha * float(s);
    if (beta != 0.0f) acc += beta * float(rd(C, lc->t, i + j * lc->ld));
    out[size_t(i + j * m)] = acc;
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const double *b0 = &b[size_t(j * k)], *b1 = b0 + k, *b2 = b1 + k, *b3 = b2 + k;
    for (int64_t i = 0; i < m; ++i) {
      const double* ai = &a[size_t(i * k)];
      double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        s0 += ai[p] * b0[p];
        s1 += ai[p] * b1[p];
        s2 += ai[p] * b2[p];
        s3 += ai[p] * b3[p];
      }
      finish(i, j, s0);
      finish(i, j + 1, s1);
      finish(i, j + 2, s2);
      finish(i, j + 3, s3);
    }
  }
  for (; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double s = 0.0;
      for (int64_t p = 0; p < k; ++p) s += a[size_t(i * k + p)] * b[size_t(j * k + p)];
      finish(i, j, s);
    }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double x = out[size_t(i + j * m)];
      if (has_bias) x += rd(d->bias, ld->t, i);
      if (gelu_fwd) {
        if (d->epi & 128) wr(d->aux, ld->t, i + j * d->aux_ld, x);
        x = gelu(x);
      }
      if (dgelu) x *= gelu_grad(rd(d->aux, ld->t, i + j * d->aux_ld));
      wr(D, ld->t, i + j * ld->ld, x);
    }
  return CUBLAS_STATUS_SUCCESS;
}
