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
void CpuOps::gelu_forward(Tensor out, Tensor inp) {
  // out, inp same shape
  float* O = f32_arg(out, "gelu_forward", "out");
  const float* X = f32_arg(inp, "gelu_forward", "inp");
  const int64_t n = inp.numel();
  MPIGPT_CHECK(out.numel() == n, "gelu_forward: out {} and inp {} differ", out.shape.str(), inp.shape.str());
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const float x = X[i];
    O[i] = x * vsigmoid(2.0f * kGeluScale * (x + kGeluCubic * x * x * x));
  }
}

void CpuOps::gelu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (overwritten, may alias dout) = gelu'(inp) * dout
  float* dX = f32_arg(dinp, "gelu_backward", "dinp");
  const float* dO = f32_arg(dout, "gelu_backward", "dout");
  const float* X = f32_arg(inp, "gelu_backward", "inp");
  const int64_t n = inp.numel();
  MPIGPT_CHECK(dinp.numel() == n && dout.numel() == n, "gelu_backward: dinp {}, dout {}, inp {} differ",
               dinp.shape.str(), dout.shape.str(), inp.shape.str());
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
static int64_t swiglu_rows(const char* op, const Tensor& half, const char* half_name, const Tensor& full,
                           const char* full_name, int64_t* F) {
  const Mat mh = mat_of(half), mf = mat_of(full);
  MPIGPT_CHECK(mf.rows == mh.rows && mf.cols == 2 * mh.cols, "{}: {} {} must be (N, 2F) for {} {} (N, F)", op,
               full_name, full.shape.str(), half_name, half.shape.str());
  *F = mh.cols;
  return mh.rows;
}

void CpuOps::swiglu_forward(Tensor out, Tensor inp) {
  // out (N,F) = silu(gate) * up, inp (N,2F)
  float* O = f32_arg(out, "swiglu_forward", "out");
  const float* X = f32_arg(inp, "swiglu_forward", "inp");
  int64_t F = 0;
  const int64_t N = swiglu_rows("swiglu_forward", out, "out", inp, "inp", &F);
#pragma omp parallel for schedule(static) if (N * F >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = X + n * 2 * F;
    const float* up = gate + F;
    float* o = O + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) o[f] = gate[f] * vsigmoid(gate[f]) * up[f];
  }
}

void CpuOps::swiglu_backward(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (N,2F) overwritten (may alias inp), dout (N,F), inp (N,2F)
  float* dX = f32_arg(dinp, "swiglu_backward", "dinp");
  const float* dO = f32_arg(dout, "swiglu_backward", "dout");
  const float* X = f32_arg(inp, "swiglu_backward", "inp");
  int64_t F = 0;
  const int64_t N = swiglu_rows("swiglu_backward", dout, "dout", inp, "inp", &F);
  MPIGPT_CHECK(dinp.numel() == inp.numel(), "swiglu_backward: dinp {} must have the shape of inp {}", dinp.shape.str(),
               inp.shape.str());
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
