// CUDA backend: mixture-of-experts router (softmax or sigmoid, top-k, gates, log-sum-exp) and its
// backward, and the weighted combine of routed rows back into tokens with its backward;
// grouped_linear lives with the other GEMMs in cuda_matmul.cu.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kMaxExperts = 256;
constexpr int kPerLane = kMaxExperts / 32;
constexpr int kRouterWarps = 4;  // rows per 128-thread block
constexpr int kThreads = 256;

// Softmax statistics of one row held as x[k] = logit of expert lane + 32k (-inf past E): the row
// max m and sum of e^(x - m), the same in every lane. Accurate expf: the router is tiny.
__device__ __forceinline__ void row_softmax_stats(const float (&x)[kPerLane], float& m, float& s) {
  m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) m = fmaxf(m, x[k]);
  m = warp_max(m);
  s = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) s += x[k] == -INFINITY ? 0.0f : expf(x[k] - m);
  s = warp_sum(s);
}

// ---- router forward -----------------------------------------------------------------------------

// probs (N,E), topk (N,K) i32, gates (N,K), lse (N) optional; logits (N,E). One warp per row.
// Top-k: K rounds of a warp arg-max over the not-yet-taken probs, on the stored float values (as
// the CPU backend), ordered by (value descending, expert ascending): ties go to the lower index.
template <class T>
__global__ void router_forward_kernel(float* __restrict__ probs, int32_t* __restrict__ topk, float* gates,
                                      float* __restrict__ lse, const T* __restrict__ logits, int64_t N, int E, int K,
                                      bool sigmoid, bool normalize) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kRouterWarps + (threadIdx.x >> 5);
  if (row >= N) return;  // whole warps leave together; no block barriers below
  const T* xr = logits + row * E;
  float x[kPerLane], p[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int e = lane + 32 * k;
    x[k] = e < E ? to_f(xr[e]) : -INFINITY;
  }
  float m, s;
  row_softmax_stats(x, m, s);
  if (lse && lane == 0) lse[row] = m + logf(s);
  float* pr = probs + row * E;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int e = lane + 32 * k;
    p[k] = sigmoid ? 1.0f / (1.0f + expf(-x[k])) : expf(x[k] - m) / s;
    if (e < E) pr[e] = p[k];
  }
  unsigned taken = 0;  // bit k: expert lane + 32k already chosen
  float total = 0.0f;
  int32_t* tr = topk + row * K;
  float* gr = gates + row * K;
  for (int r = 0; r < K; ++r) {
    float bv = -INFINITY;
    int be = INT_MAX;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {  // experts ascend with k: strict > keeps the lower index
      const int e = lane + 32 * k;
      if (e < E && !(taken >> k & 1u) && (p[k] > bv || be == INT_MAX)) {
        bv = p[k];
        be = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {  // a total order, so every lane ends with the same winner
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (oe != INT_MAX && (be == INT_MAX || ov > bv || (ov == bv && oe < be))) {
        bv = ov;
        be = oe;
      }
    }
    if ((be & 31) == lane) taken |= 1u << (be >> 5);
    if (lane == 0) {
      tr[r] = be;
      gr[r] = bv;
    }
    total += bv;
  }
  if (normalize) {
    __syncwarp();  // lane 0's gate stores are visible to the other lanes
    for (int r = lane; r < K; r += 32) gr[r] = gr[r] / total;
  }
}

// ---- router backward ----------------------------------------------------------------------------

// dlogits (N,E) OVERWRITTEN from dgates (N,K), dprobs (N,E) optional, dlse (N) optional; logits,
// probs, topk as the forward left them. One warp per row; dL/dprobs is gathered in shared memory
// (the K gate terms land on distinct experts, so the lanes never collide).
template <class T>
__global__ void router_backward_kernel(T* __restrict__ dlogits, const float* __restrict__ dgates,
                                       const float* __restrict__ dprobs, const float* __restrict__ dlse,
                                       const T* __restrict__ logits, const float* __restrict__ probs,
                                       const int32_t* __restrict__ topk, int64_t N, int E, int K, bool sigmoid,
                                       bool normalize) {
  __shared__ float dp_all[kRouterWarps][kMaxExperts];
  const int lane = threadIdx.x & 31;
  float* dp_s = dp_all[threadIdx.x >> 5];
  const int64_t row = int64_t(blockIdx.x) * kRouterWarps + (threadIdx.x >> 5);
  if (row >= N) return;
  const float* pr = probs + row * E;
  float p[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int e = lane + 32 * k;
    p[k] = e < E ? pr[e] : 0.0f;
    if (e < E) dp_s[e] = dprobs ? dprobs[row * E + e] : 0.0f;
  }
  __syncwarp();
  const int32_t* idx = topk + row * K;
  const float* dg = dgates + row * K;
  if (normalize) {
    // g_k = p_k / S with S = sum_j p_j over the chosen: dL/dp_k = (dg_k - sum_j dg_j g_j) / S.
    float S = 0.0f, dot = 0.0f;
    for (int r = lane; r < K; r += 32) {
      const int e = idx[r];
      const float pe = e >= 0 && e < E ? pr[e] : 0.0f;
      S += pe;
      dot += dg[r] * pe;
    }
    S = warp_sum(S);
    dot = warp_sum(dot) / S;
    for (int r = lane; r < K; r += 32) {
      const int e = idx[r];
      if (e >= 0 && e < E) dp_s[e] += (dg[r] - dot) / S;
    }
  } else {
    for (int r = lane; r < K; r += 32) {
      const int e = idx[r];
      if (e >= 0 && e < E) dp_s[e] += dg[r];
    }
  }
  __syncwarp();
  float dp[kPerLane], dl[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int e = lane + 32 * k;
    dp[k] = e < E ? dp_s[e] : 0.0f;
  }
  if (sigmoid) {
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dl[k] = dp[k] * p[k] * (1.0f - p[k]);
  } else {
    float sp = 0.0f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) sp += p[k] * dp[k];
    sp = warp_sum(sp);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dl[k] = p[k] * (dp[k] - sp);
  }
  if (dlse) {
    // d lse / d logits = softmax(logits), recomputed from the logits (also for a sigmoid router).
    float x[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int e = lane + 32 * k;
      x[k] = e < E ? to_f(logits[row * E + e]) : -INFINITY;
    }
    float m, s;
    row_softmax_stats(x, m, s);
    const float dz = dlse[row];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k)
      if (x[k] != -INFINITY) dl[k] += dz * (expf(x[k] - m) / s);
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int e = lane + 32 * k;
    if (e < E) dlogits[row * E + e] = from_f<T>(dl[k]);
  }
}

