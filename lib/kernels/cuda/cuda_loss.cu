// CUDA backend: fused softmax + cross-entropy loss and its logits gradient, whole or as the three
// per-shard steps of the vocabulary-parallel version.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxThreads = 1024;

__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fc00000); }
// e^(x - m) through the hardware exp2 (~2 ulp): the difference is formed first so that its
// rounding, not that of x*log2e, sets the error.
__device__ __forceinline__ float exp_shifted(float x, float m) { return exp2f((x - m) * kLog2e); }

// Online softmax state: m = running max, s = sum of e^(x - m). Merging rescales the smaller side;
// an empty side (m = -inf) contributes nothing.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * exp_shifted(a.m, m) + b.s * exp_shifted(b.m, m)};
}
__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
  for (int o = 16; o > 0; o >>= 1)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)});
  return v;
}
__device__ __forceinline__ MaxSum block_merge(MaxSum v, float* shm, float* shs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_merge(v);
  if (lane == 0) {
    shm[warp] = v.m;
    shs[warp] = v.s;
  }
  __syncthreads();
  v = lane < nwarps ? MaxSum{shm[lane], shs[lane]} : MaxSum{-INFINITY, 0.0f};
  v = warp_merge(v);
  __syncthreads();
  return v;
}

// ---- fused cross-entropy ------------------------------------------------------------------------

// Packs a thread loads before it uses any of them: U independent 16-byte loads in flight per
// thread instead of one, so that a block's first pass over its row is not bound by the latency of
// one load at a time.
constexpr int kUnroll = 4;

// losses (N) optional, dlogits (N,Vp) optional (may alias logits), logits (N,Vp), targets (N);
// softmax over columns [0, V); Vp % W == 0. One block per row. With kStage the first pass also
// copies the row's packs holding a column < V into shared memory (dynamic, (V+W-1)/W packs) and
// the second pass reads them from there: the logits are read from memory once, where the
// streaming version (kStage false, for rows larger than shared memory) reads them again from L2.
template <class T, int W, bool kStage>
__global__ void __launch_bounds__(kMaxThreads)
    crossentropy_kernel(float* losses, T* dlogits, const T* logits, const int32_t* __restrict__ targets, int64_t V,
                        int64_t Vp, float dloss) {
  extern __shared__ float4 row_raw[];
  Pack<T, W>* staged = reinterpret_cast<Pack<T, W>*>(row_raw);
  __shared__ float shm[32], shs[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Vp;
  T* dx = dlogits ? dlogits + row * Vp : nullptr;
  const int64_t t = targets[row];
  const int64_t P = Vp / W, Pv = (V + W - 1) / W;  // all packs; packs holding a column < V
  const int64_t stride = blockDim.x;
  if (t < 0) {  // ignored row (uniform over the block)
    if (losses && threadIdx.x == 0) losses[row] = 0.0f;
    if (dx) {
      Pack<T, W> z;
#pragma unroll
      for (int j = 0; j < W; ++j) z.v[j] = from_f<T>(0.0f);
      for (int64_t p = threadIdx.x; p < P; p += stride) store_pack<W>(dx + p * W, z);
    }
    return;
  }
  const bool bad = t >= V;
  // The target logit is read before the first barrier, so before any thread writes dx.
  const float xt = threadIdx.x == 0 && !bad ? to_f(x[t]) : 0.0f;
  MaxSum ms{-INFINITY, 0.0f};
  for (int64_t p0 = threadIdx.x; p0 < Pv; p0 += kUnroll * stride) {
    Pack<T, W> v[kUnroll] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (p0 + u * stride < Pv) v[u] = load_pack<W>(x + (p0 + u * stride) * W);
    float pm = -INFINITY;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      if (p >= Pv) continue;
      if (kStage) staged[p] = v[u];
#pragma unroll
      for (int j = 0; j < W; ++j)
        if (p * W + j < V) pm = fmaxf(pm, to_f(v[u].v[j]));
    }
    if (pm > ms.m) {
      ms.s *= exp_shifted(ms.m, pm);
      ms.m = pm;
    }
    if (ms.m != -INFINITY)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t p = p0 + u * stride;
        if (p >= Pv) continue;
#pragma unroll
        for (int j = 0; j < W; ++j)
          if (p * W + j < V) ms.s += exp_shifted(to_f(v[u].v[j]), ms.m);
      }
  }
  ms = block_merge(ms, shm, shs);  // its barriers also order the staged writes before the reads
  if (losses && threadIdx.x == 0) losses[row] = bad ? nan_f() : logf(ms.s) + ms.m - xt;
  if (!dx) return;
  const float scale = bad ? nan_f() : dloss / ms.s;
  for (int64_t p0 = threadIdx.x; p0 < P; p0 += kUnroll * stride) {
    Pack<T, W> v[kUnroll] = {};
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      if (p < Pv) v[u] = kStage ? staged[p] : load_pack<W>(x + p * W);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      if (p >= P) continue;
      Pack<T, W> o;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int64_t c = p * W + j;
        const float g = c < V ? exp_shifted(to_f(v[u].v[j]), ms.m) * scale - (c == t ? dloss : 0.0f) : 0.0f;
        o.v[j] = from_f<T>(g);
      }
      store_pack<W>(dx + p * W, o);
    }
  }
}

