// CUDA backend, private: what the fp32-FMA fused attention's forward (cuda_attention_fwd.cu) and
// backward (cuda_attention_bwd.cu) share: the problem, the block layout, the shared-memory tiles and
// per-thread products, the launch helpers.
#pragma once
#include <cstdint>
#include <type_traits>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda::fma_attn {

// The tile kernels' layout: 128 threads = 16 row groups x 8 column lanes. The block owns 64 "rows"
// (queries in the forward and dQ kernels, keys in the dK/dV kernel) whose fp32 accumulators live in
// registers (4 rows x HD/8 columns per thread) and streams the other side through shared memory in
// tiles of 64 (forward) or 32 (backward) "columns", each thread computing a 4 x (tile/8) block of
// scores. Tiles sit in shared memory as fp32 rows of HD + 4 floats (the padding keeps the 128-bit
// reads of 8 consecutive rows on distinct banks), whatever the data dtype.
constexpr int kThreads = 128;     // 16 row groups (rg) x 8 column lanes (cg)
constexpr int kRows = 64;         // register-resident rows per block, 4 per thread
constexpr int kXLD = kRows + 4;   // row stride of the transposed score tiles in shared memory
constexpr int kFwdCols = 64;      // keys per tile in the forward
constexpr int kBwdCols = 32;      // columns per tile in the backward kernels (their shared memory is larger)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxHeadDim = 128;  // kernels for HD = 16, 32, 64, 80, 96, 128 (dispatch_head_dim)

// One attention problem. Element d of query head h of token (b, i) is q[(b*Tq + i)*q_stride +
// h*HD + d]; key/value head kh of token (b, j) is at k/v[(b*Tk + j)*kv_stride + kh*HD]; out and
// dout are (B,Tq,NH*HD); dq has q's layout, dk/dv k's.
struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;         // written by the forward, read by the backward
  float* lse;        // (B,NH,Tq), likewise
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* D;          // (B,NH,Tq) backward scratch: rowsum(dout * out)
  const int32_t* qpos;  // the explicit mask, (B,Tq) and (B,Tk); unused by the causal kernels
  const int32_t* qseg;
  const int32_t* kpos;
  const int32_t* kseg;
  int64_t q_stride, kv_stride;
  int B, Tq, Tk, NH, NKV, HD;
  float scale;       // 1/sqrt(HD)
  float scale_log2;  // log2(e)/sqrt(HD): scores in base 2, so the kernels use exp2
  bool vec;          // HD % 4 == 0 and every tensor aligned: 4-element vector loads, 2-element stores
  bool accumulate;   // backward: dq, dk, dv += (blockwise) instead of = (causal)
};

// ---- shared-memory tiles and the per-thread products ---------------------------------------

__device__ __forceinline__ float4 zero4() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ float4 vload4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 vload4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // bf16 -> f32 is the upper half of the bits
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// Elements [d, d+4) of a row of hd elements, zero past hd.
template <class T>
__device__ __forceinline__ float4 load_chunk(const T* row, int d, int hd, bool vec) {
  if (vec) return d < hd ? vload4(row + d) : zero4();
  float x[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = d + k < hd ? to_f(row[d + k]) : 0.f;
  return make_float4(x[0], x[1], x[2], x[3]);
}

// dst [ROWS][HDP+4] (fp32, shared) = rows [row0, row0 + ROWS) of the strided matrix src; rows at
// or past `end` and columns past hd are zero, so masked or padded entries are finite and add 0.
template <int HDP, int ROWS, class T>
__device__ __forceinline__ void load_tile(float* dst, const T* src, int64_t stride, int row0, int end, int hd,
                                          bool vec) {
  constexpr int kChunks = HDP / 4, LD = HDP + 4;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kThreads) {
    const int r = idx / kChunks, d = (idx - r * kChunks) * 4, row = row0 + r;
    const float4 x = row < end ? load_chunk(src + int64_t(row) * stride, d, hd, vec) : zero4();
    *reinterpret_cast<float4*>(dst + r * LD + d) = x;
  }
}

