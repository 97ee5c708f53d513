// The warpgroup products of cuda_wgmma.cuh (wgmma with both operands from shared memory, K-major,
// and with A from registers and B MN-major, the canonical tile layout and its descriptors) on one
// small problem, for a GPU test that compares them with exact products: a mismatch between the
// documented layouts and the hardware shows up there by name, rather than as a wrong attention
// backward. Plain C++ (the test binary is not compiled by nvcc).
#pragma once

namespace mpigpt::cuda {

// Whether this device runs the sm_90a kernels (cuda_attention_wg_bwd_sm90a.cu).
bool attention_wgmma_available();

// One warpgroup computes d = A X^T (64 x 64, K = 32: both operands K-major from shared memory),
// e = bf16(d) Y (64 x 64, K = 64: A from the accumulator's registers, Y read MN-major) and f = A X^T
// again with A's rows loaded into registers from its shared tile (load_a_regs) and X K-major: a, x
// (64 x 32) and y (64 x 64) row-major bf16, d, e and f row-major f32 device pointers. Runs on the
// default stream and waits for it; the caller finishes its own streams' writes of the inputs first.
void wgmma_primitives_check(const void* a, const void* x, const void* y, float* d, float* e, float* f);

}  // namespace mpigpt::cuda