// ---- combine ------------------------------------------------------------------------------------
// moe_combine adds up to K routed rows into each token row. Rather than atomics, it inverts the
// (distinct) slots into a (N*K) map from slot to routed row and lets one thread own each output
// element: no races, one rounding per element, and the same bits on every run.

// inv (N*K), preset to -1: inv[slot[i]] = i.
__global__ void invert_slots_kernel(int32_t* __restrict__ inv, const int32_t* __restrict__ slot, int64_t M,
                                    int64_t NK) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M) return;
  const int64_t s = slot[i];
  if (s >= 0 && s < NK) inv[s] = int32_t(i);
}

// out (N,C) ACCUMULATES sum_k gates[n,k] * rows[inv[n*K+k]] over the k that received a row; one
// thread per pack of W channels, summing in fp32 in k order and rounding once.
template <class T, int W>
__global__ void combine_kernel(T* out, const T* __restrict__ rows, const int32_t* __restrict__ inv,
                               const float* __restrict__ gates, int64_t N, int64_t C, int K) {
  const int64_t PC = C / W, total = N * PC;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = t / PC, c = (t - n * PC) * W;
    const int32_t* in = inv + n * K;
    bool any = false;
    for (int k = 0; k < K; ++k) any |= in[k] >= 0;
    if (!any) continue;  // a token no routed row returns to: out untouched
    T* o = out + n * C + c;
    const Pack<T, W> ov = load_pack<W>(o);
    float acc[W];
#pragma unroll
    for (int j = 0; j < W; ++j) acc[j] = to_f(ov.v[j]);
    for (int k = 0; k < K; ++k) {
      const int32_t i = in[k];
      if (i < 0) continue;
      const float g = gates[n * K + k];
      const Pack<T, W> rv = load_pack<W>(rows + int64_t(i) * C + c);
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] += g * to_f(rv.v[j]);
    }
    Pack<T, W> r;
