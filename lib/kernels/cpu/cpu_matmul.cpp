// CPU backend: matrix products (gemm, linear forward/backward), every product one cblas_sgemm.
#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

// Empty products are handled here because BLAS rejects a leading dimension of 0.
void sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* a, int64_t lda, const float* b,
           int64_t ldb, float beta, float* c, int64_t ldc, const char* op) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_int(M, op),
              blas_int(N, op), blas_int(K, op), alpha, a, blas_int(lda, op), b, blas_int(ldb, op), beta, c,
              blas_int(ldc, op));
}

void CpuOps::gemm_impl(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) {
  // c (M,N), a (M,K) or (K,M) when trans_a, b (K,N) or (N,K) when trans_b
  float* C = f32(c);
  const float* A = f32(a);
  const float* Bm = f32(b);
  const Mat mc = mat_of(c), ma = mat_of(a), mb = mat_of(b);
  const int64_t M = mc.rows, N = mc.cols;
  const int64_t K = trans_a ? ma.rows : ma.cols;
  sgemm(trans_a, trans_b, M, N, K, alpha, A, ma.cols, Bm, mb.cols, beta, C, mc.cols, "gemm");
}

void CpuOps::linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias) {
  // out (N,OC), inp (N,IC), weight (OC,IC), bias (OC)
  float* O = f32(out);
  const float* X = f32(inp);
  const float* W = f32(weight);
  const float* bs = f32(bias);
  const Mat mx = mat_of(inp), mw = mat_of(weight);
  const int64_t N = mx.rows, IC = mx.cols, OC = mw.rows;
  float beta = 0.0f;
  if (bs) {
    // Start from the bias and let sgemm accumulate onto it: one pass over out instead of two.
#pragma omp parallel for schedule(static) if (N * OC >= kParallelMin)
    for (int64_t n = 0; n < N; ++n) std::memcpy(O + n * OC, bs, size_t(OC) * sizeof(float));
    beta = 1.0f;
  }
  sgemm(false, true, N, OC, IC, 1.0f, X, IC, W, IC, beta, O, OC, "linear_forward");
}

// dbias (OC) += column sums of dout (N,OC). Threads own blocks of columns and sum rows in order, so
// the result is bitwise the same for any thread count; double accumulators.
static void column_sums_accumulate(float* dbias, const float* dout, int64_t N, int64_t OC) {
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (OC + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (N * OC >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kBlock, w = std::min(kBlock, OC - c0);
    double acc[kBlock] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* row = dout + n * OC + c0;
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) acc[j] += double(row[j]);
    }
    for (int64_t j = 0; j < w; ++j) dbias[c0 + j] = float(double(dbias[c0 + j]) + acc[j]);
  }
}

void CpuOps::linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) {
  // dinp (N,IC) = dout (N,OC) @ weight (OC,IC); dweight (OC,IC) += dout^T @ inp; dbias (OC) += sum_n dout
  const char* op = "linear_backward";
  float* dX = f32(dinp);
  float* dW = f32(dweight);
  float* db = f32(dbias);
  const float* dO = f32(dout);
  const Mat mo = mat_of(dout);
  const int64_t N = mo.rows, OC = mo.cols;
  if (dX) {
    const float* W = f32(weight);
    const Mat mw = mat_of(weight);
    sgemm(false, false, N, mw.cols, OC, 1.0f, dO, OC, W, mw.cols, 0.0f, dX, mw.cols, op);
  }
  if (dW) {
    const float* X = f32(inp);
    const Mat mx = mat_of(inp);
    sgemm(true, false, OC, mx.cols, N, 1.0f, dO, OC, X, mx.cols, 1.0f, dW, mx.cols, op);
  }
  if (db) column_sums_accumulate(db, dO, N, OC);
}

// The fused ops of the GPT-2 MLP are, on the reference backend, the two ops in turn: the numbers
// the GPU's epilogues are checked against.
void CpuOps::linear_residual_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) {
  // out (N,OC) = inp @ weight^T + bias + residual (N,OC)
  linear_forward(out, inp, weight, bias);
  add(out, out, residual);
}

void CpuOps::linear_gelu_forward_impl(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) {
  // pre (N,OC) = inp @ weight^T + bias; out (N,OC) = gelu(pre)
  linear_forward(pre, inp, weight, bias);
  gelu_forward(out, pre);
}

void CpuOps::linear_backward_gelu_impl(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act,
                                       Tensor weight,
                                       Tensor pre) {
  // dpre (N,IC) = (dout @ weight) * gelu'(pre); dweight += dout^T @ act; dbias += column sums of dout
  linear_backward(dpre, dweight, dbias, dout, act, weight);
  gelu_backward(dpre, dpre, pre);
}

}  // namespace mpigpt::cpu
