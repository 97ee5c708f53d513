// CUDA backend: blockwise attention with an explicit (position, document) mask, the unit of ring
// attention and of packed documents (the fused kernels of cuda_attention.cu run with the mask), and
// the log-sum-exp merge of blockwise results.
#include <cmath>
#include <cstdint>
#include <utility>

#include "lib/kernels/cuda/cuda_attention.cuh"
#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kMergeThreads = 256;  // 8 warps, one (b, i, h) row each

// out (B,Tq,NH*HD), lse (B,NH,Tq) in place with the block's blk_out, blk_lse: m = logaddexp(lse,
// blk_lse), out = out e^(lse - m) + blk_out e^(blk_lse - m), lse = m. A side at -inf has weight 0
// and its out is never read (0 * NaN would poison the sum), so a running result may start as
// lse = -inf over any out; a row at -inf on both sides gets out = 0. One warp per (b, i, h) row.
template <class T>
__global__ void attention_merge_kernel(T* out, float* lse, const T* blk_out, const float* blk_lse, int64_t rows,
                                       int Tq, int NH, int HD) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // = (b*Tq + i)*NH + h
  const int lane = threadIdx.x & 31;
  if (w >= rows * NH) return;  // whole warps only
  const int64_t n = w / NH, b = n / Tq, i = n % Tq, h = w % NH;
  const int64_t li = (b * NH + h) * Tq + i;
  T* o = out + w * HD;  // row n of out holds the NH heads of HD: (n*NH + h)*HD = w*HD
  const T* bo = blk_out + w * HD;
  const float l = lse[li], bl = blk_lse[li];
  float wa, wb, m;
  if (bl == -INFINITY) {  // the block adds nothing
    wa = l == -INFINITY ? 0.f : 1.f;
    wb = 0.f;
    m = l;
  } else if (l == -INFINITY) {  // the first contribution: a copy
    wa = 0.f;
    wb = 1.f;
    m = bl;
  } else {
    const float hi = fmaxf(l, bl);
    m = hi + log1pf(expf(fminf(l, bl) - hi));
    wa = expf(l - m);
    wb = expf(bl - m);
  }
  for (int e = lane; e < HD; e += 32) {
    const float a = wa == 0.f ? 0.f : wa * to_f(o[e]);  // a weight 0 side is not read
    const float c = wb == 0.f ? 0.f : wb * to_f(bo[e]);
    o[e] = from_f<T>(a + c);
  }
  __syncwarp();  // every lane has read lse before it changes
  if (lane == 0) lse[li] = m;
}

}  // namespace

void CudaOps::attention_block_forward_impl(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                           Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  // out (B,Tq,NH*HD), lse (B,NH,Tq) f32, qkv (B,Tq,(NH+2*NKV)*HD) (query heads read), kv (B,Tk,2*NKV*HD),
  // qpos, qseg (B,Tq) i32, kpos, kseg (B,Tk) i32
  fused_attention_forward(*this, out.dtype, out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
}

void CudaOps::attention_block_backward_impl(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                       Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV,
                                            int HD) {
  // dqkv (B,Tq,(NH+2*NKV)*HD): query columns accumulate; dkv (B,Tk,2*NKV*HD) accumulates;
  // dout, out (B,Tq,NH*HD) and lse (B,NH,Tq) are the FINAL (merged) ones; the rest as the forward.
  fused_attention_backward(*this, dqkv.dtype, dqkv, dkv, dout, qkv, kv, out, lse, qpos, qseg, kpos, kseg, NH, NKV, HD);
}

void CudaOps::attention_merge_impl(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) {
  // out, blk_out (B,Tq,NH*HD); lse, blk_lse (B,NH,Tq) f32
  const char* op = "attention_merge";
  const DType dt = out.dtype;
  const int64_t NH = lse.size(1), Tq = lse.size(2);
  const int64_t C = out.ndim() > 0 ? out.size(-1) : 0, rows = C > 0 ? out.numel() / C : 0;
  MPIGPT_CHECK(Tq <= INT32_MAX && NH <= INT32_MAX && C / NH <= INT32_MAX, "{}: sizes of lse {} exceed 2^31", op,
               lse.shape.str());
  if (rows == 0) return;
  const int64_t warps = rows * NH, per_block = kMergeThreads / 32;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = unsigned((warps + per_block - 1) / per_block);
    T* o = ptr<T>(out);
    const T* bo = ptr<const T>(blk_out);
    attention_merge_kernel<T><<<grid, kMergeThreads, 0, stream_>>>(o, ptr<float>(lse), bo, ptr<const float>(blk_lse),
                                                                   rows, int(Tq), int(NH), int(C / NH));
  });
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace mpigpt::cuda
