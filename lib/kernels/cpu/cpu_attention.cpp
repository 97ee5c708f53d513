// CPU backend: rotary embedding and causal grouped-query attention (sgemm on strided qkv rows).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

namespace {

constexpr int kMaxHeadDim = 1024;  // bounds the per-row cos/sin tables kept on the stack

// Rotates the NH query and NKV key heads of each row of qkv (N, (NH+2*NKV)*HD) by pos * inv_freq;
// sign = -1 rotates back (the transpose, i.e. the backward).
void rope_apply(const char* op, Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta, double sign) {
  float* X = f32(qkv);
  const int32_t* pos = i32(positions);
  MPIGPT_CHECK(HD <= kMaxHeadDim, "{}: head dim {} is more than the CPU backend's {}", op, HD, kMaxHeadDim);
  const Mat mx = mat_of(qkv);
  const int64_t R = int64_t(NH + 2 * NKV) * HD, N = mx.rows, half = HD / 2, heads = NH + NKV;
  double inv_freq[kMaxHeadDim / 2];
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = std::pow(double(theta), -2.0 * double(i) / double(HD));
#pragma omp parallel for schedule(static) if (N * R >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    // Angles in double: pos * freq reaches thousands of radians, where float would lose the phase.
    float cs[kMaxHeadDim / 2], sn[kMaxHeadDim / 2];
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(pos[n]) * inv_freq[i];
      cs[i] = float(std::cos(a));
      sn[i] = float(sign * std::sin(a));
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* x = X + n * R + h * HD;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs[i] - x2 * sn[i];
        x[i + half] = x2 * cs[i] + x1 * sn[i];
      }
    }
  }
}

// The geometry of one attention call: qkv (B,T,R) with R = (NH+2*NKV)*HD, out (B,T,NH*HD).
struct AttnDims {
  int64_t B, T, NH, NKV, HD, R, ldo;
};

AttnDims attn_dims(const char* op, const Tensor& qkv, int NH, int NKV, int HD) {
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  blas_int(R, op);  // the sgemm calls inside the threads must not fail (and throw) there
  blas_int(qkv.size(1), op);
  return {qkv.size(0), qkv.size(1), NH, NKV, HD, R, int64_t(NH) * HD};
}

// Threads split the (batch, head) tasks only when there are enough of them and each call has
// enough work (~ multiply-adds of one product) to pay for a parallel region.
bool parallel_tasks(int64_t tasks, int64_t B, int64_t NH, int64_t T, int64_t HD) {
  return tasks > 1 && tasks >= omp_get_max_threads() && B * NH * T * T * HD >= (int64_t(1) << 20);
}

// Query rows are processed in blocks so that the causal mask skips the products with keys past the
// block (about half of the work for long sequences); key blocks in the backward use the same grid.
constexpr int64_t kBlock = 64;

}  // namespace

void CpuOps::rope_forward_impl(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  rope_apply("rope_forward", qkv, positions, NH, NKV, HD, theta, 1.0);
}

void CpuOps::rope_backward_impl(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  rope_apply("rope_backward", dqkv, positions, NH, NKV, HD, theta, -1.0);
}

void CpuOps::attention_forward_impl(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) {
  // out (B,T,NH*HD), saved = probabilities P (B,NH,T,T), qkv (B,T,(NH+2*NKV)*HD)
  const char* op = "attention_forward";
  float* O = f32(out);
  float* Ps = f32(saved);
  const float* X = f32(qkv);
  const AttnDims d = attn_dims(op, qkv, NH, NKV, HD);
  const int64_t B = d.B, T = d.T, R = d.R, ldo = d.ldo, G = d.NH / d.NKV;
  const float scale = float(1.0 / std::sqrt(double(HD)));
  const int64_t tasks = B * NH;
  // One (batch, head) per task; when there are fewer tasks than threads, BLAS threads instead.
#pragma omp parallel for schedule(static) if (parallel_tasks(tasks, B, NH, T, HD))
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task / NH, h = task % NH, kh = h / G;
    const float* Q = X + b * T * R + h * HD;
    const float* K = X + b * T * R + (NH + kh) * HD;
    const float* V = X + b * T * R + (NH + NKV + kh) * HD;
    float* P = Ps + task * T * T;
    float* Ob = O + b * T * ldo + h * HD;
    for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
      const int64_t i1 = std::min(T, i0 + kBlock);
      // S = scale * Q K^T for these query rows against keys [0, i1).
      sgemm(false, true, i1 - i0, i1, HD, scale, Q + i0 * R, R, K, R, 0.0f, P + i0 * T, T, op);
      for (int64_t i = i0; i < i1; ++i) {
        float* p = P + i * T;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j <= i; ++j) mx = p[j] > mx ? p[j] : mx;  // (std::max does not vectorise)
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j <= i; ++j) {
          const float e = vexp(p[j] - mx);
          p[j] = e;
          s += double(e);
        }
        const float inv = float(1.0 / s);
