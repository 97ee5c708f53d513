// The host emulator's stand-ins for the PTX warp instructions of lib/kernels/cuda/cuda_mma.cuh
// (docs/testing.md): `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16` and
// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`. Written from the PTX ISA's fragment
// tables, not from the kernels: for lane l, g = l / 4 and t = l % 4; a 32-bit register holds two
// 16-bit elements, the first in its low half.
//   ldmatrix: lanes 8m..8m+7 give the row addresses of matrix m (8 x 8 b16, each row 16 bytes,
//             16-byte aligned, in shared memory); lane l receives r[m] = matrix m's row g,
//             elements 2t and 2t+1, or with .trans its column g, rows 2t and 2t+1.
//   mma:      A 16 x 16: a[i] holds A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}]
//             B 16 x 8:  b[i] holds B[2t + 8i + {0, 1}][g]
//             C/D 16 x 8: d[i] is D[g + 8 (i >> 1)][2t + (i & 1)]
// Both are warp-collective (every lane publishes its operands at a warp barrier). The products of
// bf16 values are exact in fp32; they are summed in fp32 in k order onto C.
//
// And Hopper's `wgmma.mma_async.sync.aligned.m64nNk16.f32.bf16.bf16` (lib/kernels/cuda/cuda_wgmma.cuh),
// from the PTX ISA's wgmma fragments and CUTLASS's canonical shared-memory layouts (INTERLEAVE, no
// swizzling): warp w of the 4-warp group owns rows 16w..16w+15 of D (and of a register A, laid out
// as mma's A); d[4j + i] is D[16w + g + 8 (i >> 1)][8j + 2t + (i & 1)]. A descriptor holds the start
// address, LBO and SBO in 16-byte units (bits 0-13, 16-29, 32-45). Element (m or n, k) of a K-major
// operand is at start + (mn / 8) SBO + (k / 8) LBO + 16 (mn % 8) + 2 (k % 8); of an MN-major one
// (tnsp) at start + (mn / 8) SBO + (k / 8) LBO + 16 (k % 8) + 2 (mn % 8). The products run
// asynchronously, with their fences, commits and waits checked (emu::wgmma_issue, cuda_runtime.h).
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_bf16.h"
#include "cuda_runtime.h"

namespace emu::ptx {

inline void check_row_address(const void* p, int lane) {
  const auto a = reinterpret_cast<uintptr_t>(p), s = reinterpret_cast<uintptr_t>(emu::dyn_smem());
  if (a % 16 != 0 || a < s || a + 16 > s + emu::dyn_smem_bytes()) {
    fprintf(stderr, "cuda emulator: ldmatrix row address %p of lane %d is not a 16-byte aligned row of the block's "
            "dynamic shared memory [%p, +%zu)\n", p, lane, emu::dyn_smem(), emu::dyn_smem_bytes());
    abort();
  }
}

inline void ldmatrix(uint32_t* r, int nmat, bool trans, const void* row_address) {
  const void* rows[32];
  emu::warp_allgather(&row_address, rows, sizeof(const void*));
  for (int l = 0; l < 8 * nmat; ++l) check_row_address(rows[l], l);
  const int lane = emu::lane(), g = lane / 4, t = lane % 4;
  auto at = [&](int m, int row, int col) {  // element (row, col) of matrix m
    uint16_t v;
    std::memcpy(&v, static_cast<const char*>(rows[8 * m + row]) + 2 * col, 2);
    return uint32_t(v);
  };
  for (int m = 0; m < nmat; ++m)
    r[m] = trans ? at(m, 2 * t, g) | at(m, 2 * t + 1, g) << 16 : at(m, g, 2 * t) | at(m, g, 2 * t + 1) << 16;
}

inline float bf16_half(uint32_t reg, int half) {
  __nv_bfloat16 b;
  b.x = uint16_t(half ? reg >> 16 : reg & 0xffffu);
  return __bfloat162float(b);
}

inline void mma_m16n8k16_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  struct Lane {
    uint32_t a[4], b[2];
    float c[4];
  };
  Lane mine{{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}}, all[32];
  emu::warp_allgather(&mine, all, sizeof(Lane));
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i)
      for (int h = 0; h < 2; ++h) A[g + 8 * (i & 1)][2 * t + 8 * (i >> 1) + h] = bf16_half(all[l].a[i], h);
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) B[2 * t + 8 * i + h][g] = bf16_half(all[l].b[i], h);
    for (int i = 0; i < 4; ++i) C[g + 8 * (i >> 1)][2 * t + (i & 1)] = all[l].c[i];
  }
  const int lane = emu::lane(), g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float s = C[row][col];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    d[i] = s;
  }
}