// acc[r][c] = A[rg*4 + r] . B[cg + 8c] over HDP columns of two shared tiles. Within a quarter warp
// (the unit of a 128-bit shared load) rg is fixed, so A's reads are broadcasts and B's 8 rows are
// (HDP+4)/4 (odd) 16-byte slots apart: no bank conflicts.
template <int HDP, int NC>
__device__ __forceinline__ void tile_dot(float (&acc)[4][NC], const float* A, const float* B, int rg, int cg) {
  constexpr int LD = HDP + 4;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
  const float* a = A + rg * 4 * LD;
  const float* b = B + cg * LD;
#pragma unroll 2
  for (int d = 0; d < HDP; d += 4) {
    float4 x[4], y[NC];
#pragma unroll
    for (int r = 0; r < 4; ++r) x[r] = *reinterpret_cast<const float4*>(a + r * LD + d);
#pragma unroll
    for (int c = 0; c < NC; ++c) y[c] = *reinterpret_cast<const float4*>(b + c * 8 * LD + d);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float s = acc[r][c];
        s = fmaf(x[r].x, y[c].x, s);
        s = fmaf(x[r].y, y[c].y, s);
        s = fmaf(x[r].z, y[c].z, s);
        s = fmaf(x[r].w, y[c].w, s);
        acc[r][c] = s;
      }
  }
}

// X[cg + 8c][rg*4 + r] = v[r][c]: the thread's scores transposed, so that a thread later reads the
// values of its four rows for one column as one float4.
template <int NC>
__device__ __forceinline__ void store_transposed(float* X, const float (&v)[4][NC], int rg, int cg) {
#pragma unroll
  for (int c = 0; c < NC; ++c)
    *reinterpret_cast<float4*>(X + (cg + 8 * c) * kXLD + rg * 4) = make_float4(v[0][c], v[1][c], v[2][c], v[3][c]);
}

// acc[r][2m + t] += sum_{x < N} X[x][rg*4 + r] * M[x][cg*2 + 16m + t]: the (rows x N) tile held
// transposed in X times the (N x HDP) shared tile M.
template <int HDP, int N>
__device__ __forceinline__ void tile_accum(float (&acc)[4][HDP / 8], const float* X, const float* M, int rg, int cg) {
  constexpr int LD = HDP + 4;
#pragma unroll 4
  for (int x = 0; x < N; ++x) {
    const float4 p = *reinterpret_cast<const float4*>(X + x * kXLD + rg * 4);
    const float* mrow = M + x * LD + cg * 2;
#pragma unroll
    for (int m = 0; m < HDP / 16; ++m) {
      const float2 v = *reinterpret_cast<const float2*>(mrow + 16 * m);
      acc[0][2 * m] = fmaf(p.x, v.x, acc[0][2 * m]);
      acc[0][2 * m + 1] = fmaf(p.x, v.y, acc[0][2 * m + 1]);
      acc[1][2 * m] = fmaf(p.y, v.x, acc[1][2 * m]);
      acc[1][2 * m + 1] = fmaf(p.y, v.y, acc[1][2 * m + 1]);
      acc[2][2 * m] = fmaf(p.z, v.x, acc[2][2 * m]);
      acc[2][2 * m + 1] = fmaf(p.z, v.y, acc[2][2 * m + 1]);
      acc[3][2 * m] = fmaf(p.w, v.x, acc[3][2 * m]);
      acc[3][2 * m + 1] = fmaf(p.w, v.y, acc[3][2 * m + 1]);
    }
  }
}

__device__ __forceinline__ void store_pair(float* p, float a, float b, bool acc) {
  float2* q = reinterpret_cast<float2*>(p);
  if (acc) {
    const float2 old = *q;
    a += old.x;
    b += old.y;
  }
  *q = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(bf16* p, float a, float b, bool acc) {
  __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p);
  if (acc) {
    const float2 old = __bfloat1622float2(*q);
    a += old.x;
    b += old.y;
  }
  *q = __floats2bfloat162_rn(a, b);
}

// row[cg*2 + 16m + t] (=, or += when acc) s * v[2m + t] for the columns below hd: one thread's
// share of an output row.
template <int HDP, class T>
__device__ __forceinline__ void store_row(T* row, const float (&v)[HDP / 8], float s, int cg, int hd, bool vec,
                                          bool acc) {
#pragma unroll
  for (int m = 0; m < HDP / 16; ++m) {
    const int e = cg * 2 + 16 * m;
    const float a = v[2 * m] * s, b = v[2 * m + 1] * s;
    if (vec) {  // hd % 4 == 0 and e even: both or neither of e, e+1 are below hd
      if (e < hd) store_pair(row + e, a, b, acc);
    } else {
      if (e < hd) row[e] = from_f<T>(acc ? to_f(row[e]) + a : a);
      if (e + 1 < hd) row[e + 1] = from_f<T>(acc ? to_f(row[e + 1]) + b : b);
    }
  }
}

