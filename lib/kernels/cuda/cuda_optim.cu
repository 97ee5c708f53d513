// CUDA backend: the fused AdamW update (one launch for a flat range, or for all the runs of an
// optimizer step; 16-byte accesses where aligned) and the reductions that return a double to the
// host (sum of squares for the gradient norm, sum).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;  // stage-1 partial sums of the reductions

// ---- AdamW --------------------------------------------------------------------------------------

struct AdamArgs {
  float lr, beta1, beta2, eps, weight_decay, inv_bc1, inv_bc2, grad_scale;
};

// The same arithmetic as the CPU backend (nvcc may fuse multiply-adds, so the bits can differ by an
// ulp): g = grad * scale; m, v moments; p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p).
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, const AdamArgs& a) {
  const float gi = g * a.grad_scale;
  m = a.beta1 * m + (1.0f - a.beta1) * gi;
  v = a.beta2 * v + (1.0f - a.beta2) * gi * gi;
  const float denom = sqrtf(v * a.inv_bc2);
  p = p - a.lr * ((m * a.inv_bc1) / (denom + a.eps) + a.weight_decay * p);
}

// Elements [0, n) of one span of param, grad, m, v (f32), thread tid of nthreads: float4 packs when
// vec (every pointer 16-byte aligned), then the n % 4 (or, without vec, all n) one by one.
__device__ __forceinline__ void adam_span(float* __restrict__ param, const float* __restrict__ grad,
                                          float* __restrict__ m, float* __restrict__ v, int64_t n, bool vec,
                                          int64_t tid, int64_t nthreads, const AdamArgs& a) {
  int64_t first = 0;
  if (vec) {
    using P = Pack<float, 4>;
    const int64_t packs = n / 4;
    for (int64_t i = tid; i < packs; i += nthreads) {
      P pp = reinterpret_cast<P*>(param)[i], mm = reinterpret_cast<P*>(m)[i], vv = reinterpret_cast<P*>(v)[i];
      const P gg = reinterpret_cast<const P*>(grad)[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) adam_element(pp.v[j], gg.v[j], mm.v[j], vv.v[j], a);
      reinterpret_cast<P*>(param)[i] = pp;
      reinterpret_cast<P*>(m)[i] = mm;
      reinterpret_cast<P*>(v)[i] = vv;
    }
    first = packs * 4;
  }
  for (int64_t i = first + tid; i < n; i += nthreads) {
    float p = param[i], mi = m[i], vi = v[i];
    adam_element(p, grad[i], mi, vi, a);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
  }
}

// One flat range param, grad, m, v (n) over the whole grid.
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                             float* __restrict__ v, int64_t n, bool vec, AdamArgs a) {
  adam_span(param, grad, m, v, n, vec, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
            int64_t(gridDim.x) * blockDim.x, a);
}

// adamw_runs: the runs cut into chunks of at most kAdamChunk elements, one block each. A chunk is
// elements [p, p + n) of param and grad and [s, s + n) of m and v, with weight decay wd.
constexpr int64_t kAdamChunk = 16384;
struct AdamChunk {
  int64_t p, s;
  int32_t n;
  float wd;
};
__global__ void adamw_chunks_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ m,
                                    float* __restrict__ v, const AdamChunk* __restrict__ chunks, bool bases16,
                                    AdamArgs a) {
  const AdamChunk c = chunks[blockIdx.x];
  a.weight_decay = c.wd;
  adam_span(param + c.p, grad + c.p, m + c.s, v + c.s, c.n, bases16 && c.p % 4 == 0 && c.s % 4 == 0, threadIdx.x,
            blockDim.x, a);
}

// ---- reductions ---------------------------------------------------------------------------------
// Two stages, with a block count that depends only on the element count and a fixed combining
// order, so they give the same bits on every run.

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// The block's total in thread 0 (fixed tree order).
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double sh[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum(lane < nwarps ? sh[lane] : 0.0);
  return v;
}

// partial[block] = sum over this block's grid-stride share of x (or x^2), in double.
template <class T, int W, bool kSquare>
__global__ void reduce_stage1_kernel(double* __restrict__ partial, const T* __restrict__ x, int64_t n) {
  const int64_t packs = n / W, tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0.0;
  for (int64_t i = tid; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T, W> p = reinterpret_cast<const Pack<T, W>*>(x)[i];
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const double d = double(to_f(p.v[j]));
      acc += kSquare ? d * d : d;
    }
  }
  const int64_t tail = n - packs * W;
  if (tid < tail) {
    const double d = double(to_f(x[packs * W + tid]));
    acc += kSquare ? d * d : d;
  }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// *result = sum of partial[0:G) (one block).
__global__ void reduce_stage2_kernel(double* __restrict__ result, const double* __restrict__ partial, int G) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < G; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) *result = acc;
}

template <bool kSquare>
double reduce(CudaOps& ops, Tensor t, const char* op) {
  const int64_t n = t.numel();
  if (n == 0) return 0.0;
  cudaStream_t s = ops.cuda_stream();
  // Stage-1 blocks: ~32 elements per thread, at most kMaxBlocks; a function of n only (determinism).
  const int G = int(std::clamp<int64_t>((n + kThreads * 32 - 1) / (kThreads * 32), 1, kMaxBlocks));
  CudaOps::Scratch scratch = ops.scratch(size_t(G + 1) * sizeof(double));
  double* partial = static_cast<double*>(scratch.ptr);
  dispatch_float(t.dtype, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    if (aligned16(t.ptr))
      reduce_stage1_kernel<T, W, kSquare><<<G, kThreads, 0, s>>>(partial, ptr<T>(t), n);
    else
      reduce_stage1_kernel<T, 1, kSquare><<<G, kThreads, 0, s>>>(partial, ptr<T>(t), n);
    MPIGPT_CUDA_LAUNCHED();
  });
  reduce_stage2_kernel<<<1, 1024, 0, s>>>(partial + G, partial, G);
  MPIGPT_CUDA_LAUNCHED();
  double* host = ops.host_result();
  MPIGPT_CUDA(cudaMemcpyAsync(host, partial + G, sizeof(double), cudaMemcpyDeviceToHost, s));
  wait_for_stream(s, "a reduction whose result the host reads");
  return host[0];
}

}  // namespace

