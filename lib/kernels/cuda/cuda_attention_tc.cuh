// CUDA backend, private: the bf16 tensor-core attention (mma.sync, tiles in registers), forward in
// cuda_attention_tc.cu and backward in cuda_attention_tc_bwd.cu, which cuda_attention.cu tries
// before its fp32-FMA kernels.
#pragma once

#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

// One forward problem, laid out as fma_attn::Problem: element d of query head h of token
// (b, i) is q[(b*Tq + i)*q_stride + h*HD + d]; key/value head kh of token (b, j) is at
// k/v[(b*Tk + j)*kv_stride + kh*HD]; out is (B,Tq,NH*HD), lse (B,NH,Tq) f32 (natural log; -inf
// and out 0 for a query that sees no key). The mask arrays (B,Tq) and (B,Tk) are used only when
// causal is false: query i sees key j when kseg[j] == qseg[i] and kpos[j] <= qpos[i].
struct AttentionTcForward {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;
  const int32_t* qpos;
  const int32_t* qseg;
  const int32_t* kpos;
  const int32_t* kseg;
  int64_t q_stride, kv_stride;
  int B, Tq, Tk, NH, NKV, HD;
  float scale_log2;  // log2(e)/sqrt(HD)
};

// The backward's extra inputs: dout (B,Tq,NH*HD), D = rowsum(dout * out) (B,NH,Tq) already
// computed, gradients dq (q's layout), dk and dv (k's layout), written (=) or added (+=, accumulate).
struct AttentionTcBackward {
  AttentionTcForward f;  // out is unused; lse as saved by the forward
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  const float* D;
  float scale;  // 1/sqrt(HD)
  bool accumulate;
};

// Launches the tensor-core backward and returns true, or returns false (launching nothing) under
// the forward's conditions (dout, dq, dk, dv 16-byte aligned as well): a dQ kernel per query tile
// and a dK/dV kernel per key tile.
bool attention_backward_tc(const AttentionTcBackward& p, DType dt, bool causal, cudaStream_t stream);

// Launches the tensor-core forward and returns true, or returns false (launching nothing) when it
// does not apply: dtype other than bf16, HD not 64 or 128, or pointers/strides not 16-byte aligned.
bool attention_forward_tc(const AttentionTcForward& p, DType dt, bool causal, cudaStream_t stream);

}  // namespace mpigpt::cuda