__device__ __forceinline__ float max8(float x) {  // over the 8 column lanes of a row group
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
}
__device__ __forceinline__ float sum8(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 4);
}

// The key tile [j0, j0 + 8*NC) against the thread's 4 query rows: bit r*NC + c is set when row
// i0 + rg*4 + r (row_ok[r]) sees key j0 + cg + 8c. The blockwise mask stages the tile's key
// positions and document ids in shared memory (the caller's barrier orders their previous use).
template <bool kCausal, int NC>
__device__ __forceinline__ uint32_t visible_keys(const Problem& p, int b, int i0, int j0, int rg, int cg,
                                                 const bool (&row_ok)[4], const int (&qpos)[4], const int (&qseg)[4],
                                                 int* kpos_s, int* kseg_s) {
  uint32_t vis = 0;
  if constexpr (kCausal) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int i = i0 + rg * 4 + r, j = j0 + cg + 8 * c;
        if (row_ok[r] && j <= i && j < p.Tk) vis |= 1u << (r * NC + c);
      }
  } else {
    if (threadIdx.x < 8 * NC) {
      const int j = j0 + threadIdx.x;
      kpos_s[threadIdx.x] = j < p.Tk ? p.kpos[int64_t(b) * p.Tk + j] : 0;
      kseg_s[threadIdx.x] = j < p.Tk ? p.kseg[int64_t(b) * p.Tk + j] : 0;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int x = cg + 8 * c;
        if (row_ok[r] && j0 + x < p.Tk && kseg_s[x] == qseg[r] && kpos_s[x] <= qpos[r]) vis |= 1u << (r * NC + c);
      }
  }
  return vis;
}

template <int HDP>
constexpr size_t fwd_smem() {  // Q tile, K-then-V tile, P^T, key positions and ids
  return size_t(kRows + kFwdCols) * (HDP + 4) * 4 + size_t(kFwdCols) * kXLD * 4 + 2 * kFwdCols * 4;
}
template <int HDP>
constexpr size_t dq_smem() {  // Q and dO tiles, V-then-K tile, dS^T, key positions and ids
  return size_t(2 * kRows + kBwdCols) * (HDP + 4) * 4 + size_t(kBwdCols) * kXLD * 4 + 2 * kBwdCols * 4;
}
template <int HDP>
constexpr size_t dkdv_smem() {  // K, V, Q, dO tiles, P^T-then-dS^T, query lse, D, positions, ids
  return size_t(2 * kRows + 2 * kBwdCols) * (HDP + 4) * 4 + size_t(kBwdCols) * kXLD * 4 + 4 * kBwdCols * 4;
}

// ---- launchers --------------------------------------------------------------------------------

inline unsigned tiles(int n, int per) { return unsigned((n + per - 1) / per); }

template <class Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, const Problem& p) {
  // Above 48 KiB a kernel must opt in to its dynamic shared memory (per device, so on every call).
  MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

// Runs body(std::integral_constant<int, HDP>) for the kernels' head dim that holds p.HD. Any HD
// <= 128 that is not one of them runs in the next larger one with zero-padded columns: the padding
// adds nothing to the dot products, and its output columns are not stored.
template <class F>
void dispatch_head_dim(int HD, F&& body) {
  switch (HD <= 16 ? 16 : HD <= 32 ? 32 : HD <= 64 ? 64 : HD <= 80 ? 80 : HD <= 96 ? 96 : 128) {
    case 16: body(std::integral_constant<int, 16>{}); break;
    case 32: body(std::integral_constant<int, 32>{}); break;
    case 64: body(std::integral_constant<int, 64>{}); break;
    case 80: body(std::integral_constant<int, 80>{}); break;
    case 96: body(std::integral_constant<int, 96>{}); break;
    default: body(std::integral_constant<int, 128>{}); break;
  }
}

// The scalar kernels. forward: out and lse. rowdot: p.D (B*NH*Tq floats of scratch) =
// rowsum(dout * out), which every backward needs first. backward: the dQ and the dK/dV kernels.
void forward(const Problem& p, DType dt, bool causal, cudaStream_t stream);
void rowdot(const Problem& p, DType dt, cudaStream_t stream);
void backward(const Problem& p, DType dt, bool causal, cudaStream_t stream);

}  // namespace mpigpt::cuda::fma_attn
