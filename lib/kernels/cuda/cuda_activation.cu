// CUDA backend: GELU (tanh approximation), SwiGLU and rotary embedding, forward and backward.
// Element-wise, memory bound: 16-byte packs when the tensors allow them, math in fp32 with the
// hardware exp (__expf: ~2 ulp, far below bf16 rounding and within the F32 test tolerance).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluCubic = 0.044715f;

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20)); }

// sigmoid(x) and 1 - sigmoid(x) without cancellation (as the CPU backend): s = 1/(1+e),
// 1-s = e s with e = e^{-x} capped so that e s stays finite in the far tail.
__device__ __forceinline__ void sigmoid2(float x, float& s, float& one_minus) {
  const float e = fminf(__expf(-x), 1e30f);
  s = 1.0f / (1.0f + e);
  one_minus = e * s;
}

// ---- GELU ---------------------------------------------------------------------------------------

// 0.5 x (1 + tanh a) written as x sigmoid(2a): no cancellation for negative x.
__device__ __forceinline__ float gelu(float x) {
  const float a2 = 2.0f * kGeluScale * (x + kGeluCubic * x * x * x);
  return x / (1.0f + __expf(-a2));
}
__device__ __forceinline__ float gelu_grad(float x) {
  float s, om;
  sigmoid2(2.0f * kGeluScale * (x + kGeluCubic * x * x * x), s, om);
  return s + 2.0f * x * s * om * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

// out = gelu(inp) over n elements (n % W == 0). out may alias inp: each element is read before it
// is written, by the same thread.
template <class T, int W>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t packs = n / W;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T, W> x = load_pack<W>(inp + i * W);
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(gelu(to_f(x.v[j])));
    store_pack<W>(out + i * W, o);
  }
}

// dinp = gelu'(inp) * dout (OVERWRITTEN; dinp may alias dout or inp, same element same thread).
template <class T, int W>
__global__ void gelu_backward_kernel(T* dinp, const T* dout, const T* inp, int64_t n) {
  const int64_t packs = n / W;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T, W> x = load_pack<W>(inp + i * W), g = load_pack<W>(dout + i * W);
    Pack<T, W> d;
#pragma unroll
    for (int j = 0; j < W; ++j) d.v[j] = from_f<T>(gelu_grad(to_f(x.v[j])) * to_f(g.v[j]));
    store_pack<W>(dinp + i * W, d);
  }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

// out (N,F) = silu(gate) * up with inp (N,2F) = [gate | up]; F % W == 0.
template <class T, int W>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  const int64_t PF = F / W, packs = N * PF;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PF, f = (i - n * PF) * W;
    const T* gate = inp + n * 2 * F + f;
    const Pack<T, W> a = load_pack<W>(gate), u = load_pack<W>(gate + F);
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x = to_f(a.v[j]);
      o.v[j] = from_f<T>(x / (1.0f + __expf(-x)) * to_f(u.v[j]));
    }
    store_pack<W>(out + n * F + f, o);
  }
}

// dinp (N,2F) OVERWRITTEN from dout (N,F); dinp may alias inp: a thread reads its gate and up
// packs before it writes the same two packs of dinp.
template <class T, int W>
__global__ void swiglu_backward_kernel(T* dinp, const T* dout, const T* inp, int64_t N, int64_t F) {
  const int64_t PF = F / W, packs = N * PF;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PF, f = (i - n * PF) * W;
    const T* gate = inp + n * 2 * F + f;
    const Pack<T, W> a = load_pack<W>(gate), u = load_pack<W>(gate + F), g = load_pack<W>(dout + n * F + f);
    Pack<T, W> dg, du;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x = to_f(a.v[j]), up = to_f(u.v[j]), gj = to_f(g.v[j]);
      float s, om;
      sigmoid2(x, s, om);
      dg.v[j] = from_f<T>(gj * up * s * (1.0f + x * om));  // d silu/dx = s (1 + x (1 - s))
      du.v[j] = from_f<T>(gj * x * s);
    }
    T* d = dinp + n * 2 * F + f;
    store_pack<W>(d, dg);
    store_pack<W>(d + F, du);
  }
}

// ---- rotary embedding ---------------------------------------------------------------------------