#pragma omp simd
        for (int64_t j = 0; j <= i; ++j) p[j] *= inv;
        std::fill(p + i + 1, p + T, 0.0f);  // masked: zero probability, as the backward expects
      }
      sgemm(false, false, i1 - i0, HD, i1, 1.0f, P + i0 * T, T, V, R, 0.0f, Ob + i0 * ldo, ldo, op);
    }
  }
}

void CpuOps::attention_backward_impl(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                                     int HD) {
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten, dout (B,T,NH*HD), qkv as forward, saved = P (B,NH,T,T).
  // out is not needed here (the probabilities are kept).
  const char* op = "attention_backward";
  float* dX = f32(dqkv);
  const float* dO = f32(dout);
  const float* X = f32(qkv);
  const float* Ps = f32(saved);
  const AttnDims d = attn_dims(op, qkv, NH, NKV, HD);
  const int64_t B = d.B, T = d.T, R = d.R, ldo = d.ldo, G = d.NH / d.NKV;
  const float scale = float(1.0 / std::sqrt(double(HD)));
  // One (batch, kv head) per task: the G query heads sharing a kv head accumulate into its dK/dV
  // in a fixed order, so no two threads write the same memory and the result is deterministic.
  const int64_t tasks = B * NKV;
#pragma omp parallel for schedule(static) if (parallel_tasks(tasks, B, NH, T, HD))
  for (int64_t task = 0; task < tasks; ++task) {
    static thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(T * T)) scratch.resize(size_t(T * T));
    float* dS = scratch.data();
    const int64_t b = task / NKV, kh = task % NKV;
    const float* K = X + b * T * R + (NH + kh) * HD;
    const float* V = X + b * T * R + (NH + NKV + kh) * HD;
    float* dK = dX + b * T * R + (NH + kh) * HD;
    float* dV = dX + b * T * R + (NH + NKV + kh) * HD;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kh * G + g;
      const float* Q = X + b * T * R + h * HD;
      const float* P = Ps + (b * NH + h) * T * T;
      const float* dOb = dO + b * T * ldo + h * HD;
      float* dQ = dX + b * T * R + h * HD;
      const float beta = g == 0 ? 0.0f : 1.0f;  // the first head overwrites dK/dV, the rest add
      for (int64_t i0 = 0; i0 < T; i0 += kBlock) {
        const int64_t i1 = std::min(T, i0 + kBlock);
        // dP = dO V^T, then dS = P * (dP - rowsum(dP * P)) in place.
        sgemm(false, true, i1 - i0, i1, HD, 1.0f, dOb + i0 * ldo, ldo, V, R, 0.0f, dS + i0 * T, T, op);
        for (int64_t i = i0; i < i1; ++i) {
          const float* p = P + i * T;
          float* ds = dS + i * T;
          double s = 0.0;
#pragma omp simd reduction(+ : s)
          for (int64_t j = 0; j <= i; ++j) s += double(ds[j] * p[j]);
          const float sf = float(s);
#pragma omp simd
          for (int64_t j = 0; j <= i; ++j) ds[j] = p[j] * (ds[j] - sf);
          std::fill(ds + i + 1, ds + i1, 0.0f);
        }
        // dQ = scale * dS K
        sgemm(false, false, i1 - i0, HD, i1, scale, dS + i0 * T, T, K, R, 0.0f, dQ + i0 * R, R, op);
      }
      for (int64_t j0 = 0; j0 < T; j0 += kBlock) {
        const int64_t j1 = std::min(T, j0 + kBlock);
        // Keys [j0, j1) receive gradient from the queries i >= j0 only (causal).
        // dK += scale * dS^T Q, dV += P^T dO
        sgemm(true, false, j1 - j0, HD, T - j0, scale, dS + j0 * T + j0, T, Q + j0 * R, R, beta, dK + j0 * R, R, op);
        sgemm(true, false, j1 - j0, HD, T - j0, 1.0f, P + j0 * T + j0, T, dOb + j0 * ldo, ldo, beta, dV + j0 * R, R,
              op);
      }
    }
  }
}

}  // namespace mpigpt::cpu
