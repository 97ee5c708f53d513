// CUDA backend: LayerNorm and RMSNorm forward/backward, one block per row, fp32 statistics.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kMaxThreads = 512;
constexpr int kMaxPartialBlocks = 1024;  // bounds the partial-sum scratch to 1024 rows of C floats

// ---- forward ------------------------------------------------------------------------------------

// out (N,C), mean/rstd (N) optional, inp (N,C), weight/bias (C) (bias optional); one block per row.
// The row is read three times (mean, centred variance, output); the second and third reads hit
// L1/L2, and the two-pass variance keeps rows with a large mean exact, as the CPU reference does.
// With res (the fused residual add), sum = inp + res is written first, rounded to T as the add op
// rounds it, and normalised: each thread reads back only the packs it wrote itself, so sum may
// alias inp or res.
template <class T, int W, bool kLayer>
__global__ void norm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* res, T* sum,
                                    const T* __restrict__ weight, const T* __restrict__ bias, int C, float eps) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* x = inp + row * C;
  T* o = out + row * C;
  const int P = C / W;
  if (res) {
    T* y = sum + row * C;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, W> a = load_pack<W>(x + p * W), b = load_pack<W>(res + row * C + p * W);
      Pack<T, W> r;
#pragma unroll
      for (int j = 0; j < W; ++j) r.v[j] = from_f<T>(to_f(a.v[j]) + to_f(b.v[j]));
      store_pack<W>(y + p * W, r);
    }
    x = y;
  }
  float m = 0.0f;
  if (kLayer) {
    float s = 0.0f;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, W> v = load_pack<W>(x + p * W);
#pragma unroll
      for (int j = 0; j < W; ++j) s += to_f(v.v[j]);
    }
    m = block_sum(s, sh) / float(C);
  }
  float q = 0.0f;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const Pack<T, W> v = load_pack<W>(x + p * W);
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float d = to_f(v.v[j]) - m;
      q += d * d;
    }
  }
  const float rs = 1.0f / sqrtf(block_sum(q, sh) / float(C) + eps);  // IEEE sqrt and divide, as the CPU
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const Pack<T, W> v = load_pack<W>(x + p * W);
    const Pack<T, W> w = load_pack<W>(weight + p * W);
    Pack<T, W> r;
    if (kLayer && bias) {
      const Pack<T, W> b = load_pack<W>(bias + p * W);
#pragma unroll
      for (int j = 0; j < W; ++j) r.v[j] = from_f<T>((to_f(v.v[j]) - m) * rs * to_f(w.v[j]) + to_f(b.v[j]));
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) r.v[j] = from_f<T>((to_f(v.v[j]) - m) * rs * to_f(w.v[j]));
    }
    store_pack<W>(o + p * W, r);
  }
  if (threadIdx.x == 0) {
    if (kLayer && mean) mean[row] = m;
    if (rstd) rstd[row] = rs;
  }
}

// ---- backward -----------------------------------------------------------------------------------
// The weight/bias gradients go through per-block partial sums (shared memory, then an F32 scratch
// row per block) that later kernels add in a fixed order: no float atomics, so the gradients are the
// same bits on every run on a given GPU model.

// acc[0:W) += v, through float4 accesses when W allows (a warp's 32 x 16 bytes are then served
// without bank conflicts; scalar accesses at a stride of W floats would conflict W/4-fold).
template <int W>
__device__ __forceinline__ void smem_add(float* acc, const float (&v)[W]) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      float4* a = reinterpret_cast<float4*>(acc) + q;
      float4 t = *a;
      t.x += v[4 * q];
      t.y += v[4 * q + 1];
      t.z += v[4 * q + 2];
      t.w += v[4 * q + 3];
      *a = t;
    }
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) acc[j] += v[j];
  }
}

// One row of the backward as a thread holds it: its KP packs of dout and inp (thread t owns packs
// t, t + blockDim.x, ...; packs past the row's end are not loaded) and the row's statistics.
__device__ __forceinline__ int owned_pack(int k) { return int(threadIdx.x + k * blockDim.x); }
template <class T, int W, int KP>
struct NormRow {
  Pack<T, W> g[KP], x[KP];
  float m, rs;
};
template <class T, int W, int KP, bool kLayer>
__device__ __forceinline__ NormRow<T, W, KP> load_norm_row(const T* dout, const T* inp, const float* mean,
                                                          const float* rstd, int64_t row, int C) {
  NormRow<T, W, KP> r{};
  const int P = C / W;
#pragma unroll
  for (int k = 0; k < KP; ++k) {
    const int p = owned_pack(k);
    if (p < P) {
      r.g[k] = load_pack<W>(dout + row * C + p * W);
      r.x[k] = load_pack<W>(inp + row * C + p * W);
    }
  }
  r.m = kLayer ? mean[row] : 0.0f;
  r.rs = rstd[row];
  return r;
}

