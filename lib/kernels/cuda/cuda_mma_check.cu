// The kernel behind cuda_mma_check.h.
#include "lib/kernels/cuda/cuda_mma_check.h"

#include "lib/kernels/cuda/cuda_mma.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kLd = 24;  // 16 columns and 8 of padding: 48-byte rows, 16-byte aligned

__global__ void mma_check_kernel(const bf16* a, const bf16* b, const bf16* c, float* d, float* e, bool b_transposed) {
  extern __shared__ __align__(128) unsigned char mma_check_smem[];
  bf16* As = reinterpret_cast<bf16*>(mma_check_smem);
  bf16* Bs = As + 16 * kLd;
  bf16* Cs = Bs + 16 * kLd;
  for (int x = threadIdx.x; x < 256; x += 32) {
    As[(x / 16) * kLd + x % 16] = a[x];
    Bs[(x / 16) * kLd + x % 16] = b[x];
    Cs[(x / 16) * kLd + x % 16] = c[x];
  }
  __syncwarp();
  float acc[2][4] = {};
  uint32_t af[4], bf[4];
  mma::load_a<kLd>(af, As, 0);
  if (b_transposed)
    mma::load_b_nk<kLd>(bf, Bs, 0, 0);
  else
    mma::load_b_kn<kLd>(bf, Bs, 0, 0);
  mma::mma_bf16(acc[0], af, bf[0], bf[1]);
  mma::mma_bf16(acc[1], af, bf[2], bf[3]);
  float out[2][4] = {};
  mma::warp_acc_times<2, 2, kLd>(out, acc, Cs);
  const int g = threadIdx.x >> 2, t = threadIdx.x & 3;
  for (int nt = 0; nt < 2; ++nt)
    for (int i = 0; i < 4; ++i) {
      const int idx = (g + 8 * (i >> 1)) * 16 + nt * 8 + 2 * t + (i & 1);
      d[idx] = acc[nt][i];
      e[idx] = out[nt][i];
    }
}

}  // namespace

void mma_primitives_check(const void* a, const void* b, const void* c, float* d, float* e, bool b_transposed) {
  mma_check_kernel<<<1, 32, 3 * 16 * kLd * sizeof(bf16)>>>(static_cast<const bf16*>(a), static_cast<const bf16*>(b),
                                                          static_cast<const bf16*>(c), d, e, b_transposed);
  MPIGPT_CUDA_LAUNCHED();
  MPIGPT_CUDA(cudaDeviceSynchronize());
}

}  // namespace mpigpt::cuda
