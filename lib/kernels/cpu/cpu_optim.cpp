// CPU backend: the fused AdamW update and the deterministic reductions (sum of squares, sum).
#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

// The whole update in one pass over memory: blocks small enough for L1 go through the moment
// updates, a vector sqrt of v-hat, and the parameter update.
static void adamw_pass(float* __restrict P, const float* __restrict G, float* __restrict M, float* __restrict Vs,
                       int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, float inv_bc1,
                       float inv_bc2, float grad_scale) {
  constexpr int64_t kBlock = 512;
  const float one_m_b1 = 1.0f - beta1, one_m_b2 = 1.0f - beta2;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * kBlock, len = std::min(kBlock, n - i0);
    float* __restrict p = P + i0;
    const float* __restrict g = G + i0;
    float* __restrict m = M + i0;
    float* __restrict v = Vs + i0;
    alignas(64) float denom[kBlock];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) {
      const float gi = g[i] * grad_scale;
      m[i] = beta1 * m[i] + one_m_b1 * gi;
      v[i] = beta2 * v[i] + one_m_b2 * gi * gi;
      denom[i] = v[i] * inv_bc2;
    }
    sqrt_inplace(denom, len);
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) p[i] = p[i] - lr * ((m[i] * inv_bc1) / (denom[i] + eps) + weight_decay * p[i]);
  }
}

void CpuOps::adamw_impl(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                        float weight_decay, int64_t step, float grad_scale) {
  // param, grad, m, v: the same flat range; one pass reads all four and writes three (memory bound)
  float* P = f32(param);
  const float* G = f32(grad);
  float* M = f32(m);
  float* Vs = f32(v);
  const int64_t n = param.numel();
  const float inv_bc1 = float(1.0 / (1.0 - std::pow(double(beta1), double(step))));
  const float inv_bc2 = float(1.0 / (1.0 - std::pow(double(beta2), double(step))));
  adamw_pass(P, G, M, Vs, n, lr, beta1, beta2, eps, weight_decay, inv_bc1, inv_bc2, grad_scale);
}

void CpuOps::adamw_runs_impl(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs, float lr,
                             float beta1, float beta2, float eps, int64_t step, float grad_scale) {
  for (const AdamWRun& r : runs)
    adamw(param.flat_slice(r.begin, r.count), grad.flat_slice(r.begin, r.count), m.flat_slice(r.state, r.count),
          v.flat_slice(r.state, r.count), lr, beta1, beta2, eps, r.weight_decay, step, grad_scale);
}

namespace {

// Reductions are split into fixed chunks whose partial sums are added in chunk order: the result
// is bitwise the same whatever the number of threads (OpenMP's reduction clause combines in
// arrival order, which would make gradient clipping non-reproducible).
constexpr int64_t kChunk = 1 << 16;

template <bool kSquare>
double chunked_sum(const float* x, int64_t n) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  static thread_local std::vector<double> partial;
  partial.assign(size_t(chunks), 0.0);
  double* part = partial.data();
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t k = 0; k < chunks; ++k) {
    const float* p = x + k * kChunk;
    const int64_t len = std::min(kChunk, n - k * kChunk);
    // 16 independent accumulators (four AVX2 vectors): a single one would be bound by the latency
    // of the add rather than by memory.
    constexpr int kLanes = 16;
    double acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes)
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) {
        const double d = double(p[i + j]);
        acc[j] += kSquare ? d * d : d;
      }
    double s = 0.0;
    for (; i < len; ++i) s += kSquare ? double(p[i]) * double(p[i]) : double(p[i]);
    for (int j = 0; j < kLanes; ++j) s += acc[j];
    part[k] = s;
  }
  double total = 0.0;
  for (int64_t k = 0; k < chunks; ++k) total += part[k];
  return total;
}

}  // namespace

double CpuOps::sum_squares_impl(Tensor t) { return chunked_sum<true>(f32(t), t.numel()); }

double CpuOps::sum_impl(Tensor t) { return chunked_sum<false>(f32(t), t.numel()); }

}  // namespace mpigpt::cpu