// ---- vocabulary-parallel steps ------------------------------------------------------------------
// logits (N,Vl) hold global columns [vocab_start, vocab_start+Vl); the first `valid` are < V.

// maxes (N) = max over the valid columns; -inf when there are none. Vl % W == 0.
template <class T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    shard_max_kernel(float* maxes, const T* __restrict__ logits, int64_t Vl, int64_t valid) {
  __shared__ float sh[32];
  const T* x = logits + int64_t(blockIdx.x) * Vl;
  const int64_t Pv = (valid + W - 1) / W;
  float m = -INFINITY;
  for (int64_t p = threadIdx.x; p < Pv; p += blockDim.x) {
    const Pack<T, W> v = load_pack<W>(x + p * W);
#pragma unroll
    for (int j = 0; j < W; ++j)
      if (p * W + j < valid) m = fmaxf(m, to_f(v.v[j]));
  }
  m = block_max(m, sh);
  if (threadIdx.x == 0) maxes[blockIdx.x] = m;
}

// sumexp (N) = sum over valid columns of e^(x - maxes); target_logit (N) = x[target - vocab_start]
// when it lies in this shard, else 0; both 0 on ignored rows (NaN target_logit for target >= V).
template <class T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    shard_sums_kernel(float* sumexp, float* target_logit, const T* __restrict__ logits, const float* __restrict__ maxes,
                      const int32_t* __restrict__ targets, int64_t Vl, int64_t valid, int64_t vocab_start, int64_t V) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  if (t < 0) {
    if (threadIdx.x == 0) sumexp[row] = target_logit[row] = 0.0f;
    return;
  }
  const T* x = logits + row * Vl;
  const float m = maxes[row];
  const int64_t Pv = (valid + W - 1) / W;
  float s = 0.0f;
  for (int64_t p = threadIdx.x; p < Pv; p += blockDim.x) {
    const Pack<T, W> v = load_pack<W>(x + p * W);
#pragma unroll
    for (int j = 0; j < W; ++j)
      if (p * W + j < valid) s += exp_shifted(to_f(v.v[j]), m);
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const int64_t lt = t - vocab_start;
    sumexp[row] = s;
    target_logit[row] = t >= V ? nan_f() : (lt >= 0 && lt < valid ? to_f(x[lt]) : 0.0f);
  }
}

__device__ __forceinline__ float shard_loss(float m, float s, float tl) { return logf(s) + m - tl; }

// losses (N) alone (no gradient wanted): one thread per row.
__global__ void shard_losses_kernel(float* losses, const float* __restrict__ maxes, const float* __restrict__ sumexp,
                                    const float* __restrict__ target_logit, const int32_t* __restrict__ targets,
                                    int64_t N, int64_t V) {
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= N) return;
  const int64_t t = targets[row];
  losses[row] = t < 0 ? 0.0f : t >= V ? nan_f() : shard_loss(maxes[row], sumexp[row], target_logit[row]);
}