// Block b takes rows [b*rows_per_block, ...) in order. Per row: dinp (ACCUMULATES) from the two
// row means of dnorm = weight*dout and dnorm*xhat; the weight (and, for LayerNorm, bias) gradient
// terms dout*xhat and dout go into shared accumulators acc[0:C) and acc[C:2C). A thread always
// owns the same columns, so the accumulators need neither atomics nor barriers. At the end each
// block writes its accumulators to its own row of `partial` (G, nacc*C), which the column sums
// reduce in block order.
// The row stays in registers between its two uses (no second read), and with kPrefetch the next
// row's loads are issued before this row's reductions, so that the block's memory traffic
// overlaps its barriers and arithmetic instead of alternating with them. The dinp row is loaded
// before the reductions for the same reason. dinp may alias dout: each thread reads its packs of
// a row before it writes them, and the prefetched row is another one.
template <class T, int W, int KP, bool kLayer, bool kPrefetch>
__global__ void __launch_bounds__(kMaxThreads)
    norm_backward_kernel(T* dinp, float* __restrict__ partial, const T* dout, const T* inp,
                         const float* __restrict__ mean, const float* __restrict__ rstd, const T* __restrict__ weight,
                         int64_t N, int C, int64_t rows_per_block) {
  extern __shared__ float4 acc_raw[];  // nacc * C floats when partial is wanted (16-byte aligned)
  float* acc = reinterpret_cast<float*>(acc_raw);
  __shared__ float sh[64];
  constexpr int nacc = kLayer ? 2 : 1;
  const int P = C / W;
  if (partial)
    for (int p = threadIdx.x; p < P; p += blockDim.x)
      for (int j = 0; j < nacc * W; ++j) acc[(j / W) * C + p * W + j % W] = 0.0f;
  Pack<T, W> wv[KP] = {};
#pragma unroll
  for (int k = 0; k < KP; ++k)
    if (owned_pack(k) < P) wv[k] = load_pack<W>(weight + owned_pack(k) * W);
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  NormRow<T, W, KP> cur{};
  if (kPrefetch && r0 < r1) cur = load_norm_row<T, W, KP, kLayer>(dout, inp, mean, rstd, r0, C);
  for (int64_t row = r0; row < r1; ++row) {
    if (!kPrefetch) cur = load_norm_row<T, W, KP, kLayer>(dout, inp, mean, rstd, row, C);
    NormRow<T, W, KP> next{};
    if (kPrefetch && row + 1 < r1) next = load_norm_row<T, W, KP, kLayer>(dout, inp, mean, rstd, row + 1, C);
    T* d = dinp ? dinp + row * C : nullptr;
    Pack<T, W> dv[KP] = {};
    if (d)
#pragma unroll
      for (int k = 0; k < KP; ++k)
        if (owned_pack(k) < P) dv[k] = load_pack<W>(d + owned_pack(k) * W);
    float a = 0.0f, b = 0.0f;  // sums of dnorm and dnorm * xhat
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int p = owned_pack(k);
      if (p >= P) continue;
      float gw[W], gb[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float gj = to_f(cur.g[k].v[j]), xh = (to_f(cur.x[k].v[j]) - cur.m) * cur.rs,
                    dn = to_f(wv[k].v[j]) * gj;
        a += dn;
        b += dn * xh;
        gw[j] = gj * xh;
        gb[j] = gj;
      }
      if (partial) {
        smem_add<W>(acc + p * W, gw);
        if (kLayer) smem_add<W>(acc + C + p * W, gb);
      }
    }
    if (d) {  // uniform over the block: the barriers below are all skipped together
      float ma = 0.0f, mb;
      if (kLayer) {
        const float2 s = block_sum2(make_float2(a, b), sh);
        ma = s.x / float(C);
        mb = s.y / float(C);
      } else {
        mb = block_sum(b, sh) / float(C);
      }
#pragma unroll
      for (int k = 0; k < KP; ++k) {
        const int p = owned_pack(k);
        if (p >= P) continue;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const float xh = (to_f(cur.x[k].v[j]) - cur.m) * cur.rs, dn = to_f(wv[k].v[j]) * to_f(cur.g[k].v[j]);
          dv[k].v[j] = from_f<T>(to_f(dv[k].v[j]) + (dn - ma - xh * mb) * cur.rs);
        }
        store_pack<W>(d + p * W, dv[k]);
      }
    }
    if (kPrefetch) cur = next;
  }
  if (partial) {
    float* out = partial + int64_t(blockIdx.x) * nacc * C;
    for (int p = threadIdx.x; p < P; p += blockDim.x)
      for (int j = 0; j < nacc * W; ++j) {
        const int c = (j / W) * C + p * W + j % W;
        out[c] = acc[c];
      }
  }
}

