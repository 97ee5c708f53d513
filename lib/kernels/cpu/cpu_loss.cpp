// CPU backend: fused softmax + cross-entropy loss and its logits gradient.
#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

void CpuOps::crossentropy_forward_backward(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                           float dloss) {
  // losses (N), dlogits (N,Vp) (may alias logits), logits (N,Vp), targets (N) i32; softmax over [0, V)
  const char* op = "crossentropy_forward_backward";
  float* L = f32_opt(losses, op, "losses");
  float* dX = f32_opt(dlogits, op, "dlogits");
  const float* X = f32_arg(logits, op, "logits");
  const int32_t* tgt = i32_arg(targets, op, "targets");
  const Mat mx = mat_of(logits);
  const int64_t N = mx.rows, Vp = mx.cols;
  MPIGPT_CHECK(V > 0 && V <= Vp, "{}: V = {} must be in [1, Vp = {}] (logits {})", op, V, Vp, logits.shape.str());
  MPIGPT_CHECK(targets.numel() == N, "{}: targets {} must have N = {} elements (logits {})", op, targets.shape.str(), N,
               logits.shape.str());
  MPIGPT_CHECK(!L || losses.numel() == N, "{}: losses {} must have N = {} elements", op, losses.shape.str(), N);
  MPIGPT_CHECK(!dX || (dlogits.numel() == logits.numel() && mat_of(dlogits).cols == Vp),
               "{}: dlogits {} must have the shape of logits {}", op, dlogits.shape.str(), logits.shape.str());
  for (int64_t n = 0; n < N; ++n)
    MPIGPT_CHECK(tgt[n] < V, "{}: targets[{}] = {} is not below V = {}", op, n, tgt[n], V);

#pragma omp parallel for schedule(static) if (N * V >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = X + n * Vp;
    float* dx = dX ? dX + n * Vp : nullptr;
    const int32_t t = tgt[n];
    if (t < 0) {  // ignored row
      if (L) L[n] = 0.0f;
      if (dx) std::fill(dx, dx + Vp, 0.0f);
      continue;
    }
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < V; ++c) m = x[c] > m ? x[c] : m;  // (std::max does not vectorise)
    const float xt = x[t];                                    // read before dx (possibly the same memory) is written
    double s = 0.0;
    if (dx) {
      // Keep the exponentials in dx so that the gradient pass needs no second exp.
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < V; ++c) {
        const float e = vexp(x[c] - m);
        dx[c] = e;
        s += double(e);
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < V; ++c) s += double(vexp(x[c] - m));
    }
    if (L) L[n] = float(std::log(s) - (double(xt) - double(m)));
    if (dx) {
      const float f = float(double(dloss) / s);
#pragma omp simd
      for (int64_t c = 0; c < V; ++c) dx[c] *= f;
      dx[t] -= dloss;
      std::fill(dx + V, dx + Vp, 0.0f);
    }
  }
}

}  // namespace mpigpt::cpu