// dlogits (N,Vl) (may alias logits) = this shard's (softmax - onehot) * dloss, 0 on ignored rows
// and padded columns; losses (N) optional. One block per row, Vl % W == 0.
template <class T, int W>
__global__ void __launch_bounds__(kMaxThreads)
    shard_finish_kernel(float* losses, T* dlogits, const T* logits, const float* __restrict__ maxes,
                        const float* __restrict__ sumexp, const float* __restrict__ target_logit,
                        const int32_t* __restrict__ targets, int64_t Vl, int64_t valid, int64_t vocab_start, int64_t V,
                        float dloss) {
  const int64_t row = blockIdx.x;
  const int64_t t = targets[row];
  const bool ignored = t < 0, bad = t >= V;
  const float m = maxes[row], s = sumexp[row];
  if (losses && threadIdx.x == 0) losses[row] = ignored ? 0.0f : bad ? nan_f() : shard_loss(m, s, target_logit[row]);
  const T* x = logits + row * Vl;
  T* dx = dlogits + row * Vl;
  const int64_t lt = t - vocab_start;
  const float scale = bad ? nan_f() : dloss / s;
  const int64_t P = Vl / W;
  for (int64_t p = threadIdx.x; p < P; p += blockDim.x) {
    Pack<T, W> o;
    if (!ignored && p * W < valid) {
      // Each element is read and then written by the same thread: dlogits may alias logits.
      const Pack<T, W> v = load_pack<W>(x + p * W);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const int64_t c = p * W + j;
        const float g = exp_shifted(to_f(v.v[j]), m) * scale - (c == lt ? dloss : 0.0f);
        o.v[j] = from_f<T>(c < valid ? g : 0.0f);
      }
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(0.0f);
    }
    store_pack<W>(dx + p * W, o);
  }
}

// ---- host side ----------------------------------------------------------------------------------

// Threads for one row of `packs` work items: whole warps, at most kMaxThreads.
int threads_for(int64_t packs) { return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, kMaxThreads)); }

// The fused op: 512 threads per row (two rows' blocks per multiprocessor with their rows staged
// in shared memory at GPT-2's vocabulary); the row is staged when it fits (a gradient is wanted
// and the device lets one block have that much shared memory), else the second pass streams.
template <class T, int W>
void launch_crossentropy(CudaOps& ops, float* L, T* dX, const T* X, const int32_t* targets, int64_t N, int64_t V,
                         int64_t Vp, float dloss) {
  const int threads = std::min(threads_for((V + W - 1) / W), 512);
  const size_t stage = size_t((V + W - 1) / W) * W * sizeof(T);
  int device_smem = 0;
  MPIGPT_CUDA(cudaDeviceGetAttribute(&device_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, ops.device_index()));
  if (dX && stage + 64 * sizeof(float) <= size_t(device_smem)) {
    auto kernel = crossentropy_kernel<T, W, true>;
    if (stage > 48 * 1024)
      MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(stage)));
    kernel<<<unsigned(N), threads, stage, ops.cuda_stream()>>>(L, dX, X, targets, V, Vp, dloss);
  } else {
    crossentropy_kernel<T, W, false><<<unsigned(N), threads, 0, ops.cuda_stream()>>>(L, dX, X, targets, V, Vp, dloss);
  }
  MPIGPT_CUDA_LAUNCHED();
}

// One rank's slice of the vocabulary (as the CPU backend): logits (N,Vl), `valid` columns < V.
struct Shard {
  int64_t N, Vl, valid;
};
Shard shard_of(const char* op, const Tensor& logits, int64_t vocab_start, int64_t V) {
  const RowsCols mx = rows_cols(logits);
  MPIGPT_CHECK(mx.rows < INT32_MAX, "{}: logits {} have too many rows for one block per row", op, logits.shape.str());
  return {mx.rows, mx.cols, std::clamp<int64_t>(V - vocab_start, 0, mx.cols)};
}

}  // namespace

// Targets: the CPU backend rejects a target >= V before it starts; here that would need a device
// read and a host sync per call, so such a row instead gets a NaN loss and NaN gradients, which the
// training loop's loss check reports loudly. Rows with a target < 0 are ignored (loss 0, gradient 0),
// as the contract says.
void CudaOps::crossentropy_forward_backward_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets,
                                                 int64_t V, float dloss) {
  // losses (N) f32 optional, dlogits (N,Vp) optional (may alias logits), logits (N,Vp), targets (N) i32;
  // softmax over [0, V)
  const char* op = "crossentropy_forward_backward";
  const DType dt = logits.dtype;
  const RowsCols mx = rows_cols(logits);
  const int64_t N = mx.rows, Vp = mx.cols;
  MPIGPT_CHECK(N < INT32_MAX, "{}: logits {} have too many rows for one block per row", op, logits.shape.str());
  if (N == 0 || (!losses.defined() && !dlogits.defined())) return;
  float* L = losses.defined() ? ptr<float>(losses) : nullptr;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    T* dX = dlogits.defined() ? ptr<T>(dlogits) : nullptr;
    if (Vp % W == 0 && aligned16(logits) && aligned16(dlogits))
      launch_crossentropy<T, W>(*this, L, dX, ptr<T>(logits), ptr<int32_t>(targets), N, V, Vp, dloss);
    else
      launch_crossentropy<T, 1>(*this, L, dX, ptr<T>(logits), ptr<int32_t>(targets), N, V, Vp, dloss);
  });
}

