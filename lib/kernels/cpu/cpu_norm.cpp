// CPU backend: LayerNorm and RMSNorm forward/backward (row statistics accumulated in double).
#include <algorithm>
#include <cmath>

#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

namespace {

constexpr int64_t kColBlock = 64;  // channels per task in the weight-gradient column sums

// dweight (C) += sum_n dout[n,:] * xhat[n,:], dbias (C) += sum_n dout[n,:], xhat = (inp - mean) * rstd
// (mean null for RMSNorm). Threads own blocks of channels and walk the rows in order, so the sums
// are bitwise the same for any thread count.
void norm_param_grads(float* dweight, float* dbias, const float* dout, const float* inp, const float* mean,
                      const float* rstd, int64_t N, int64_t C) {
  const int64_t blocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t c0 = blk * kColBlock, w = std::min(kColBlock, C - c0);
    double aw[kColBlock] = {}, ab[kColBlock] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* g = dout + n * C + c0;
      const float* x = inp + n * C + c0;
      const float m = mean ? mean[n] : 0.0f, rs = rstd[n];
#pragma omp simd
      for (int64_t j = 0; j < w; ++j) {
        aw[j] += double(g[j] * ((x[j] - m) * rs));
        ab[j] += double(g[j]);
      }
    }
    if (dweight)
      for (int64_t j = 0; j < w; ++j) dweight[c0 + j] = float(double(dweight[c0 + j]) + aw[j]);
    if (dbias)
      for (int64_t j = 0; j < w; ++j) dbias[c0 + j] = float(double(dbias[c0 + j]) + ab[j]);
  }
}

}  // namespace

void CpuOps::layernorm_forward_impl(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                                    float eps) {
  // out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C)
  float* O = f32(out);
  float* M = f32(mean);
  float* R = f32(rstd);
  const float* X = f32(inp);
  const float* W = f32(weight);
  const float* Bs = f32(bias);
  const auto [N, C] = mat_of(inp);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = X + n * C;
    float* o = O + n * C;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; ++c) s += double(x[c]);
    const double m = s / double(C);
    double v = 0.0;  // two-pass variance: no cancellation for rows with a large mean
#pragma omp simd reduction(+ : v)
    for (int64_t c = 0; c < C; ++c) {
      const double d = double(x[c]) - m;
      v += d * d;
    }
    const float mf = float(m), rs = float(1.0 / std::sqrt(v / double(C) + double(eps)));
    if (Bs) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - mf) * rs * W[c] + Bs[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = (x[c] - mf) * rs * W[c];
    }
    if (M) M[n] = mf;
    if (R) R[n] = rs;
  }
}

void CpuOps::layernorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                                     Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) +=, dbias (C) +=; dout, inp (N,C); mean, rstd (N); weight (C)
  float* dX = f32(dinp);
  float* dW = f32(dweight);
  float* dB = f32(dbias);
  const float* dO = f32(dout);
  const float* X = f32(inp);
  const float* M = f32(mean);
  const float* R = f32(rstd);
  const float* W = f32(weight);
  const auto [N, C] = mat_of(inp);
  if (dX) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
    for (int64_t n = 0; n < N; ++n) {
      const float* g = dO + n * C;
      const float* x = X + n * C;
      float* dx = dX + n * C;
      const float m = M[n], rs = R[n];
      double a = 0.0, b = 0.0;  // mean of dnorm and of dnorm * xhat
#pragma omp simd reduction(+ : a, b)
      for (int64_t c = 0; c < C; ++c) {
        const float dn = W[c] * g[c];
        a += double(dn);
        b += double(dn * ((x[c] - m) * rs));
      }
      const float ma = float(a / double(C)), mb = float(b / double(C));
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dx[c] += (W[c] * g[c] - ma - (x[c] - m) * rs * mb) * rs;
    }
  }
  if (dW || dB) norm_param_grads(dW, dB, dO, X, M, R, N, C);
}

void CpuOps::rmsnorm_forward_impl(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) {
  // out (N,C) = inp * rstd * weight, rstd (N), inp (N,C), weight (C)
  float* O = f32(out);
  float* R = f32(rstd);
  const float* X = f32(inp);
  const float* W = f32(weight);
  const auto [N, C] = mat_of(inp);
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = X + n * C;
    float* o = O + n * C;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; ++c) s += double(x[c]) * double(x[c]);
    const float rs = float(1.0 / std::sqrt(s / double(C) + double(eps)));
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = x[c] * rs * W[c];
    if (R) R[n] = rs;
  }
}

void CpuOps::rmsnorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) +=; dout, inp (N,C); rstd (N); weight (C)
  float* dX = f32(dinp);
  float* dW = f32(dweight);
  const float* dO = f32(dout);
  const float* X = f32(inp);
  const float* R = f32(rstd);
  const float* W = f32(weight);
  const auto [N, C] = mat_of(inp);
  if (dX) {
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
    for (int64_t n = 0; n < N; ++n) {
      const float* g = dO + n * C;
      const float* x = X + n * C;
      float* dx = dX + n * C;
      const float rs = R[n];
      double b = 0.0;  // mean of dnorm * xhat
#pragma omp simd reduction(+ : b)
      for (int64_t c = 0; c < C; ++c) b += double(W[c] * g[c] * (x[c] * rs));
      const float mb = float(b / double(C));
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dx[c] += (W[c] * g[c] - x[c] * rs * mb) * rs;
    }
  }
  if (dW) norm_param_grads(dW, nullptr, dO, X, nullptr, R, N, C);
}

// The residual add and the norm after it, in turn (the GPU fuses them into one kernel).
void CpuOps::residual_layernorm_forward_impl(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                             Tensor weight, Tensor bias, float eps) {
  // sum (N,C) = a + b; out, mean, rstd = layernorm(sum)
  add(sum, a, b);
  layernorm_forward(out, mean, rstd, sum, weight, bias, eps);
}

void CpuOps::residual_rmsnorm_forward_impl(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                           float eps) {
  // sum (N,C) = a + b; out, rstd = rmsnorm(sum)
  add(sum, a, b);
  rmsnorm_forward(out, rstd, sum, weight, eps);
}

}  // namespace mpigpt::cpu
