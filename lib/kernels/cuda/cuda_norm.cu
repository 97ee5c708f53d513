// CUDA backend: LayerNorm and RMSNorm forward/backward. One block per row, fp32 statistics; the
// weight/bias gradients go through per-block partial sums (shared memory, then an F32 scratch row
// per block) that a second kernel adds in a fixed order: no float atomics, so the gradients are
// the same bits on every run on a given GPU model.
#include <algorithm>
#include <cstdint>

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

// Block b takes rows [b*rows_per_block, ...) in order. Per row: dinp (ACCUMULATES) from the two
// row means of dnorm = weight*dout and dnorm*xhat; the weight (and, for LayerNorm, bias) gradient
// terms dout*xhat and dout go into shared accumulators acc[0:C) and acc[C:2C). A thread always
// owns the same columns (pack p = threadIdx.x + k*blockDim.x in every row), so the accumulators
// need neither atomics nor barriers. At the end each block writes its accumulators to its own row
// of `partial` (G, nacc*C), which column_sum_kernel reduces in block order.
template <class T, int W, bool kLayer>
__global__ void norm_backward_kernel(T* dinp, float* __restrict__ partial, const T* dout, const T* inp,
                                     const float* __restrict__ mean, const float* __restrict__ rstd,
                                     const T* __restrict__ weight, int64_t N, int C, int64_t rows_per_block) {
  extern __shared__ float4 acc_raw[];  // nacc * C floats when partial is wanted (16-byte aligned)
  float* acc = reinterpret_cast<float*>(acc_raw);
  __shared__ float sh[32];
  constexpr int nacc = kLayer ? 2 : 1;
  const int P = C / W;
  if (partial)
    for (int p = threadIdx.x; p < P; p += blockDim.x)
      for (int j = 0; j < nacc * W; ++j) acc[(j / W) * C + p * W + j % W] = 0.0f;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r1 = r0 + rows_per_block < N ? r0 + rows_per_block : N;
  for (int64_t row = r0; row < r1; ++row) {
    const T* g = dout + row * C;
    const T* x = inp + row * C;
    const float m = kLayer ? mean[row] : 0.0f, rs = rstd[row];
    float a = 0.0f, b = 0.0f;  // sums of dnorm and dnorm * xhat
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const Pack<T, W> gv = load_pack<W>(g + p * W), xv = load_pack<W>(x + p * W), wv = load_pack<W>(weight + p * W);
      float gw[W], gb[W];
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float gj = to_f(gv.v[j]), xh = (to_f(xv.v[j]) - m) * rs, dn = to_f(wv.v[j]) * gj;
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
    if (!dinp) continue;  // uniform over the block: the barriers below are all skipped together
    const float ma = kLayer ? block_sum(a, sh) / float(C) : 0.0f;
    const float mb = block_sum(b, sh) / float(C);
    T* d = dinp + row * C;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      // dout and inp are read again (L1/L2) before dinp is written: dinp may even alias dout.
      const Pack<T, W> gv = load_pack<W>(g + p * W), xv = load_pack<W>(x + p * W), wv = load_pack<W>(weight + p * W);
      Pack<T, W> dv = load_pack<W>(d + p * W);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const float xh = (to_f(xv.v[j]) - m) * rs, dn = to_f(wv.v[j]) * to_f(gv.v[j]);
        dv.v[j] = from_f<T>(to_f(dv.v[j]) + (dn - ma - xh * mb) * rs);
      }
      store_pack<W>(d + p * W, dv);
    }
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

void check_like(const char* op, const Tensor& inp, const Tensor& t, const char* name) {
  MPIGPT_CHECK(!t.defined() || (t.numel() == inp.numel() && rows_cols(t).cols == rows_cols(inp).cols),
               "{}: {} {} must have the shape of inp {}", op, name, t.shape.str(), inp.shape.str());
}
void check_len(const char* op, const Tensor& t, const char* name, int64_t n, const Tensor& inp) {
  MPIGPT_CHECK(!t.defined() || t.numel() == n, "{}: {} {} must have {} elements (inp {})", op, name, t.shape.str(), n,
               inp.shape.str());
}
void check_f32_opt(const Tensor& t, const char* op, const char* what) {
  if (t.defined()) check_f32(t, op, what);
}

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