void CudaOps::softmax_shard_max_impl(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) {
  // maxes (N) f32, logits (N,Vl)
  const char* op = "softmax_shard_max";
  const DType dt = logits.dtype;
  const Shard s = shard_of(op, logits, vocab_start, V);
  if (s.N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    if (s.Vl % W == 0 && aligned16(logits))
      shard_max_kernel<T, W><<<unsigned(s.N), threads_for((s.valid + W - 1) / W), 0, cuda_stream()>>>(
          ptr<float>(maxes), ptr<T>(logits), s.Vl, s.valid);
    else
      shard_max_kernel<T, 1>
          <<<unsigned(s.N), threads_for(s.valid), 0, cuda_stream()>>>(ptr<float>(maxes), ptr<T>(logits), s.Vl, s.valid);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::softmax_shard_sums_impl(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                                      int64_t vocab_start, int64_t V) {
  // sumexp (N), target_logit (N) f32, logits (N,Vl), maxes (N) f32 global, targets (N) i32 global ids
  const char* op = "softmax_shard_sums";
  const DType dt = logits.dtype;
  const Shard s = shard_of(op, logits, vocab_start, V);
  if (s.N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    float* S = ptr<float>(sumexp);
    float* TL = ptr<float>(target_logit);
    const float* M = ptr<float>(maxes);
    const int32_t* tgt = ptr<int32_t>(targets);
    if (s.Vl % W == 0 && aligned16(logits))
      shard_sums_kernel<T, W><<<unsigned(s.N), threads_for((s.valid + W - 1) / W), 0, cuda_stream()>>>(
          S, TL, ptr<T>(logits), M, tgt, s.Vl, s.valid, vocab_start, V);
    else
      shard_sums_kernel<T, 1><<<unsigned(s.N), threads_for(s.valid), 0, cuda_stream()>>>(S, TL, ptr<T>(logits), M, tgt,
                                                                                         s.Vl, s.valid, vocab_start, V);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::crossentropy_shard_finish_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                             Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                             float dloss) {
  // losses (N) f32 optional, dlogits (N,Vl) optional (may alias logits), logits (N,Vl), maxes, sumexp,
  // target_logit (N) f32 global, targets (N) i32 global ids
  const char* op = "crossentropy_shard_finish";
  const DType dt = logits.dtype;
  const Shard s = shard_of(op, logits, vocab_start, V);
  if (s.N == 0) return;
  float* L = losses.defined() ? ptr<float>(losses) : nullptr;
  if (!dlogits.defined()) {
    if (!L) return;
    shard_losses_kernel<<<blocks_for(s.N, 256), 256, 0, cuda_stream()>>>(
        L, ptr<float>(maxes), ptr<float>(sumexp), ptr<float>(target_logit), ptr<int32_t>(targets), s.N, V);
    MPIGPT_CUDA_LAUNCHED();
    return;
  }
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    const float* M = ptr<float>(maxes);
    const float* S = ptr<float>(sumexp);
    const float* TL = ptr<float>(target_logit);
    if (s.Vl % W == 0 && aligned16(logits) && aligned16(dlogits))
      shard_finish_kernel<T, W><<<unsigned(s.N), threads_for(s.Vl / W), 0, cuda_stream()>>>(
          L, ptr<T>(dlogits), ptr<T>(logits), M, S, TL, ptr<int32_t>(targets), s.Vl, s.valid, vocab_start, V, dloss);
    else
      shard_finish_kernel<T, 1><<<unsigned(s.N), threads_for(s.Vl), 0, cuda_stream()>>>(
          L, ptr<T>(dlogits), ptr<T>(logits), M, S, TL, ptr<int32_t>(targets), s.Vl, s.valid, vocab_start, V, dloss);
    MPIGPT_CUDA_LAUNCHED();
  });
}

}  // namespace mpigpt::cuda
