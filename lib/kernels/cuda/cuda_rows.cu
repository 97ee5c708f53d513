// CUDA backend: row and column moves between row-major matrices (copy_cols, gather_rows) and the
// scatter-add transpose of a gather.
#include <algorithm>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20)); }

// ---- kernels ------------------------------------------------------------------------------------

// dst (N,Dd)[:, 0:ncols) = src (N,Ds)[:, 0:ncols) with dst/src already offset to their first
// column; every count is a multiple of W.
template <class T, int W>
__global__ void copy_cols_kernel(T* dst, int64_t Dd, const T* src, int64_t Ds, int64_t N, int64_t ncols) {
  const int64_t PC = ncols / W, total = N * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PC, c = (i - n * PC) * W;
    store_pack<W>(dst + n * Dd + c, load_pack<W>(src + n * Ds + c));
  }
}

// out (M,C)[i] = inp (N,C)[index[i]]; an index outside [0, N) (a caller bug the CPU backend
// reports) gives a NaN row rather than a read outside inp.
template <class T, int W>
__global__ void gather_rows_kernel(T* __restrict__ out, const T* __restrict__ inp, const int32_t* __restrict__ index,
                                   int64_t M, int64_t N, int64_t C) {
  const int64_t PC = C / W, total = M * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / PC, c = (i - m * PC) * W;
    const int64_t r = index[m];
    Pack<T, W> v;
    if (r >= 0 && r < N) {
      v = load_pack<W>(inp + r * C + c);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) v.v[j] = from_f<T>(__int_as_float(0x7fc00000));
    }
    store_pack<W>(out + m * C + c, v);
  }
}

// d[0:W) += v atomically, in the widest atomic the hardware has for the type and W.
template <int W>
__device__ __forceinline__ void atomic_add_pack(float* d, const Pack<float, W>& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kVector = W % 4 == 0;
#else
  constexpr bool kVector = false;
#endif
  if constexpr (kVector) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q)
      atomicAdd(reinterpret_cast<float4*>(d) + q,
                make_float4(v.v[4 * q], v.v[4 * q + 1], v.v[4 * q + 2], v.v[4 * q + 3]));
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) atomicAdd(d + j, v.v[j]);
  }
}
template <int W>
__device__ __forceinline__ void atomic_add_pack(bf16* d, const Pack<bf16, W>& v) {
  if constexpr (W % 2 == 0) {
#pragma unroll
    for (int q = 0; q < W / 2; ++q) {
      __nv_bfloat162 pair;
      pair.x = v.v[2 * q];
      pair.y = v.v[2 * q + 1];
      atomicAdd(reinterpret_cast<__nv_bfloat162*>(d) + q, pair);
    }
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) atomicAdd(d + j, v.v[j]);
  }
}

// dinp (N,C)[index[i]] += dout (M,C)[i]; indices outside [0, N) are skipped. Atomics (F32: float,
// 16-byte vector atomics on sm_90; BF16: bf16x2 atomics), so when indices repeat the order of the
// additions, and for BF16 the rounding of each partial sum, varies from run to run; with distinct
// indices (a permutation) the result is exact and reproducible.
template <class T, int W>
__global__ void scatter_add_rows_kernel(T* dinp, const T* __restrict__ dout, const int32_t* __restrict__ index,
                                        int64_t M, int64_t N, int64_t C) {
  const int64_t PC = C / W, total = M * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / PC, c = (i - m * PC) * W;
    const int64_t r = index[m];
    if (r >= 0 && r < N) atomic_add_pack<W>(dinp + r * C + c, load_pack<W>(dout + m * C + c));
  }
}

// ---- host helpers -------------------------------------------------------------------------------

