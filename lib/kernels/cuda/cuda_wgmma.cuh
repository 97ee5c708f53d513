// CUDA backend, private: Hopper's warpgroup matrix products (PTX `wgmma.mma_async`, sm_90a) for
// kernels whose 128-thread blocks are one warpgroup (the attention backward of
// cuda_attention_wg_bwd_sm90a.cu). One instruction computes D (64 x N, fp32) = A (64 x 16) B (16 x
// N) + D for the whole warpgroup, reading B (and A, in the SS form) straight from shared memory
// through a matrix descriptor: no ldmatrix, and a product per instruction eight times as large as
// mma.sync's.
//
// Register layouts (PTX ISA, "wgmma register fragments"; the same per warp as mma.sync m16n8k16's,
// cuda_mma.cuh): warp w of the warpgroup owns rows 16w..16w+15 of D and of a register A. For lane l,
// g = l / 4, t = l % 4:
//   D (64 x N): d[j][i] = D[16w + g + 8 (i >> 1)][8j + 2t + (i & 1)], j < N/8;
//   A in registers (64 x 16): a[i] holds A[16w + g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}].
//
// Shared-memory operands, "canonical" layout without swizzling (INTERLEAVE): a tile of R rows and
// COLS bf16 columns is stored as 8 x 8 core matrices of 128 contiguous bytes (core row r % 8 at
// byte 16 (r % 8), its 8 columns contiguous); the cores of one group of 8 rows follow each other
// (column group c / 8 at byte 128 (c / 8)), and the row groups follow those (16 COLS bytes each):
// cm_index below. The same tile is read two ways:
//   K-major  (its rows are the product's M or N, its columns the contraction K): leading byte
//            offset (LBO, between cores along K) 128, stride byte offset (SBO, between row groups)
//            16 COLS; k-step s starts 2 cores (256 bytes) further;
//   MN-major (its rows are the contraction K, its columns N; instruction flag tnspB = 1): LBO (now
//            between row groups, along K) 16 COLS, SBO (between cores along N) 128; k-step s
//            starts 2 row groups (32 COLS bytes) further.
// These are CUTLASS's canonical GMMA layouts for INTERLEAVE (descriptor fields: start address,
// LBO and SBO in 16-byte units in bits 0-13, 16-29 and 32-45; swizzle mode 0 in bits 62-63).
//
// Ordering: wgmma runs asynchronously. Before the first product of a batch, fence() (registers
// written by ordinary instructions, accumulators included, become visible to it); after issuing,
// commit(), then wait<0>() before any ordinary instruction touches the accumulators or the
// shared memory is overwritten. Shared memory written through the generic proxy (st.shared,
// cp.async) must be followed by proxy_fence() in the writing threads before the barrier that
// publishes it to the products.
//
// Compiled as C++ by the host emulator (docs/testing.md), the products come from its mma_ptx.h,
// which decodes the descriptors and layouts above independently of the kernels and runs the
// products asynchronously, checking the ordering rules above (cuda_runtime.h, wgmma_issue).
#pragma once

#include <cuda_pipeline_primitives.h>

#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"

#ifndef __CUDACC__
#include "mma_ptx.h"
#endif

// 1 where a kernel may use wgmma: the sm_90a device pass (and the host emulator, and nvcc's host
// pass, which compiles no kernel bodies into device code). The *_sm90a.cu kernels put their bodies
// under `#if MPIGPT_WGMMA_CODE` and trap otherwise.
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MPIGPT_WGMMA_CODE 1
#else
#define MPIGPT_WGMMA_CODE 0
#endif

namespace mpigpt::cuda::wg {

// The element index of (row r, column c) in a canonical tile of COLS columns.
template <int COLS>
__device__ __forceinline__ int cm_index(int r, int c) {
  return (r >> 3) * (8 * COLS) + (c >> 3) * 64 + (r & 7) * 8 + (c & 7);
}

// The 18-bit shared-memory address of p (the descriptor's address space).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
#ifdef __CUDACC__
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  return uint32_t(static_cast<const char*>(p) - static_cast<const char*>(emu::dyn_smem()));
#endif
}

// A descriptor of the canonical layout at start (16-byte aligned), no swizzling.
__device__ __forceinline__ uint64_t desc(const void* start, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_addr(start) >> 4) & 0x3FFFu) | uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16 |
         uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32;
}
// K-step s (columns 16s..16s+15) of a tile of COLS columns read K-major.
template <int COLS>
__device__ __forceinline__ uint64_t desc_k(const bf16* tile, int s) {
  return desc(tile + s * 128, 128, 16 * COLS);
}
// K-step s (rows 16s..16s+15) of a tile of COLS columns read MN-major.
template <int COLS>
__device__ __forceinline__ uint64_t desc_mn(const bf16* tile, int s) {
  return desc(tile + s * 16 * COLS, 16 * COLS, 128);
}

__device__ __forceinline__ void fence() {
#ifdef __CUDACC__
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
  emu::wgmma_fence();
#endif
}
__device__ __forceinline__ void commit() {
#ifdef __CUDACC__
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  emu::wgmma_commit();
#endif
}
template <int N>
__device__ __forceinline__ void wait() {
#ifdef __CUDACC__
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#else
  emu::wgmma_wait(N);
#endif
}
__device__ __forceinline__ void proxy_fence() {
#ifdef __CUDACC__
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#else
  emu::proxy_fence_async();
#endif
}
// Keeps the compiler from moving accesses of an accumulator across the asynchronous products.
template <int NT>
__device__ __forceinline__ void fence_operands(float (&d)[NT][4]) {
#ifdef __CUDACC__
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
#endif
}

