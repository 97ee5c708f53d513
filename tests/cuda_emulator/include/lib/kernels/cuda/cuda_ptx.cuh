// The host emulator's lib/kernels/cuda/cuda_ptx.cuh: the PTX instructions the kernels use, written
// from the PTX ISA's fragment tables rather than from the kernels, so the two check each other.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lib/kernels/cuda/cuda_common.cuh"

// For lane l, g = l / 4 and t = l % 4; a 32-bit register holds two 16-bit elements, the first in its
// low half. ldmatrix: lanes 8m..8m+7 give the row addresses of matrix m (8 x 8 b16, 16-byte aligned
// rows of shared memory); lane l receives matrix m's row g, elements 2t and 2t+1, or with .trans its
// column g, rows 2t and 2t+1. mma: a[i] holds A[g + 8 (i & 1)][2t + 8 (i >> 1) + {0, 1}], b[i] holds
// B[2t + 8i + {0, 1}][g], d[i] is D[g + 8 (i >> 1)][2t + (i & 1)]. Both are warp-collective (every
// lane publishes its operands at a warp barrier); products of bf16 values are exact in fp32 and are
// summed in k order onto C.
namespace mpigpt::cuda::ptx {
namespace emulated {

inline void check_row_address(const void* p, int lane) {
  const auto a = reinterpret_cast<uintptr_t>(p), s = reinterpret_cast<uintptr_t>(emu::dyn_smem());
  if (a % 16 != 0 || a < s || a + 16 > s + emu::dyn_smem_bytes()) {
    fprintf(stderr, "cuda emulator: ldmatrix row address %p of lane %d is not a 16-byte aligned row of the block's "
            "dynamic shared memory [%p, +%zu)\n", p, lane, emu::dyn_smem(), emu::dyn_smem_bytes());
    abort();
  }
}

inline void ldmatrix(uint32_t (&r)[4], bool trans, const void* row_address) {
  const void* rows[32];
  emu::warp_allgather(&row_address, rows, sizeof(const void*));
  for (int l = 0; l < 32; ++l) check_row_address(rows[l], l);
  const int lane = emu::lane(), g = lane / 4, t = lane % 4;
  auto at = [&](int m, int row, int col) {  // element (row, col) of matrix m
    uint16_t v;
    std::memcpy(&v, static_cast<const char*>(rows[8 * m + row]) + 2 * col, 2);
    return uint32_t(v);
  };
  for (int m = 0; m < 4; ++m)
    r[m] = trans ? at(m, 2 * t, g) | at(m, 2 * t + 1, g) << 16 : at(m, g, 2 * t) | at(m, g, 2 * t + 1) << 16;
}

inline float bf16_half(uint32_t reg, int half) {
  __nv_bfloat16 b;
  b.x = uint16_t(half ? reg >> 16 : reg & 0xffffu);
  return __bfloat162float(b);
}

}  // namespace emulated

inline void ldsm_x4(uint32_t (&r)[4], const bf16* row) { emulated::ldmatrix(r, false, row); }
inline void ldsm_x4_t(uint32_t (&r)[4], const bf16* row) { emulated::ldmatrix(r, true, row); }

inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
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
      for (int h = 0; h < 2; ++h) A[g + 8 * (i & 1)][2 * t + 8 * (i >> 1) + h] = emulated::bf16_half(all[l].a[i], h);
    for (int i = 0; i < 2; ++i)
      for (int h = 0; h < 2; ++h) B[2 * t + 8 * i + h][g] = emulated::bf16_half(all[l].b[i], h);
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

// ex2.approx.ftz: results below 2^-126 flush to zero.
inline float exp2_ftz(float x) {
  const float y = exp2f(x);
  return y < 1.17549435e-38f ? 0.f : y;
}

}  // namespace mpigpt::cuda::ptx
