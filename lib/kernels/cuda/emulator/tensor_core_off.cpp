// The host emulator of the CUDA backend (docs/testing.md) does not emulate the tensor-core (wmma)
// attention of cuda_attention_tc.cu: its entry points decline, so bf16 attention runs the fp32-FMA
// kernels, as it does on the GPU under MPIGPT_ATTENTION_FMA=1.
#include "lib/kernels/cuda/cuda_attention_tc.cuh"

namespace mpigpt::cuda {

bool attention_forward_tc(const AttentionTcForward&, DType, bool, cudaStream_t) { return false; }
bool attention_backward_tc(const AttentionTcBackward&, DType, bool, cudaStream_t) { return false; }

}  // namespace mpigpt::cuda
