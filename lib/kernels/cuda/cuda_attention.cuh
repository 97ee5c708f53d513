// CUDA backend, private: the fused attention kernels on checked arguments (cuda_attention.cu), shared
// by the causal ops (cuda_attention_causal.cu) and the blockwise ones (cuda_attention_block.cu).
#pragma once

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

// The builtin kernels. kv undefined: causal self-attention (keys and values from qkv, dqkv
// overwritten); kv given: keys and values from kv under the explicit (position, document) mask, and
// dqkv's query columns and dkv accumulate. The tensor-core (mma.sync) kernels where they apply, the
// fp32-FMA ones elsewhere.
// Both are FlashAttention-2 style: query and key tiles pass through shared memory, the softmax is
// computed online in fp32 and the T x T matrix never exists; the forward saves only the log-sum-exp
// (B,NH,T), from which the backward recomputes P. The causal kernels mask j > i and skip the key
// tiles past a query tile (and the query tiles before a key tile); the masked ones take per-token
// positions and document ids and skip a tile with no visible pair after a block-wide vote. Packed
// variable-length sequences (the cu_seqlens of other libraries) are this mask with one document id
// per packed sequence.
void fused_attention_forward(CudaOps& ops, DType dt, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos,
                             Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD);
void fused_attention_backward(CudaOps& ops, DType dt, Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                              Tensor out, Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                              int NKV, int HD);

}  // namespace mpigpt::cuda