// out (S, cols) = per segment y, the sum of rows [y*rows_per_seg, ...) of partial (G, stride),
// in a fixed order. Block (32, 8): 32 columns, 8 interleaved subsets of the segment's rows,
// combined through shared memory. This first stage spreads the G partial rows over S segments so
// that enough blocks share the reading; column_sum_kernel then adds the S rows.
__global__ void segment_sum_kernel(float* __restrict__ out, const float* __restrict__ partial, int G, int cols,
                                   int stride, int rows_per_seg) {
  __shared__ float sh[8][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  const int g0 = blockIdx.y * rows_per_seg, g1 = g0 + rows_per_seg < G ? g0 + rows_per_seg : G;
  float s = 0.0f;
  if (c < cols)
#pragma unroll 4
    for (int g = g0 + int(threadIdx.y); g < g1; g += 8) s += partial[int64_t(g) * stride + c];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int y = 1; y < 8; ++y) s += sh[y][threadIdx.x];
    out[int64_t(blockIdx.y) * cols + c] = s;
  }
}

// dweight (C) += sum_g partial[g, 0:C), dbias (C) += sum_g partial[g, C:2C) (either optional).
// Block (32, 16): 32 columns, 16 interleaved subsets of the G partial rows, combined in a fixed
// order through shared memory (deterministic, and 16 loads in flight per column).
__global__ void column_sum_kernel(float* dweight, float* dbias, const float* __restrict__ partial, int G, int C,
                                  int stride) {
  __shared__ float sw[16][33], sb[16][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float w = 0.0f, b = 0.0f;
  if (c < C)
    for (int g = threadIdx.y; g < G; g += 16) {
      const float* row = partial + int64_t(g) * stride;
      if (dweight) w += row[c];
      if (dbias) b += row[C + c];
    }
  sw[threadIdx.y][threadIdx.x] = w;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    for (int y = 1; y < 16; ++y) {
      w += sw[y][threadIdx.x];
      b += sb[y][threadIdx.x];
    }
    if (dweight) dweight[c] += w;
    if (dbias) dbias[c] += b;
  }
}

// ---- host side ----------------------------------------------------------------------------------

int threads_for(int64_t packs) { return int(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, kMaxThreads)); }

// Whether every defined tensor allows 16-byte packs of W elements: aligned starts and C % W == 0.
bool packs_fit(int64_t C, int W, std::initializer_list<Tensor> ts) {
  if (C % W != 0) return false;
  for (const Tensor& t : ts)
    if (t.defined() && !aligned16(t)) return false;
  return true;
}

// res and sum: the fused residual add (both undefined for a plain norm).
template <class T, bool kLayer>
void launch_forward(cudaStream_t s, Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor res, Tensor sum,
                    Tensor weight, Tensor bias, float eps, int64_t N, int C) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = packs_fit(C, V, {out, inp, res, sum, weight, bias});
  const int W = vec ? V : 1;
  const int threads = threads_for(C / W);
  float* M = mean.defined() ? ptr<float>(mean) : nullptr;
  float* R = rstd.defined() ? ptr<float>(rstd) : nullptr;
  const T* Bs = bias.defined() ? ptr<T>(bias) : nullptr;
  const T* Res = res.defined() ? ptr<T>(res) : nullptr;
  T* Sum = sum.defined() ? ptr<T>(sum) : nullptr;
  if (vec)
    norm_forward_kernel<T, V, kLayer>
        <<<unsigned(N), threads, 0, s>>>(ptr<T>(out), M, R, ptr<T>(inp), Res, Sum, ptr<T>(weight), Bs, C, eps);
  else
    norm_forward_kernel<T, 1, kLayer>
        <<<unsigned(N), threads, 0, s>>>(ptr<T>(out), M, R, ptr<T>(inp), Res, Sum, ptr<T>(weight), Bs, C, eps);
  MPIGPT_CUDA_LAUNCHED();
}