#pragma unroll
    for (int j = 0; j < W; ++j) r.v[j] = from_f<T>(acc[j]);
    store_pack<W>(o, r);
  }
}

// drows (M,C)[i] = gates.flat[s] * dout[s/K] (OVERWRITTEN, optional); dgates.flat[s] =
// dout[s/K] . rows[i] (optional) with s = slot[i]. One warp per routed row. A slot outside
// [0, N*K) (a caller bug the CPU backend reports) gives a NaN drows row and no dgates write.
template <class T, int W>
__global__ void combine_backward_kernel(T* __restrict__ drows, float* __restrict__ dgates, const T* __restrict__ dout,
                                        const T* __restrict__ rows, const int32_t* __restrict__ slot,
                                        const float* __restrict__ gates, int64_t M, int64_t C, int K, int64_t NK) {
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (i >= M) return;
  const int64_t s = slot[i], P = C / W;
  if (s < 0 || s >= NK) {
    if (drows) {
      Pack<T, W> z;
#pragma unroll
      for (int j = 0; j < W; ++j) z.v[j] = from_f<T>(__int_as_float(0x7fc00000));
      for (int64_t p = lane; p < P; p += 32) store_pack<W>(drows + i * C + p * W, z);
    }
    return;
  }
  const T* d = dout + (s / K) * C;
  const float g = gates[s];
  float dot = 0.0f;
  for (int64_t p = lane; p < P; p += 32) {
    const Pack<T, W> dv = load_pack<W>(d + p * W);
    if (drows) {
      Pack<T, W> o;
#pragma unroll
      for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(g * to_f(dv.v[j]));
      store_pack<W>(drows + i * C + p * W, o);
    }
    if (dgates) {
      const Pack<T, W> rv = load_pack<W>(rows + i * C + p * W);
#pragma unroll
      for (int j = 0; j < W; ++j) dot += to_f(dv.v[j]) * to_f(rv.v[j]);
    }
  }
  if (dgates) {
    dot = warp_sum(dot);
    if (lane == 0) dgates[s] = dot;
  }
}

// ---- host side ----------------------------------------------------------------------------------

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20)); }

// The CUDA router's limit: E experts in registers (at most 8 per lane of one warp).
void check_experts(const char* op, const Tensor& logits) {
  const RowsCols ml = rows_cols(logits);
  MPIGPT_CHECK(ml.cols <= kMaxExperts, "{}: logits {} have E = {} experts; the CUDA router handles at most {}", op,
               logits.shape.str(), ml.cols, kMaxExperts);
}

// The combine's slots index gates (N,K) and rows (M,C) in i32.
void check_slot_range(const char* op, const Tensor& rows, const Tensor& gates) {
  MPIGPT_CHECK(gates.numel() < INT32_MAX && rows_cols(rows).rows < INT32_MAX,
               "{}: rows {} or gates {} too large for i32 slots", op, rows.shape.str(), gates.shape.str());
}

}  // namespace

