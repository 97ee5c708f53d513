// CPU backend: GELU (tanh approximation, as GPT-2 / llm.c) and SwiGLU, forward and backward.
#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;
}  // namespace

// GELU's tanh approximation 0.5 x (1 + tanh(a)), a = sqrt(2/pi) (x + 0.044715 x^3), is evaluated
// through the identity 0.5 (1 + tanh(a)) = sigmoid(2a) = 1 / (1 + e^{-2a}): the same function, but
// 1 + tanh(a) and 1 - tanh(a)^2 no longer cancel for negative x, so the tail (and its gradient)
// keeps full relative precision.
void CpuOps::gelu_forward_impl(Tensor out, Tensor inp) {
  // out, inp same shape
  float* O = f32(out);
  const float* X = f32(inp);
  const int64_t n = inp.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = X[i];
    O[i] = x * vsigmoid(2.0f * kGeluScale * (x + kGeluCubic * x * x * x));
  }
}

void CpuOps::gelu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (overwritten, may alias dout) = gelu'(inp) * dout
  float* dX = f32(dinp);
  const float* dO = f32(dout);
  const float* X = f32(inp);
  const int64_t n = inp.numel();
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = X[i];
    // sigma = sigmoid(2a) = 0.5 (1 + tanh a); 0.5 (1 - tanh(a)^2) = 2 sigma (1 - sigma).
    float sigma, one_minus;
    vsigmoid2(2.0f * kGeluScale * (x + kGeluCubic * x * x * x), sigma, one_minus);
    const float local = sigma + 2.0f * x * sigma * one_minus * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
    dX[i] = local * dO[i];
  }
}

// Rows of inp (N, 2F) are [gate (F) | up (F)].
static int64_t swiglu_rows(const Tensor& half, int64_t* F) {
  const Mat mh = mat_of(half);
  *F = mh.cols;
  return mh.rows;
}

void CpuOps::swiglu_forward_impl(Tensor out, Tensor inp) {
  // out (N,F) = silu(gate) * up, inp (N,2F)
  float* O = f32(out);
  const float* X = f32(inp);
  int64_t F = 0;
  const int64_t N = swiglu_rows(out, &F);
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = X + n * 2 * F;
    const float* up = gate + F;
    float* o = O + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) o[f] = gate[f] * vsigmoid(gate[f]) * up[f];
  }
}

void CpuOps::swiglu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (N,2F) overwritten (may alias inp), dout (N,F), inp (N,2F)
  float* dX = f32(dinp);
  const float* dO = f32(dout);
  const float* X = f32(inp);
  int64_t F = 0;
  const int64_t N = swiglu_rows(dout, &F);
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = X + n * 2 * F;
    const float* up = gate + F;
    const float* g = dO + n * F;
    float* dgate = dX + n * 2 * F;
    float* dup = dgate + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float a = gate[f], u = up[f];
      float s, one_minus;
      vsigmoid2(a, s, one_minus);
      // d silu(a)/da = s (1 + a (1 - s)); both inputs are read before either output is written.
      dgate[f] = g[f] * u * s * (1.0f + a * one_minus);
      dup[f] = g[f] * a * s;
    }
  }
}

}  // namespace mpigpt::cpu
