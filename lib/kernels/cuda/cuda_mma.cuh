// CUDA backend, private: warp-level tensor-core primitives with a documented register layout (PTX
// `mma.sync.m16n8k16` for bf16 with fp32 accumulators, and `ldmatrix`), for kernels that keep their
// tiles in registers (the attention of cuda_attention_tc*.cu).
#pragma once

#include <cstdint>
#include <cstring>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_ptx.cuh"

namespace mpigpt::cuda::mma {

// nvcuda::wmma cannot serve these kernels: its fragment layout is opaque, so every element-wise step
// between two products went through shared memory. The layouts (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), for lane l of a warp with g = l / 4 and t = l % 4; a
// register holds two bf16, the lower-indexed column in its low 16 bits:
//   A (16 x 16, row-major), four registers: a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                                          a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8), two registers:  b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8 fp32), four floats: c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]
// The instructions themselves are in cuda_ptx.cuh.

// (lo, hi) rounded to bf16 in one register, lo in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}

using ptx::ldsm_x4;
using ptx::ldsm_x4_t;
using ptx::mma_bf16;

// ---- warp tiles built on them --------------------------------------------------------------------
// A warp tile is 16 rows; shared-memory tiles are bf16, row-major with leading dimension LD
// (elements; LD * 2 a multiple of 16 bytes). An accumulator tile of 16 x 8*NT is float acc[NT][4].
// A warp may own MT such m-tiles (float acc[MT][NT][4]): the products below load each B fragment
// once for all of them, half the shared-memory reads per product at MT = 2 (FlashAttention-2's
// forward gives each warp 32 rows). The single-tile forms are their MT = 1 case.

// A single tile seen as the one m-tile of an MT = 1 array (the same layout).
template <class T, int N, int M>
using OneTile = T[1][N][M];
template <class T, int N, int M>
__device__ __forceinline__ OneTile<T, N, M>& one_tile(T (&x)[N][M]) {
  return reinterpret_cast<OneTile<T, N, M>&>(x);
}

// The A fragment of k-step kk (columns 16kk..16kk+15) of the 16 rows starting at `rows`.
template <int LD>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* rows, int kk) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4(a, rows + (r + 8 * (m & 1)) * LD + kk * 16 + 8 * (m >> 1));
}

// B fragments of B = X^T for the two n-tiles n0..n0+7 (b[0], b[1]) and n0+8..n0+15 (b[2], b[3]),
// k-step kk, where X is stored with n as its row: B[k][n] = X[n][k].
template <int LD>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* X, int n0, int kk) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4(b, X + (n0 + r + 8 * (m >> 1)) * LD + kk * 16 + 8 * (m & 1));
}

// The same for B stored with k as its row: B[k][n] = X[k][n].
template <int LD>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* X, int n0, int kk) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  ldsm_x4_t(b, X + (kk * 16 + r + 8 * (m & 1)) * LD + n0 + 8 * (m >> 1));
}

// The two n-tiles of a load_b_nk / load_b_kn fragment pair (b[0..1], b[2..3]) into acc0, acc1.
__device__ __forceinline__ void mma_pair(float (&acc0)[4], float (&acc1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  mma_bf16(acc0, a, b[0], b[1]);
  mma_bf16(acc1, a, b[2], b[3]);
}

// acc[mt] (16 x 8NT) += A_mt X^T: A_mt the 16 rows of 16KS columns at rows + 16 mt LD (the warp's
// m-tiles, consecutive), X (8NT rows of 16KS columns) at X, both in shared memory with leading
// dimension LD.
template <int MT, int KS, int NT, int LD>
__device__ __forceinline__ void warp_abt_m(float (&acc)[MT][NT][4], const bf16* rows, const bf16* X) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a<LD>(a[mt], rows + mt * 16 * LD, kk);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      load_b_nk<LD>(b, X, np * 16, kk);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_pair(acc[mt][2 * np], acc[mt][2 * np + 1], a[mt], b);
    }
  }
}
template <int KS, int NT, int LD>
__device__ __forceinline__ void warp_abt(float (&acc)[NT][4], const bf16* rows, const bf16* X) {
  warp_abt_m<1, KS, NT, LD>(one_tile(acc), rows, X);
}

// The A fragments of all KS k-steps of the 16 rows at `rows`, for products that reuse them.
template <int KS, int LD>
__device__ __forceinline__ void load_a_all(uint32_t (&a)[KS][4], const bf16* rows) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) load_a<LD>(a[kk], rows, kk);
}

// warp_abt_m with A already in registers (load_a_all per m-tile): only X is read from shared
// memory.
template <int MT, int KS, int NT, int LD>
__device__ __forceinline__ void warp_abt_m(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KS][4], const bf16* X) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      load_b_nk<LD>(b, X, np * 16, kk);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_pair(acc[mt][2 * np], acc[mt][2 * np + 1], a[mt][kk], b);
    }
  }
}
template <int KS, int NT, int LD>
__device__ __forceinline__ void warp_abt(float (&acc)[NT][4], const uint32_t (&a)[KS][4], const bf16* X) {
  warp_abt_m<1, KS, NT, LD>(one_tile(acc), one_tile(a), X);
}

// The A fragment of k-step s from an accumulator tile (its columns 16s..16s+15), rounded to bf16:
// an accumulator's registers are exactly an A operand's, two n-tiles side by side.
template <int NT>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&acc)[NT][4], int s) {
  a[0] = pack_bf16(acc[2 * s][0], acc[2 * s][1]);
  a[1] = pack_bf16(acc[2 * s][2], acc[2 * s][3]);
  a[2] = pack_bf16(acc[2 * s + 1][0], acc[2 * s + 1][1]);
  a[3] = pack_bf16(acc[2 * s + 1][2], acc[2 * s + 1][3]);
}

// out[mt] (16 x 8DT) += P_mt Y: P_mt the accumulator tile p[mt] (16 x 8NP, rounded to bf16 here),
// Y (8NP rows of 8DT columns) in shared memory with leading dimension LD.
template <int MT, int NP, int DT, int LD>
__device__ __forceinline__ void warp_acc_times_m(float (&out)[MT][DT][4], const float (&p)[MT][NP][4],
                                                 const bf16* Y) {
  static_assert(NP % 2 == 0 && DT % 2 == 0, "tiles come in pairs");
#pragma unroll
  for (int s = 0; s < NP / 2; ++s) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc_to_a<NP>(a[mt], p[mt], s);
#pragma unroll
    for (int dp = 0; dp < DT / 2; ++dp) {
      uint32_t b[4];
      load_b_kn<LD>(b, Y, dp * 16, s);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma_pair(out[mt][2 * dp], out[mt][2 * dp + 1], a[mt], b);
    }
  }
}
template <int NP, int DT, int LD>
__device__ __forceinline__ void warp_acc_times(float (&out)[DT][4], const float (&p)[NP][4], const bf16* Y) {
  warp_acc_times_m<1, NP, DT, LD>(one_tile(out), one_tile(p), Y);
}

}  // namespace mpigpt::cuda::mma