void CudaOps::moe_router_forward_impl(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                                      bool normalize) {
  // probs (N,E) f32, topk (N,K) i32, gates (N,K) f32, lse (N) f32 optional; logits (N,E)
  const char* op = "moe_router_forward";
  const DType dt = logits.dtype;
  check_experts(op, logits);
  const int64_t N = rows_cols(logits).rows;
  const int E = int(rows_cols(logits).cols), K = int(rows_cols(topk).cols);
  if (N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    router_forward_kernel<T><<<unsigned((N + kRouterWarps - 1) / kRouterWarps), 32 * kRouterWarps, 0, cuda_stream()>>>(
        ptr<float>(probs), ptr<int32_t>(topk), ptr<float>(gates), lse.defined() ? ptr<float>(lse) : nullptr,
        ptr<T>(logits), N, E, K, sigmoid, normalize);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::moe_router_backward_impl(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits,
                                       Tensor probs, Tensor topk, bool sigmoid, bool normalize) {
  // dlogits (N,E) overwritten; dgates (N,K) f32; dprobs (N,E) f32 optional; dlse (N) f32 optional;
  // logits (N,E), probs (N,E) f32, topk (N,K) i32 from the forward
  const char* op = "moe_router_backward";
  const DType dt = dlogits.dtype;
  check_experts(op, logits);
  const int64_t N = rows_cols(logits).rows;
  const int E = int(rows_cols(logits).cols), K = int(rows_cols(topk).cols);
  if (N == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    router_backward_kernel<T><<<unsigned((N + kRouterWarps - 1) / kRouterWarps), 32 * kRouterWarps, 0, cuda_stream()>>>(
        ptr<T>(dlogits), ptr<float>(dgates), dprobs.defined() ? ptr<float>(dprobs) : nullptr,
        dlse.defined() ? ptr<float>(dlse) : nullptr, ptr<T>(logits), ptr<float>(probs), ptr<int32_t>(topk), N, E, K,
        sigmoid, normalize);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::moe_combine_impl(Tensor out, Tensor rows, Tensor slot, Tensor gates) {
  // out (N,C)[slot/K] += gates.flat[slot] * rows (M,C)[i]; slot (M) i32 distinct; gates (N,K) f32
  const char* op = "moe_combine";
  const DType dt = out.dtype;
  check_slot_range(op, rows, gates);
  const int64_t N = rows_cols(out).rows, C = rows_cols(out).cols, M = rows_cols(rows).rows, NK = gates.numel();
  const int K = int(rows_cols(gates).cols);
  if (M == 0 || C == 0 || N == 0) return;
  Scratch inv = scratch(size_t(NK) * sizeof(int32_t));
  int32_t* I = static_cast<int32_t*>(inv.ptr);
  MPIGPT_CUDA(cudaMemsetAsync(I, 0xff, size_t(NK) * sizeof(int32_t), cuda_stream()));  // all -1
  invert_slots_kernel<<<blocks_for(M, kThreads), kThreads, 0, cuda_stream()>>>(I, ptr<int32_t>(slot), M, NK);
  MPIGPT_CUDA_LAUNCHED();
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (C % V == 0 && aligned16(out) && aligned16(rows))
      combine_kernel<T, V><<<grid_for(N * C / V), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(rows), I,
                                                                                ptr<float>(gates), N, C, K);
    else
      combine_kernel<T, 1>
          <<<grid_for(N * C), kThreads, 0, cuda_stream()>>>(ptr<T>(out), ptr<T>(rows), I, ptr<float>(gates), N, C, K);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::moe_combine_backward_impl(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                        Tensor gates) {
  // drows (M,C) = gates.flat[slot] * dout[slot/K] (optional); dgates.flat[slot] = dout[slot/K] . rows[i]
  // (f32, optional, needs rows); dout (N,C), rows (M,C), slot (M) i32, gates (N,K) f32
  const char* op = "moe_combine_backward";
  const DType dt = dout.dtype;
  check_slot_range(op, drows.defined() ? drows : rows, gates);
  const int64_t M = slot.numel(), C = rows_cols(dout).cols, NK = gates.numel();
  const int K = int(rows_cols(gates).cols);
  if (M == 0 || (!drows.defined() && !dgates.defined())) return;
  constexpr int kWarps = kThreads / 32;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    T* dR = drows.defined() ? ptr<T>(drows) : nullptr;
    float* dG = dgates.defined() ? ptr<float>(dgates) : nullptr;
    const T* R = rows.defined() ? ptr<T>(rows) : nullptr;
    const unsigned blocks = unsigned((M + kWarps - 1) / kWarps);
    if (C % V == 0 && aligned16(drows) && aligned16(dout) && aligned16(rows))
      combine_backward_kernel<T, V><<<blocks, kThreads, 0, cuda_stream()>>>(dR, dG, ptr<T>(dout), R, ptr<int32_t>(slot),
                                                                            ptr<float>(gates), M, C, K, NK);
    else
      combine_backward_kernel<T, 1><<<blocks, kThreads, 0, cuda_stream()>>>(dR, dG, ptr<T>(dout), R, ptr<int32_t>(slot),
                                                                            ptr<float>(gates), M, C, K, NK);
    MPIGPT_CUDA_LAUNCHED();
  });
}

}  // namespace mpigpt::cuda
