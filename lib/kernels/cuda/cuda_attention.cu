// CUDA backend: the builtin fused attention's entry points (cuda_attention.cuh): the bf16 tensor-core
// kernels where they apply (cuda_attention_tc*.cu), the fp32-FMA ones elsewhere (cuda_attention_fwd.cu,
// cuda_attention_bwd.cu), for the causal ops and cuda_attention_block.cu's blockwise ones.
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_attention.cuh"
#include "lib/kernels/cuda/cuda_attention_fma.cuh"
#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_common.cuh"

namespace mpigpt::cuda {

using fma_attn::kMaxHeadDim;
using fma_attn::kRows;
using fma_attn::Problem;

namespace {

// The bf16 forward and backward run on tensor cores where they apply (HD 64 and 128, 16-byte
// aligned rows), the fp32-FMA kernels elsewhere.
void run_forward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  if (p.B == 0 || p.Tq == 0) return;
  const AttentionTcForward tc{p.q,    p.k,    p.v,    p.out,  p.lse,  p.qpos, p.qseg, p.kpos, p.kseg,
                              p.q_stride, p.kv_stride, p.B, p.Tq, p.Tk, p.NH, p.NKV, p.HD, p.scale_log2};
  if (dt == DType::BF16 && attention_forward_tc(tc, dt, causal, stream)) return;
  fma_attn::forward(p, dt, causal, stream);
}

// p.D must hold B*NH*Tq floats of scratch.
void run_backward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  if (p.B == 0 || p.Tq == 0 || p.Tk == 0) return;  // (causal: Tq == Tk) nothing to add or to overwrite
  const AttentionTcBackward tc{{p.q, p.k, p.v, p.out, p.lse, p.qpos, p.qseg, p.kpos, p.kseg, p.q_stride,
                                p.kv_stride, p.B, p.Tq, p.Tk, p.NH, p.NKV, p.HD, p.scale_log2},
                               p.dout, p.dq, p.dk, p.dv, p.D, p.scale, p.accumulate};
  fma_attn::rowdot(p, dt, stream);
  if (dt == DType::BF16 && attention_backward_tc(tc, dt, causal, stream)) return;
  fma_attn::backward(p, dt, causal, stream);
}

// ---- problems -----------------------------------------------------------------------------------

bool aligned(const void* p, size_t bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The 4-element vector path: HD % 4 == 0 (so strides and head offsets are multiples of 4) and
// every data tensor aligned to 4 elements.
bool vector_ok(const Problem& p, DType dt) {
  const size_t a = 4 * dtype_size(dt);
  return p.HD % 4 == 0 && aligned(p.q, a) && aligned(p.k, a) && aligned(p.v, a) && aligned(p.out, a) &&
         aligned(p.dout, a) && aligned(p.dq, a) && aligned(p.dk, a) && aligned(p.dv, a);
}

void* offset(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.ptr) + elements * int64_t(dtype_size(t.dtype));
}

// The inputs of a (checked) call: queries from qkv; keys and values from qkv (causal, kv
// undefined) or from kv with the explicit mask.
Problem make_problem(const char* op, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                     Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  const bool causal = !kv.defined();
  const int64_t B = qkv.size(0), Tq = qkv.size(1), Tk = causal ? Tq : kv.size(1);
  if (HD > kMaxHeadDim)
    fail("{}: head dim HD = {} is not supported by the fused CUDA attention kernels: they are built for HD = 16, 32, "
         "64, 80, 96 and 128 (smaller head dims run zero-padded in the next one), so HD must be at most 128",
         op, HD);
  // The grid puts NH (or NKV) and B in its y and z dimensions; tokens are indexed with int.
  MPIGPT_CHECK(B <= 65535 && NH <= 65535, "{}: batch {} and heads {} must each be at most 65535 (CUDA grid limit)", op,
               B, NH);
  MPIGPT_CHECK(Tq <= INT32_MAX - kRows && Tk <= INT32_MAX - kRows, "{}: sequence lengths {} and {} exceed 2^31", op,
               Tq, Tk);
  Problem p{};
  p.B = int(B);
  p.Tq = int(Tq);
  p.Tk = int(Tk);
  p.NH = NH;
  p.NKV = NKV;
  p.HD = HD;
  p.scale = float(1.0 / std::sqrt(double(HD)));
  p.scale_log2 = float(1.4426950408889634 / std::sqrt(double(HD)));
  p.q = qkv.ptr;
  p.q_stride = qkv.size(2);
  if (causal) {
    p.k = offset(qkv, int64_t(NH) * HD);
    p.v = offset(qkv, int64_t(NH + NKV) * HD);
    p.kv_stride = p.q_stride;
  } else {
    p.k = kv.ptr;
    p.v = offset(kv, int64_t(NKV) * HD);
    p.kv_stride = kv.size(2);
    p.qpos = ptr<const int32_t>(qpos);
    p.qseg = ptr<const int32_t>(qseg);
    p.kpos = ptr<const int32_t>(kpos);
    p.kseg = ptr<const int32_t>(kseg);
  }
  p.out = out.ptr;
  p.lse = ptr<float>(lse);
  return p;
}

}  // namespace

// ---- entry points shared with cuda_attention_block.cu -------------------------------------------

void fused_attention_forward(CudaOps& ops, DType dt, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos,
                             Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  Problem p = make_problem("attention", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  p.vec = vector_ok(p, dt);
  run_forward(p, dt, !kv.defined(), ops.cuda_stream());
}

void fused_attention_backward(CudaOps& ops, DType dt, Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                              Tensor out, Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                              int NKV, int HD) {
  const bool causal = !kv.defined();
  Problem p = make_problem("attention", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  const int64_t C = int64_t(NH) * HD;
  p.dout = dout.ptr;
  p.dq = dqkv.ptr;
  p.dk = causal ? offset(dqkv, C) : dkv.ptr;
  p.dv = causal ? offset(dqkv, C + int64_t(NKV) * HD) : offset(dkv, int64_t(NKV) * HD);
  p.accumulate = !causal;
  p.vec = vector_ok(p, dt);
  CudaOps::Scratch D = ops.scratch(std::max<size_t>(1, size_t(p.B) * p.NH * p.Tq * sizeof(float)));
  p.D = static_cast<float*>(D.ptr);
  run_backward(p, dt, causal, ops.cuda_stream());
}

}  // namespace mpigpt::cuda