// Copies columns with packs of V elements when every offset, stride and pointer allows it.
template <class T>
void launch_copy_cols(cudaStream_t s, T* dst, int64_t Dd, const T* src, int64_t Ds, int64_t N, int64_t ncols) {
  constexpr int V = 16 / sizeof(T);
  if (ncols % V == 0 && Dd % V == 0 && Ds % V == 0 && aligned16(dst) && aligned16(src))
    copy_cols_kernel<T, V><<<grid_for(N * ncols / V), kThreads, 0, s>>>(dst, Dd, src, Ds, N, ncols);
  else
    copy_cols_kernel<T, 1><<<grid_for(N * ncols), kThreads, 0, s>>>(dst, Dd, src, Ds, N, ncols);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

void CudaOps::copy_cols_impl(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) {
  // dst (N,Dd)[:, dst_col : dst_col+ncols] = src (N,Ds)[:, src_col : src_col+ncols]
  const char* op = "copy_cols";
  const DType dt = dst.dtype;
  const RowsCols md = rows_cols(dst), ms = rows_cols(src);
  const int64_t N = md.rows;
  if (ncols == 0 || N == 0) return;
  // The CPU backend copies row by row with memmove, so dst and src may share memory. Parallel
  // threads cannot order their reads before others' writes, so overlapping memory goes through a
  // scratch copy, unless it is the same matrix with disjoint column ranges (no element is both
  // read and written) or the very same columns (nothing to do).
  const char* d0 = static_cast<const char*>(dst.ptr);
  const char* s0 = static_cast<const char*>(src.ptr);
  const bool overlap = d0 < s0 + src.nbytes() && s0 < d0 + dst.nbytes();
  const bool same_matrix = dst.ptr == src.ptr && md.cols == ms.cols;
  if (same_matrix && dst_col == src_col) return;
  const bool disjoint_cols = same_matrix && (dst_col + ncols <= src_col || src_col + ncols <= dst_col);
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    T* D = ptr<T>(dst) + dst_col;
    const T* S = ptr<T>(src) + src_col;
    if (overlap && !disjoint_cols) {
      Scratch tmp = scratch(size_t(N) * size_t(ncols) * sizeof(T));
      T* t = static_cast<T*>(tmp.ptr);
      launch_copy_cols<T>(cuda_stream(), t, ncols, S, ms.cols, N, ncols);
      launch_copy_cols<T>(cuda_stream(), D, md.cols, t, ncols, N, ncols);
    } else {
      launch_copy_cols<T>(cuda_stream(), D, md.cols, S, ms.cols, N, ncols);
    }
  });
}

void CudaOps::gather_rows_impl(Tensor out, Tensor inp, Tensor index) {
  // out (M,C)[i] = inp (N,C)[index[i]], index (M) i32
  const char* op = "gather_rows";
  const DType dt = out.dtype;
  const RowsCols mo = rows_cols(out), mi = rows_cols(inp);
  const int64_t M = mo.rows, C = mo.cols;
  if (M == 0 || C == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (C % V == 0 && aligned16(out.ptr) && aligned16(inp.ptr))
      gather_rows_kernel<T, V><<<grid_for(M * C / V), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp),
                                                                                    ptr<int32_t>(index), M, mi.rows, C);
    else
      gather_rows_kernel<T, 1><<<grid_for(M * C), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(inp),
                                                                                ptr<int32_t>(index), M, mi.rows, C);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::scatter_add_rows_impl(Tensor dinp, Tensor dout, Tensor index) {
  // dinp (N,C)[index[i]] += dout (M,C)[i], index (M) i32 (may repeat)
  const char* op = "scatter_add_rows";
  const DType dt = dinp.dtype;
  const RowsCols mi = rows_cols(dinp), mo = rows_cols(dout);
  const int64_t M = mo.rows, C = mo.cols;
  if (M == 0 || C == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    T* dI = ptr<T>(dinp);
    const T* dO = ptr<T>(dout);
    const int32_t* idx = ptr<int32_t>(index);
    if (C % V == 0 && aligned16(dI) && aligned16(dO))
      scatter_add_rows_kernel<T, V><<<grid_for(M * C / V), kThreads, 0, cuda_stream()>>>(dI, dO, idx, M, mi.rows, C);
    else if (sizeof(T) == 2 && C % 2 == 0 && (reinterpret_cast<uintptr_t>(dI) & 3u) == 0 &&
             (reinterpret_cast<uintptr_t>(dO) & 3u) == 0)  // bf16 pairs: half the atomics
      scatter_add_rows_kernel<T, 2><<<grid_for(M * C / 2), kThreads, 0, cuda_stream()>>>(dI, dO, idx, M, mi.rows, C);
    else
      scatter_add_rows_kernel<T, 1><<<grid_for(M * C), kThreads, 0, cuda_stream()>>>(dI, dO, idx, M, mi.rows, C);
    MPIGPT_CUDA_LAUNCHED();
  });
}

}  // namespace mpigpt::cuda