namespace {

AdamArgs adam_args(float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step, float grad_scale) {
  return AdamArgs{lr,
                  beta1,
                  beta2,
                  eps,
                  weight_decay,
                  float(1.0 / (1.0 - std::pow(double(beta1), double(step)))),
                  float(1.0 / (1.0 - std::pow(double(beta2), double(step)))),
                  grad_scale};
}

}  // namespace

void CudaOps::adamw_impl(Tensor param, Tensor grad, Tensor m, Tensor v, float lr, float beta1, float beta2, float eps,
                         float weight_decay, int64_t step, float grad_scale) {
  // param, grad, m, v (n) f32: the same flat range; one pass reads all four and writes three
  const int64_t n = param.numel();
  const AdamArgs a = adam_args(lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  if (n == 0) return;
  const bool vec = aligned16(param.ptr) && aligned16(grad.ptr) && aligned16(m.ptr) && aligned16(v.ptr);
  const int64_t work = vec ? n / 4 : n;
  const unsigned blocks = unsigned(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, 1 << 20));
  adamw_kernel<<<blocks, kThreads, 0, cuda_stream()>>>(ptr<float>(param), ptr<float>(grad), ptr<float>(m),
                                                       ptr<float>(v), n, vec, a);
  MPIGPT_CUDA_LAUNCHED();
}

// The chunk table of each run list adamw_runs has met, on the device: the optimizer passes the
// same runs every step, so the table is built and uploaded once. Bounded like the matmul plans.
struct CudaOps::AdamTables {
  struct Table {
    void* chunks = nullptr;
    int64_t count = 0;
  };
  static constexpr size_t kMaxTables = 16;
  CudaOps* ops = nullptr;
  std::map<std::vector<int64_t>, Table> tables;
  void clear() {  // blocks go back to the stream-ordered allocator: kernels queued before still see them
    for (auto& [key, t] : tables)
      if (t.chunks) ops->release(t.chunks);
    tables.clear();
  }
  ~AdamTables() { clear(); }
};

CudaOps::AdamTables& CudaOps::adam_tables() {
  if (!adam_tables_) {
    adam_tables_ = {new AdamTables, [](AdamTables* t) { delete t; }};
    adam_tables_->ops = this;
  }
  return *adam_tables_;
}

void CudaOps::adamw_runs_impl(Tensor param, Tensor grad, Tensor m, Tensor v, const std::vector<AdamWRun>& runs,
                              float lr,
                              float beta1, float beta2, float eps, int64_t step, float grad_scale) {
  const AdamArgs a = adam_args(lr, beta1, beta2, eps, 0.0f, step, grad_scale);
  std::vector<int64_t> key;
  key.reserve(runs.size() * 4);
  for (const AdamWRun& r : runs) {
    uint32_t wd_bits = 0;
    std::memcpy(&wd_bits, &r.weight_decay, sizeof wd_bits);
    key.insert(key.end(), {r.begin, r.count, r.state, int64_t(wd_bits)});
  }
  AdamTables& cache = adam_tables();
  auto it = cache.tables.find(key);
  if (it == cache.tables.end()) {
    std::vector<AdamChunk> chunks;
    for (const AdamWRun& r : runs)
      for (int64_t k = 0; k < r.count; k += kAdamChunk)
        chunks.push_back({r.begin + k, r.state + k, int32_t(std::min(kAdamChunk, r.count - k)), r.weight_decay});
    MPIGPT_CHECK(chunks.size() <= size_t(INT32_MAX), "adamw_runs: {} chunks exceed the grid", chunks.size());
    if (cache.tables.size() >= AdamTables::kMaxTables) cache.clear();
    AdamTables::Table t;
    t.count = int64_t(chunks.size());
    if (!chunks.empty()) {
      const size_t bytes = chunks.size() * sizeof(AdamChunk);
      t.chunks = allocate_uninitialised(bytes);
      // Pageable source: the copy has finished reading it when cudaMemcpyAsync returns.
      MPIGPT_CUDA(cudaMemcpyAsync(t.chunks, chunks.data(), bytes, cudaMemcpyHostToDevice, cuda_stream()));
    }
    it = cache.tables.emplace(std::move(key), t).first;
  }
  const AdamTables::Table& t = it->second;
  if (t.count == 0) return;
  const bool bases16 = aligned16(param.ptr) && aligned16(grad.ptr) && aligned16(m.ptr) && aligned16(v.ptr);
  adamw_chunks_kernel<<<unsigned(t.count), kThreads, 0, cuda_stream()>>>(
      ptr<float>(param), ptr<float>(grad), ptr<float>(m), ptr<float>(v), static_cast<const AdamChunk*>(t.chunks),
      bases16, a);
  MPIGPT_CUDA_LAUNCHED();
}

double CudaOps::sum_squares_impl(Tensor t) { return reduce<true>(*this, t, "sum_squares"); }

double CudaOps::sum_impl(Tensor t) { return reduce<false>(*this, t, "sum"); }

}  // namespace mpigpt::cuda
