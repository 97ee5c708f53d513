// CUDA backend: token (+ position) embedding lookup and its scatter-add backward.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 256;

// Grid-stride launches cap the grid; each thread then walks several packs.
unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20)); }

// out (N,C) = wte[tokens - vocab_start] (zeros outside [0, rows)) + wpe[positions] (optional).
// One thread per pack of W channels; a position outside wpe's rows (a caller bug the CPU backend
// reports) gives NaN rather than a read outside the table, so it cannot pass unnoticed.
template <class T, int W>
__global__ void embedding_forward_kernel(T* __restrict__ out, const int32_t* __restrict__ tokens,
                                         const int32_t* __restrict__ positions, const T* __restrict__ wte,
                                         const T* __restrict__ wpe, int64_t N, int64_t C, int64_t rows, int64_t max_pos,
                                         int64_t vocab_start) {
  const int64_t PC = C / W, total = N * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PC, c = (i - n * PC) * W;
    const int64_t r = int64_t(tokens[n]) - vocab_start;
    float acc[W];
    if (r >= 0 && r < rows) {
      const Pack<T, W> e = *reinterpret_cast<const Pack<T, W>*>(wte + r * C + c);
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = to_f(e.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = 0.0f;
    }
    if (wpe) {
      const int64_t p = positions[n];
      if (p >= 0 && p < max_pos) {
        const Pack<T, W> e = *reinterpret_cast<const Pack<T, W>*>(wpe + p * C + c);
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] += to_f(e.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] = __int_as_float(0x7fc00000);  // NaN
      }
    }
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(acc[j]);
    *reinterpret_cast<Pack<T, W>*>(out + n * C + c) = o;
  }
}

// d[0:W) += v[0:W) atomically: one 16-byte atomic per 4 floats on sm_90 (W % 4 == 0 and d 16-byte
// aligned by the launch condition), else scalar atomics.
template <int W>
__device__ __forceinline__ void atomic_add_floats(float* d, const float (&v)[W]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = W % 4 == 0;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q)
      atomicAdd(reinterpret_cast<float4*>(d) + q, make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]));
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) atomicAdd(d + j, v[j]);
  }
}

// dwte (rows,C) += dout rows by token - vocab_start (rows outside [0, rows) skipped); dwpe (maxT,C)
// += dout rows by position (out-of-range positions skipped). Either may be null. Float atomics: one
// pass over dout, no sort, but the order in which repeated tokens add up varies from run to run, so
// dwte/dwpe are reproducible only to fp32 rounding (not bitwise, unlike the CPU backend).
template <class T, int W>
__global__ void embedding_backward_kernel(float* dwte, float* dwpe, const T* __restrict__ dout,
                                          const int32_t* __restrict__ tokens, const int32_t* __restrict__ positions,
                                          int64_t N, int64_t C, int64_t rows, int64_t max_pos, int64_t vocab_start) {
  const int64_t PC = C / W, total = N * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PC, c = (i - n * PC) * W;
    const Pack<T, W> g = *reinterpret_cast<const Pack<T, W>*>(dout + n * C + c);
    float v[W];
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = to_f(g.v[j]);
    if (dwte) {
      const int64_t r = int64_t(tokens[n]) - vocab_start;
      if (r >= 0 && r < rows) atomic_add_floats<W>(dwte + r * C + c, v);
    }
    if (dwpe) {
      const int64_t p = positions[n];
      if (p >= 0 && p < max_pos) atomic_add_floats<W>(dwpe + p * C + c, v);
    }
  }
}

}  // namespace

void CudaOps::embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                     int64_t vocab_start) {
  // out (N,C), tokens (N) i32, positions (N) i32 (with wpe), wte (rows,C) = vocabulary rows
  // [vocab_start, vocab_start+rows), wpe (maxT,C) optional
  const char* op = "embedding_forward";
  const DType dt = out.dtype;
  const RowsCols mo = rows_cols(out), me = rows_cols(wte);
  const int64_t N = mo.rows, C = mo.cols;
  int64_t max_pos = 0;
  if (wpe.defined()) {
    max_pos = rows_cols(wpe).rows;
  }
  if (N == 0 || C == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const bool vec = C % V == 0 && aligned16(out) && aligned16(wte) && (!wpe.defined() || aligned16(wpe));
    const int32_t* pos = wpe.defined() ? ptr<int32_t>(positions) : nullptr;
    const T* P = wpe.defined() ? ptr<T>(wpe) : nullptr;
    if (vec)
      embedding_forward_kernel<T, V><<<grid_for(N * C / V), kThreads, 0, cuda_stream()>>>(
          ptr<T>(out), ptr<int32_t>(tokens), pos, ptr<T>(wte), P, N, C, me.rows, max_pos, vocab_start);
    else
      embedding_forward_kernel<T, 1><<<grid_for(N * C), kThreads, 0, cuda_stream()>>>(
          ptr<T>(out), ptr<int32_t>(tokens), pos, ptr<T>(wte), P, N, C, me.rows, max_pos, vocab_start);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                      int64_t vocab_start) {
  // dwte (rows,C) f32 += scatter of dout (N,C) rows by token; dwpe (maxT,C) f32 += scatter by position
  const char* op = "embedding_backward";
  const DType dt = dout.dtype;
  const RowsCols mo = rows_cols(dout);
  const int64_t N = mo.rows, C = mo.cols;
  int64_t rows = 0, max_pos = 0;
  if (dwte.defined()) {
    rows = rows_cols(dwte).rows;
  }
  if (dwpe.defined()) {
    max_pos = rows_cols(dwpe).rows;
  }
  if ((!dwte.defined() && !dwpe.defined()) || N == 0 || C == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const bool vec = C % V == 0 && aligned16(dout) && aligned16(dwte) && aligned16(dwpe);  // undefined: nullptr
    float* dE = dwte.defined() ? ptr<float>(dwte) : nullptr;
    float* dP = dwpe.defined() ? ptr<float>(dwpe) : nullptr;
    const int32_t* tok = dwte.defined() ? ptr<int32_t>(tokens) : nullptr;
    const int32_t* pos = dwpe.defined() ? ptr<int32_t>(positions) : nullptr;
    if (vec)
      embedding_backward_kernel<T, V><<<grid_for(N * C / V), kThreads, 0, cuda_stream()>>>(
          dE, dP, ptr<T>(dout), tok, pos, N, C, rows, max_pos, vocab_start);
    else
      embedding_backward_kernel<T, 1><<<grid_for(N * C), kThreads, 0, cuda_stream()>>>(
          dE, dP, ptr<T>(dout), tok, pos, N, C, rows, max_pos, vocab_start);
    MPIGPT_CUDA_LAUNCHED();
  });
}

}  // namespace mpigpt::cuda
