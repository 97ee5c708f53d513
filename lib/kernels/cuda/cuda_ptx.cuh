// CUDA backend, private: the PTX instructions the kernels reach through inline assembly. The host
// emulator's header of the same name (tests/cuda_emulator) implements them from the PTX ISA instead.
#pragma once

#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda::ptx {

// ldmatrix .x4: four 8 x 8 bf16 matrices from shared memory; `row` is this lane's row address
// (matrix lane / 8, row lane % 8), 16-byte aligned; r[m] gets row g, columns 2t, 2t+1 of matrix m.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// ldmatrix .x4 .trans: r[m] gets rows 2t and 2t+1 of column g of matrix m.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// mma.sync m16n8k16: d (16 x 8, fp32) += A (16 x 16) B (16 x 8), bf16 operands (cuda_mma.cuh has
// the fragment layouts).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x as one MUFU.EX2 (ex2.approx.ftz): subnormal results flush to zero, far below what a softmax
// probability next to its row's largest (about 1) can add; exp2f wraps the same instruction in a
// range test and two multiplies that keep them. -inf gives 0, as the masks need.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace mpigpt::cuda::ptx