// Packs per thread of the backward: a row of P packs is held by at most kMaxThreads threads with
// KP packs each. Up to kMaxPrefetchPacks the next row is prefetched (two rows in registers).
constexpr int kMaxRowPacks = 8, kMaxPrefetchPacks = 4;

template <class T, int W, int KP, bool kLayer>
void launch_backward_w(CudaOps& ops, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                       Tensor rstd, Tensor weight, int64_t N, int C, const char* op) {
  cudaStream_t s = ops.cuda_stream();
  auto kernel = norm_backward_kernel<T, W, KP, kLayer, (KP <= kMaxPrefetchPacks)>;
  const int threads = threads_for((C / W + KP - 1) / KP);
  const bool want_params = dweight.defined() || dbias.defined();
  constexpr int nacc = kLayer ? 2 : 1;
  const size_t smem = want_params ? size_t(nacc) * size_t(C) * sizeof(float) : 0;
  int device_smem = 0, sms = 0;
  MPIGPT_CUDA(cudaDeviceGetAttribute(&device_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, ops.device_index()));
  MPIGPT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ops.device_index()));
  MPIGPT_CHECK(smem + 64 * sizeof(float) <= size_t(device_smem),
               "{}: C = {} needs {} bytes of shared memory for the weight-gradient partial sums; this GPU has {}", op,
               C, smem, device_smem);
  if (smem > 48 * 1024)
    MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // As many blocks as fit on the GPU at once (one wave, rows split evenly), at most one per row.
  int per_sm = 0;
  MPIGPT_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t want = std::clamp<int64_t>(int64_t(std::max(per_sm, 1)) * sms, 1, kMaxPartialBlocks);
  const int64_t rows_per_block = (N + want - 1) / want;
  const int G = int((N + rows_per_block - 1) / rows_per_block);
  CudaOps::Scratch partial =
      want_params ? ops.scratch(size_t(G) * nacc * size_t(C) * sizeof(float)) : CudaOps::Scratch{};
  float* part = static_cast<float*>(partial.ptr);
  kernel<<<G, threads, smem, s>>>(dinp.defined() ? ptr<T>(dinp) : nullptr, part, ptr<T>(dout), ptr<T>(inp),
                                  kLayer ? ptr<float>(mean) : nullptr, ptr<float>(rstd), ptr<T>(weight), N, C,
                                  rows_per_block);
  MPIGPT_CUDA_LAUNCHED();
  if (!want_params) return;
  // The G partial rows are summed in two stages when one would leave most of the GPU idle: S
  // segments of rows first (about four blocks per multiprocessor in all), then the S sums.
  const int cols = nacc * C, col_blocks = int(blocks_for(cols, 32));
  const int rows_per_seg = int(std::max<int64_t>(1, G / std::max<int64_t>(1, 4 * int64_t(sms) / col_blocks)));
  const int S = (G + rows_per_seg - 1) / rows_per_seg;
  CudaOps::Scratch sums = S > 1 ? ops.scratch(size_t(S) * size_t(cols) * sizeof(float)) : CudaOps::Scratch{};
  if (S > 1) {
    const dim3 grid{unsigned(col_blocks), unsigned(S)};
    segment_sum_kernel<<<grid, dim3(32, 8), 0, s>>>(
        static_cast<float*>(sums.ptr), part, G, cols, cols, rows_per_seg);
    MPIGPT_CUDA_LAUNCHED();
  }
  column_sum_kernel<<<blocks_for(C, 32), dim3(32, 16), 0, s>>>(
      dweight.defined() ? ptr<float>(dweight) : nullptr, kLayer && dbias.defined() ? ptr<float>(dbias) : nullptr,
      S > 1 ? static_cast<float*>(sums.ptr) : part, S > 1 ? S : G, C, cols);
  MPIGPT_CUDA_LAUNCHED();
}

template <class T, int W, bool kLayer>
void launch_backward_packs(CudaOps& ops, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                           Tensor mean, Tensor rstd, Tensor weight, int64_t N, int C, const char* op) {
  const int64_t P = C / W;
  MPIGPT_CHECK(P <= int64_t(kMaxRowPacks) * kMaxThreads,
               "{}: C = {} is more than the CUDA norm backward holds in one block: at most {} columns{}", op, C,
               int64_t(kMaxRowPacks) * kMaxThreads * W,
               W == 1 ? " here, where C is not a multiple of 16 bytes of data or a tensor is not 16-byte aligned" : "");
  const auto run = [&](auto kp) {
    launch_backward_w<T, W, decltype(kp)::value, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight,
                                                         N, C, op);
  };
  if (P <= kMaxThreads)
    run(std::integral_constant<int, 1>{});
  else if (P <= 2 * kMaxThreads)
    run(std::integral_constant<int, 2>{});
  else if (P <= 4 * kMaxThreads)
    run(std::integral_constant<int, 4>{});
  else
    run(std::integral_constant<int, kMaxRowPacks>{});
}