template <class T, int W, bool kLayer>
void launch_backward_w(CudaOps& ops, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                       Tensor rstd, Tensor weight, int64_t N, int C, const char* op) {
  cudaStream_t s = ops.cuda_stream();
  auto kernel = norm_backward_kernel<T, W, kLayer>;
  const int threads = threads_for(C / W);
  const bool want_params = dweight.defined() || dbias.defined();
  constexpr int nacc = kLayer ? 2 : 1;
  const size_t smem = want_params ? size_t(nacc) * size_t(C) * sizeof(float) : 0;
  int device_smem = 0, sms = 0;
  MPIGPT_CUDA(cudaDeviceGetAttribute(&device_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, ops.device_index()));
  MPIGPT_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ops.device_index()));
  MPIGPT_CHECK(smem + 32 * sizeof(float) <= size_t(device_smem),
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
  if (want_params) {
    column_sum_kernel<<<blocks_for(C, 32), dim3(32, 16), 0, s>>>(
        dweight.defined() ? ptr<float>(dweight) : nullptr, kLayer && dbias.defined() ? ptr<float>(dbias) : nullptr,
        part, G, C, nacc * C);
    MPIGPT_CUDA_LAUNCHED();
  }
}

template <class T, bool kLayer>
void launch_backward(CudaOps& ops, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                     Tensor rstd, Tensor weight, int64_t N, int C, const char* op) {
  constexpr int V = 16 / sizeof(T);
  if (packs_fit(C, V, {dinp, dout, inp, weight}))
    launch_backward_w<T, V, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, C, op);
  else
    launch_backward_w<T, 1, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, C, op);
}

// Shapes shared by the four ops: inp (N,C) with C < 2^31 and N < 2^31 (one block per row).
RowsCols norm_dims(const char* op, const Tensor& inp) {
  const RowsCols rc = rows_cols(inp);
  MPIGPT_CHECK(rc.cols > 0 && rc.cols <= INT32_MAX && rc.rows < INT32_MAX, "{}: inp {} is not a usable (N, C)", op,
               inp.shape.str());
  return rc;
}

// The four forward ops: their checks, then the kernel. res and sum are the fused residual add
// (undefined for a plain norm), mean and bias are LayerNorm's (undefined for RMSNorm).
template <bool kLayer>
void forward_op(CudaOps& ops, const char* op, Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor res,
                Tensor sum, Tensor weight, Tensor bias, float eps) {
  check_device(out, op, "out");
  check_device(inp, op, "inp");
  check_device_opt(res, op, "b");
  check_device_opt(sum, op, "sum");
  check_device(weight, op, "weight");
  check_device_opt(bias, op, "bias");
  check_f32_opt(mean, op, "mean");
  check_f32_opt(rstd, op, "rstd");
  const DType dt = data_dtype(
      op, {{"out", out}, {"inp", inp}, {"b", res}, {"sum", sum}, {"weight", weight}, {"bias", bias}});
  const RowsCols rc = norm_dims(op, inp);
  const int64_t N = rc.rows, C = rc.cols;
  check_like(op, inp, out, "out");
  check_like(op, inp, res, "b");
  check_like(op, inp, sum, "sum");
  MPIGPT_CHECK(res.defined() == sum.defined(), "{}: the residual add needs both b and sum", op);
  check_len(op, mean, "mean", N, inp);
  check_len(op, rstd, "rstd", N, inp);
  check_len(op, weight, "weight", C, inp);
  check_len(op, bias, "bias", C, inp);
  if (N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    launch_forward<T, kLayer>(ops.cuda_stream(), out, mean, rstd, inp, res, sum, weight, bias, eps, N, int(C));
  });
}

