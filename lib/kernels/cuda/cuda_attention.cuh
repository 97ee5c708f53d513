// CUDA backend, private: the fused attention kernels on checked arguments (cuda_attention.cu), shared
// by the causal ops (cuda_attention_causal.cu) and the blockwise ones (cuda_attention_block.cu).
#pragma once

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

// The builtin kernels. kv undefined: causal self-attention (keys and values from qkv, dqkv
// overwritten); kv given: keys and values from kv under the explicit (position, document) mask, and
// dqkv's query columns and dkv accumulate. The tensor-core (mma.sync) kernels where they apply, the
// fp32-FMA ones elsewhere.
void fused_attention_forward(CudaOps& ops, DType dt, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos,
                             Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD);
void fused_attention_backward(CudaOps& ops, DType dt, Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                              Tensor out, Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                              int NKV, int HD);

}  // namespace mpigpt::cuda