template <class T, bool kLayer>
void launch_backward(CudaOps& ops, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                     Tensor rstd, Tensor weight, int64_t N, int C, const char* op) {
  constexpr int V = 16 / sizeof(T);
  if (packs_fit(C, V, {dinp, dout, inp, weight}))
    launch_backward_packs<T, V, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, C, op);
  else
    launch_backward_packs<T, 1, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, C, op);
}

// Shapes shared by the four ops: inp (N,C) with C < 2^31 and N < 2^31 (one block per row).
RowsCols norm_dims(const char* op, const Tensor& inp) {
  const RowsCols rc = rows_cols(inp);
  MPIGPT_CHECK(rc.cols > 0 && rc.cols <= INT32_MAX && rc.rows < INT32_MAX, "{}: inp {} is not a usable (N, C)", op,
               inp.shape.str());
  return rc;
}

// The four forward ops. res and sum are the fused residual add
// (undefined for a plain norm), mean and bias are LayerNorm's (undefined for RMSNorm).
template <bool kLayer>
void forward_op(CudaOps& ops, const char* op, Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor res,
                Tensor sum, Tensor weight, Tensor bias, float eps) {
  const DType dt = out.dtype;
  const RowsCols rc = norm_dims(op, inp);
  const int64_t N = rc.rows, C = rc.cols;
  if (N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    launch_forward<T, kLayer>(ops.cuda_stream(), out, mean, rstd, inp, res, sum, weight, bias, eps, N, int(C));
  });
}

// The two backward ops. mean and dbias are LayerNorm's
// (undefined for RMSNorm).
template <bool kLayer>
void backward_op(CudaOps& ops, const char* op, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                 Tensor mean, Tensor rstd, Tensor weight) {
  const DType dt = dout.dtype;
  const RowsCols rc = norm_dims(op, inp);
  const int64_t N = rc.rows, C = rc.cols;
  if (N == 0 || (!dinp.defined() && !dweight.defined() && !dbias.defined())) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    launch_backward<T, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, int(C), op);
  });
}

}  // namespace

void CudaOps::layernorm_forward_impl(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                                     float eps) {
  // out (N,C), mean (N), rstd (N) optional f32, inp (N,C), weight (C), bias (C) optional
  forward_op<true>(*this, "layernorm_forward", out, mean, rstd, inp, Tensor(), Tensor(), weight, bias, eps);
}

void CudaOps::residual_layernorm_forward_impl(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                              Tensor weight, Tensor bias, float eps) {
  // sum (N,C) = a + b (may alias either), then layernorm_forward of sum; one kernel
  forward_op<true>(*this, "residual_layernorm_forward", out, mean, rstd, a, b, sum, weight, bias, eps);
}

void CudaOps::layernorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                                      Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) += f32, dbias (C) += f32; dout, inp (N,C); mean, rstd (N) f32; weight (C)
  backward_op<true>(*this, "layernorm_backward", dinp, dweight, dbias, dout, inp, mean, rstd, weight);
}

void CudaOps::rmsnorm_forward_impl(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) {
  // out (N,C) = inp * rstd * weight, rstd (N) optional f32, inp (N,C), weight (C)
  forward_op<false>(*this, "rmsnorm_forward", out, Tensor(), rstd, inp, Tensor(), Tensor(), weight, Tensor(), eps);
}

void CudaOps::residual_rmsnorm_forward_impl(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                            float eps) {
  // sum (N,C) = a + b (may alias either), then rmsnorm_forward of sum; one kernel
  forward_op<false>(*this, "residual_rmsnorm_forward", out, Tensor(), rstd, a, b, sum, weight, Tensor(), eps);
}

void CudaOps::rmsnorm_backward_impl(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) += f32; dout, inp (N,C); rstd (N) f32; weight (C)
  backward_op<false>(*this, "rmsnorm_backward", dinp, dweight, Tensor(), dout, inp, Tensor(), rstd, weight);
}

}  // namespace mpigpt::cuda