// Element (mn, k) of a 16-bit operand described by desc, K-major or (mn_major) MN-major.
inline float wgmma_operand(uint64_t desc, int mn, int k, bool mn_major) {
  if ((desc >> 62) != 0 || ((desc >> 49) & 7) != 0) {
    fprintf(stderr, "cuda emulator: wgmma descriptor %#llx asks for swizzling or a base offset, which the "
            "emulator does not implement\n", (unsigned long long)desc);
    abort();
  }
  const size_t start = size_t(desc & 0x3FFF) << 4, lbo = size_t((desc >> 16) & 0x3FFF) << 4,
               sbo = size_t((desc >> 32) & 0x3FFF) << 4;
  const size_t at = start + size_t(mn / 8) * sbo + size_t(k / 8) * lbo +
                    (mn_major ? 16 * size_t(k % 8) + 2 * size_t(mn % 8) : 16 * size_t(mn % 8) + 2 * size_t(k % 8));
  if (at + 2 > emu::dyn_smem_bytes()) {
    fprintf(stderr, "cuda emulator: wgmma operand element (%d, %d) at shared byte %zu is past the block's %zu bytes "
            "of dynamic shared memory (descriptor %#llx)\n", mn, k, at, emu::dyn_smem_bytes(),
            (unsigned long long)desc);
    abort();
  }
  uint16_t v;
  std::memcpy(&v, static_cast<const char*>(emu::dyn_smem()) + at, 2);
  return bf16_half(v, 0);
}

// d (64 x N rows of this thread's warp, see above) = A B (+ d when accumulate): A from registers a
// (warp-collective: the warp's lanes publish their fragments when it is issued) or, when a is null,
// K-major from desc_a; B from desc_b, MN-major when tnsp_b. Asynchronous as on the GPU
// (emu::wgmma_issue): d reads NaN until the wgmma.wait_group that retires it.
inline void wgmma(float* d, int N, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool accumulate,
                  bool tnsp_b) {
  if (blockDim.x % 128 != 0) {
    fprintf(stderr, "cuda emulator: wgmma needs whole warpgroups of 128 threads, the block has %u\n", blockDim.x);
    abort();
  }
  const int lane = emu::lane(), g = lane / 4, t = lane % 4, w = int(threadIdx.x / 32) % 4;
  struct Regs {
    float A[16][16];
  } regs{};
  if (a) {
    uint32_t mine[4] = {a[0], a[1], a[2], a[3]}, all[32][4];
    emu::warp_allgather(mine, all, sizeof(mine));
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < 4; ++i)
        for (int h = 0; h < 2; ++h)
          regs.A[l / 4 + 8 * (i & 1)][2 * (l % 4) + 8 * (i >> 1) + h] = bf16_half(all[l][i], h);
  }
  const bool a_in_regs = a != nullptr;
  emu::wgmma_issue(d, N / 2, accumulate, [=](const float* base, float* out) {
    // This thread's two rows of A (g and g + 8 of its warp's 16) and its N/4 columns of B.
    float A[2][16], B[32][16];
    for (int h = 0; h < 2; ++h)
      for (int k = 0; k < 16; ++k)
        A[h][k] = a_in_regs ? regs.A[g + 8 * h][k] : wgmma_operand(desc_a, 16 * w + g + 8 * h, k, false);
    for (int c = 0; c < N / 4; ++c)
      for (int k = 0; k < 16; ++k) B[c][k] = wgmma_operand(desc_b, 8 * (c / 2) + 2 * t + c % 2, k, tnsp_b);
    for (int j = 0; j < N / 8; ++j)
      for (int i = 0; i < 4; ++i) {
        const int h = i >> 1, c = 2 * j + (i & 1);
        float s = base[4 * j + i];
        for (int k = 0; k < 16; ++k) s += A[h][k] * B[c][k];
        out[4 * j + i] = s;
      }
  });
}

}  // namespace emu::ptx
