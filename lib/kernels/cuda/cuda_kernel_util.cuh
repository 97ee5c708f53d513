// Device-side building blocks the CUDA kernel files share: 16-byte vector packs, warp and block
// reductions in fp32, and the host-side matrix view, alignment test and dtype checks. Included
// by lib/kernels/cuda/*.cu after cuda_common.cuh.
#pragma once
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

// W consecutive elements moved by one 16-byte (or, for W = 1, scalar) access.
template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};
template <int W, class T>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, W>*>(p);
}
template <int W, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& x) {
  *reinterpret_cast<Pack<T, W>*>(p) = x;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The block's sum / max, returned to every thread (every warp forms the same total in the same
// order); sh holds 32 floats and is free again on return (the trailing barrier).
__device__ __forceinline__ float block_sum(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = warp_sum(lane < nwarps ? sh[lane] : 0.0f);
  __syncthreads();
  return v;
}
// Two block sums for the price of one pair of barriers; sh holds 64 floats.
__device__ __forceinline__ float2 block_sum2(float2 v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  if (lane == 0) {
    sh[warp] = v.x;
    sh[32 + warp] = v.y;
  }
  __syncthreads();
  v = make_float2(warp_sum(lane < nwarps ? sh[lane] : 0.0f), warp_sum(lane < nwarps ? sh[32 + lane] : 0.0f));
  __syncthreads();
  return v;
}
__device__ __forceinline__ float block_max(float v, float* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = warp_max(lane < nwarps ? sh[lane] : -INFINITY);
  __syncthreads();
  return v;
}

// ---- host side ------------------------------------------------------------------------------
// A tensor seen as a matrix: cols = its last dimension, rows = everything before it.
struct RowsCols {
  int64_t rows, cols;
};
inline RowsCols rows_cols(const Tensor& t) {
  const int64_t c = t.ndim() > 0 ? t.size(-1) : 1;
  return {c > 0 ? t.numel() / c : 0, c};
}
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
inline bool aligned16(const Tensor& t) { return aligned16(t.ptr); }

// The query tile of an attention block that owns ROWS queries of one head (the forward and dQ
// kernels, tensor-core and fp32-FMA): grid (ceil(Tq/ROWS), NH, B), causal tiles in reverse order
// (the last queries see the most keys, so they start first); the block's head h, batch row b,
// first query i0, and its kv head's K and V (GQA: NH/NKV query heads share one). Prob is either
// kernel family's parameter struct (k, v, NH, NKV, HD, Tk, kv_stride).
template <class T>
struct QueryTile {
  int h, b, i0;
  const T* K;
  const T* V;
};
template <class T, int ROWS, bool kCausal, class Prob>
__device__ __forceinline__ QueryTile<T> query_tile(const Prob& p) {
  QueryTile<T> q;
  q.h = blockIdx.y;
  q.b = blockIdx.z;
  q.i0 = int(kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * ROWS;
  const int kh = q.h / (p.NH / p.NKV);
  const int64_t kv_off = int64_t(q.b) * p.Tk * p.kv_stride + int64_t(kh) * p.HD;
  q.K = static_cast<const T*>(p.k) + kv_off;
  q.V = static_cast<const T*>(p.v) + kv_off;
  return q;
}

}  // namespace mpigpt::cuda