// dst (canonical tile of ROWS x COLS) = rows [row0, row0 + ROWS) of the strided bf16 matrix src
// (COLS columns; rows at or past end are zero), by the THREADS threads of the block: asynchronous
// 16-byte copies into the current batch (src and stride 16-byte aligned). Eight consecutive threads
// fill one core matrix (128 contiguous bytes), so the stores do not conflict.
template <int COLS, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  constexpr int kChunks = COLS / 8;
  static_assert(ROWS % 8 == 0, "whole row groups");
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
    const int r8 = idx & 7, rest = idx >> 3, c = (rest % kChunks) * 8, r = (rest / kChunks) * 8 + r8;
    const int row = row0 + r;
    bf16* d = dst + cm_index<COLS>(r, c);
    if (row < end)
      __pipeline_memcpy_async(d, src + int64_t(row) * stride + c, 16);
    else
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The A operands (the register layout above) of k-steps 0..KS-1 for this thread's warp's 16 rows,
// starting at row0, of a canonical tile of COLS columns: for products whose A does not change
// from one tile to the next, so that they read only B from shared memory.
template <int COLS, int KS>
__device__ __forceinline__ void load_a_regs(uint32_t (&a)[KS][4], const bf16* tile, int row0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
  for (int s = 0; s < KS; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[s][i] = *reinterpret_cast<const uint32_t*>(tile + cm_index<COLS>(row0 + g + 8 * (i & 1),
                                                                           16 * s + 2 * t + 8 * (i >> 1)));
}

// Waits for all of this thread's committed copies and publishes them to every thread's products
// (fenced for wgmma's proxy before the block barrier); the barrier also tells every thread that
// the products each warp retired before it have finished reading their tiles.
__device__ __forceinline__ void tile_landed() {
  __pipeline_wait_prior(0);
  proxy_fence();
  __syncthreads();
}

// Wgmma<N>::ss<kTransB>(d, da, db, accumulate): d (64 x N) = A B (+ d when accumulate), A K-major
// from descriptor da, B from db (K-major, or MN-major with kTransB = 1). rs: A from registers.
template <int N>
struct Wgmma;

#ifdef __CUDACC__

#define MPIGPT_WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define MPIGPT_WG_D16 MPIGPT_WG_D4(0), MPIGPT_WG_D4(1), MPIGPT_WG_D4(2), MPIGPT_WG_D4(3)
#define MPIGPT_WG_D32 \
  MPIGPT_WG_D4(0), MPIGPT_WG_D4(1), MPIGPT_WG_D4(2), MPIGPT_WG_D4(3), MPIGPT_WG_D4(4), MPIGPT_WG_D4(5), \
      MPIGPT_WG_D4(6), MPIGPT_WG_D4(7)
#define MPIGPT_WG_D64                                                                                      \
  MPIGPT_WG_D4(0), MPIGPT_WG_D4(1), MPIGPT_WG_D4(2), MPIGPT_WG_D4(3), MPIGPT_WG_D4(4), MPIGPT_WG_D4(5),   \
      MPIGPT_WG_D4(6), MPIGPT_WG_D4(7), MPIGPT_WG_D4(8), MPIGPT_WG_D4(9), MPIGPT_WG_D4(10), MPIGPT_WG_D4(11), \
      MPIGPT_WG_D4(12), MPIGPT_WG_D4(13), MPIGPT_WG_D4(14), MPIGPT_WG_D4(15)

template <>
struct Wgmma<32> {
  template <int kTransB>
  __device__ __forceinline__ static void ss(float (&d)[4][4], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
        ", %16, %17, p, 1, 1, 0, %19;\n}\n"
        : MPIGPT_WG_D16
        : "l"(da), "l"(db), "r"(accumulate), "n"(kTransB));
  }
  template <int kTransB>
  __device__ __forceinline__ static void rs(float (&d)[4][4], const uint32_t (&a)[4], uint64_t db,
                                            int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
        ", {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : MPIGPT_WG_D16
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB));
  }
};

template <>
struct Wgmma<64> {
  template <int kTransB>
  __device__ __forceinline__ static void ss(float (&d)[8][4], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
        ", %32, %33, p, 1, 1, 0, %35;\n}\n"
        : MPIGPT_WG_D32
        : "l"(da), "l"(db), "r"(accumulate), "n"(kTransB));
  }
  template <int kTransB>
  __device__ __forceinline__ static void rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db,
                                            int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : MPIGPT_WG_D32
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB));
  }
};

template <>
struct Wgmma<128> {
  template <int kTransB>
  __device__ __forceinline__ static void ss(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63}"
        ", %64, %65, p, 1, 1, 0, %67;\n}\n"
        : MPIGPT_WG_D64
        : "l"(da), "l"(db), "r"(accumulate), "n"(kTransB));
  }
  template <int kTransB>
  __device__ __forceinline__ static void rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db,
                                            int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63}"
        ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : MPIGPT_WG_D64
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(kTransB));
  }
};

#undef MPIGPT_WG_D4
#undef MPIGPT_WG_D16
#undef MPIGPT_WG_D32
#undef MPIGPT_WG_D64

#else  // the host emulator

template <int N>
struct Wgmma {
  template <int kTransB>
  static void ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
    emu::ptx::wgmma(&d[0][0], N, nullptr, da, db, accumulate != 0, kTransB != 0);
  }
  template <int kTransB>
  static void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, int accumulate) {
    emu::ptx::wgmma(&d[0][0], N, a, 0, db, accumulate != 0, kTransB != 0);
  }
};

#endif

}  // namespace mpigpt::cuda::wg
