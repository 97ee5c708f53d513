// The kernel behind cuda_wgmma_check.h (sm_90a only, as every *_sm90a.cu file).
#include "lib/kernels/cuda/cuda_wgmma_check.h"

#include "lib/kernels/cuda/cuda_mma.cuh"
#include "lib/kernels/cuda/cuda_wgmma.cuh"

namespace mpigpt::cuda {

namespace {

__global__ void __launch_bounds__(128) wgmma_check_kernel(const bf16* a, const bf16* x, const bf16* y, float* d,
                                                          float* e, float* f) {
#if MPIGPT_WGMMA_CODE
  extern __shared__ __align__(128) unsigned char wgmma_check_smem[];
  bf16* As = reinterpret_cast<bf16*>(wgmma_check_smem);  // 64 x 32, canonical
  bf16* Xs = As + 64 * 32;                                 // 64 x 32
  bf16* Ys = Xs + 64 * 32;                                 // 64 x 64
  for (int i = threadIdx.x; i < 64 * 32; i += 128) {
    As[wg::cm_index<32>(i / 32, i % 32)] = a[i];
    Xs[wg::cm_index<32>(i / 32, i % 32)] = x[i];
  }
  for (int i = threadIdx.x; i < 64 * 64; i += 128) Ys[wg::cm_index<64>(i / 64, i % 64)] = y[i];
  wg::proxy_fence();
  __syncthreads();
  float acc[8][4] = {}, out[8][4] = {}, again[8][4] = {};
  uint32_t ar[2][4];  // A's rows of this warp in registers, for the RS form with a K-major B
  wg::load_a_regs<32, 2>(ar, As, 16 * (threadIdx.x >> 5));
  wg::fence();
  for (int k = 0; k < 2; ++k) wg::Wgmma<64>::ss<0>(acc, wg::desc_k<32>(As, k), wg::desc_k<32>(Xs, k), k > 0);
  for (int k = 0; k < 2; ++k) wg::Wgmma<64>::rs<0>(again, ar[k], wg::desc_k<32>(Xs, k), k > 0);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(acc);
  wg::fence_operands(again);
  uint32_t af[4][4];
  for (int k = 0; k < 4; ++k) mma::acc_to_a<8>(af[k], acc, k);
  wg::fence_operands(out);
  wg::fence();
  for (int k = 0; k < 4; ++k) wg::Wgmma<64>::rs<1>(out, af[k], wg::desc_mn<64>(Ys, k), k > 0);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(out);
  const int w = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int idx = (16 * w + g + 8 * (i >> 1)) * 64 + 8 * j + 2 * t + (i & 1);
      d[idx] = acc[j][i];
      e[idx] = out[j][i];
      f[idx] = again[j][i];
    }
#else
  __trap();
#endif
}

}  // namespace

void wgmma_primitives_check(const void* a, const void* x, const void* y, float* d, float* e, float* f) {
  const size_t bytes = (2 * 64 * 32 + 64 * 64) * sizeof(bf16);
  wgmma_check_kernel<<<1, 128, bytes>>>(static_cast<const bf16*>(a), static_cast<const bf16*>(x),
                                        static_cast<const bf16*>(y), d, e, f);
  MPIGPT_CUDA_LAUNCHED();
  MPIGPT_CUDA(cudaDeviceSynchronize());
}

}  // namespace mpigpt::cuda