// One thread per (row n, frequency i < HD/2): it forms cos/sin of pos * theta^(-2i/HD) once and
// rotates the pair (i, i + HD/2) of each of the NH + NKV query/key heads (v heads untouched).
// The angle reaches ~1e5 rad for long contexts, where a float product would lose the phase: it is
// formed and reduced modulo 2 pi in double (a few double ops per thread, amortised over the
// heads), then sincosf works on |r| <= pi. sign = -1 rotates back (the backward).
template <class T>
__global__ void rope_kernel(T* qkv, const int32_t* __restrict__ positions, int64_t N, int heads, int HD, int64_t R,
                            double log2_theta, float sign) {
  const int half = HD / 2;
  const int64_t total = N * half;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = t / half;
    const int i = int(t - n * half);
    const double inv_freq = exp2(-2.0 * double(i) / double(HD) * log2_theta);
    const double a = double(positions[n]) * inv_freq;
    constexpr double kTwoPi = 6.283185307179586;
    const float r = float(a - kTwoPi * rint(a / kTwoPi));
    float sn, cs;
    sincosf(r, &sn, &cs);
    sn *= sign;
    T* x = qkv + n * R + i;
    for (int h = 0; h < heads; ++h, x += HD) {
      const float x1 = to_f(x[0]), x2 = to_f(x[half]);
      x[0] = from_f<T>(x1 * cs - x2 * sn);
      x[half] = from_f<T>(x2 * cs + x1 * sn);
    }
  }
}

// Rows of inp (N, 2F) are [gate (F) | up (F)] for half (N, F); returns N and sets F.
int64_t swiglu_rows(const Tensor& half, int64_t* F) {
  *F = half.ndim() > 0 ? half.size(-1) : 1;
  return *F > 0 ? half.numel() / *F : 0;
}

void rope_apply(CudaOps& ops, const char* op, Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta,
                float sign) {
  // qkv (N, (NH+2*NKV)*HD) in place, positions (N) i32
  const DType dt = qkv.dtype;
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  const int64_t cols = qkv.ndim() > 0 ? qkv.size(-1) : 1;
  const int64_t N = cols > 0 ? qkv.numel() / cols : 0;
  if (N == 0) return;
  const double log2_theta = std::log2(double(theta));
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<grid_for(N * (HD / 2)), kThreads, 0, ops.cuda_stream()>>>(ptr<T>(qkv), ptr<int32_t>(positions), N,
                                                                               NH + NKV, HD, R, log2_theta, sign);
    MPIGPT_CUDA_LAUNCHED();
  });
}

}  // namespace

void CudaOps::gelu_forward_impl(Tensor out, Tensor inp) {
  // out, inp same shape
  const char* op = "gelu_forward";
  const DType dt = out.dtype;
  const int64_t n = inp.numel();
  if (n == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(out) && aligned16(inp))
      gelu_forward_kernel<T, V><<<grid_for(n / V), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp), n);
    else
      gelu_forward_kernel<T, 1><<<grid_for(n), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp), n);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::gelu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (overwritten, may alias dout) = gelu'(inp) * dout; all the same shape
  const char* op = "gelu_backward";
  const DType dt = dinp.dtype;
  const int64_t n = inp.numel();
  if (n == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (n % V == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp))
      gelu_backward_kernel<T, V>
          <<<grid_for(n / V), kThreads, 0, cuda_stream()>>>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(inp), n);
    else
      gelu_backward_kernel<T, 1>
          <<<grid_for(n), kThreads, 0, cuda_stream()>>>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(inp), n);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::swiglu_forward_impl(Tensor out, Tensor inp) {
  // out (N,F) = silu(gate) * up, inp (N,2F) = [gate | up]
  const char* op = "swiglu_forward";
  const DType dt = out.dtype;
  int64_t F = 0;
  const int64_t N = swiglu_rows(out, &F);
  if (N == 0 || F == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (F % V == 0 && aligned16(out) && aligned16(inp))
      swiglu_forward_kernel<T, V><<<grid_for(N * F / V), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp), N, F);
    else
      swiglu_forward_kernel<T, 1><<<grid_for(N * F), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp), N, F);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::swiglu_backward_impl(Tensor dinp, Tensor dout, Tensor inp) {
  // dinp (N,2F) overwritten (may alias inp), dout (N,F), inp (N,2F)
  const char* op = "swiglu_backward";
  const DType dt = dinp.dtype;
  int64_t F = 0;
  const int64_t N = swiglu_rows(dout, &F);
  if (N == 0 || F == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (F % V == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp))
      swiglu_backward_kernel<T, V>
          <<<grid_for(N * F / V), kThreads, 0, cuda_stream()>>>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(inp), N, F);
    else
      swiglu_backward_kernel<T, 1>
          <<<grid_for(N * F), kThreads, 0, cuda_stream()>>>(ptr<T>(dinp), ptr<T>(dout), ptr<T>(inp), N, F);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::rope_forward_impl(Tensor qkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  // qkv (N, (NH+2*NKV)*HD) rotated in place (q and k heads), positions (N) i32
  rope_apply(*this, "rope_forward", qkv, positions, NH, NKV, HD, theta, 1.0f);
}

void CudaOps::rope_backward_impl(Tensor dqkv, Tensor positions, int NH, int NKV, int HD, float theta) {
  // dqkv (N, (NH+2*NKV)*HD): the inverse rotation of its q and k heads, in place
  rope_apply(*this, "rope_backward", dqkv, positions, NH, NKV, HD, theta, -1.0f);
}

}  // namespace mpigpt::cuda