// The two backward ops: their checks, then the kernels. mean and dbias are LayerNorm's
// (undefined for RMSNorm).
template <bool kLayer>
void backward_op(CudaOps& ops, const char* op, Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                 Tensor mean, Tensor rstd, Tensor weight) {
  check_device_opt(dinp, op, "dinp");
  check_f32_opt(dweight, op, "dweight");
  check_f32_opt(dbias, op, "dbias");
  check_device(dout, op, "dout");
  check_device(inp, op, "inp");
  if (kLayer) check_f32(mean, op, "mean");
  check_f32(rstd, op, "rstd");
  check_device(weight, op, "weight");
  const DType dt = data_dtype(op, {{"dinp", dinp}, {"dout", dout}, {"inp", inp}, {"weight", weight}});
  const RowsCols rc = norm_dims(op, inp);
  const int64_t N = rc.rows, C = rc.cols;
  check_like(op, inp, dout, "dout");
  check_like(op, inp, dinp, "dinp");
  check_len(op, mean, "mean", N, inp);
  check_len(op, rstd, "rstd", N, inp);
  check_len(op, weight, "weight", C, inp);
  check_len(op, dweight, "dweight", C, inp);
  check_len(op, dbias, "dbias", C, inp);
  if (N == 0 || (!dinp.defined() && !dweight.defined() && !dbias.defined())) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    launch_backward<T, kLayer>(ops, dinp, dweight, dbias, dout, inp, mean, rstd, weight, N, int(C), op);
  });
}

}  // namespace

void CudaOps::layernorm_forward(Tensor out, Tensor mean, Tensor rstd, Tensor inp, Tensor weight, Tensor bias,
                                float eps) {
  // out (N,C), mean (N), rstd (N) optional f32, inp (N,C), weight (C), bias (C) optional
  forward_op<true>(*this, "layernorm_forward", out, mean, rstd, inp, Tensor(), Tensor(), weight, bias, eps);
}

void CudaOps::residual_layernorm_forward(Tensor sum, Tensor out, Tensor mean, Tensor rstd, Tensor a, Tensor b,
                                         Tensor weight, Tensor bias, float eps) {
  // sum (N,C) = a + b (may alias either), then layernorm_forward of sum; one kernel
  forward_op<true>(*this, "residual_layernorm_forward", out, mean, rstd, a, b, sum, weight, bias, eps);
}

void CudaOps::layernorm_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor mean,
                                 Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) += f32, dbias (C) += f32; dout, inp (N,C); mean, rstd (N) f32; weight (C)
  backward_op<true>(*this, "layernorm_backward", dinp, dweight, dbias, dout, inp, mean, rstd, weight);
}

void CudaOps::rmsnorm_forward(Tensor out, Tensor rstd, Tensor inp, Tensor weight, float eps) {
  // out (N,C) = inp * rstd * weight, rstd (N) optional f32, inp (N,C), weight (C)
  forward_op<false>(*this, "rmsnorm_forward", out, Tensor(), rstd, inp, Tensor(), Tensor(), weight, Tensor(), eps);
}

void CudaOps::residual_rmsnorm_forward(Tensor sum, Tensor out, Tensor rstd, Tensor a, Tensor b, Tensor weight,
                                       float eps) {
  // sum (N,C) = a + b (may alias either), then rmsnorm_forward of sum; one kernel
  forward_op<false>(*this, "residual_rmsnorm_forward", out, Tensor(), rstd, a, b, sum, weight, Tensor(), eps);
}

void CudaOps::rmsnorm_backward(Tensor dinp, Tensor dweight, Tensor dout, Tensor inp, Tensor rstd, Tensor weight) {
  // dinp (N,C) +=, dweight (C) += f32; dout, inp (N,C); rstd (N) f32; weight (C)
  backward_op<false>(*this, "rmsnorm_backward", dinp, dweight, Tensor(), dout, inp, Tensor(), rstd, weight);
}

}  // namespace mpigpt::cuda
