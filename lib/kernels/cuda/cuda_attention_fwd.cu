// CUDA backend: the fp32-FMA fused attention forward (FlashAttention-2 style; its layout is in
// cuda_attention_fma.cuh) and its launcher.
#include <cmath>

#include "lib/kernels/cuda/cuda_attention_fma.cuh"

namespace mpigpt::cuda::fma_attn {

namespace {

// ---- forward --------------------------------------------------------------------------------

// out (B,Tq,NH*HD), lse (B,NH,Tq) for the 64 queries [i0, i0+64) of head h, batch row b.
// grid (ceil(Tq/64), NH, B).
template <class T, int HDP, bool kCausal>
__global__ void __launch_bounds__(kThreads) attention_fwd_kernel(const Problem p) {
  constexpr int LD = HDP + 4, BC = kFwdCols, NC = BC / 8, NE = HDP / 8;
  extern __shared__ float4 attn_smem[];
  float* Qs = reinterpret_cast<float*>(attn_smem);
  float* KVs = Qs + kRows * LD;
  float* Pt = KVs + BC * LD;
  int* kpos_s = reinterpret_cast<int*>(Pt + BC * kXLD);
  int* kseg_s = kpos_s + BC;
  const int rg = threadIdx.x >> 3, cg = threadIdx.x & 7;
  const QueryTile<T> qt = query_tile<T, kRows, kCausal>(p);
  const int h = qt.h, b = qt.b, i0 = qt.i0;
  const T *K = qt.K, *V = qt.V;
  load_tile<HDP, kRows>(Qs, static_cast<const T*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * p.HD,
                        p.q_stride, i0, p.Tq, p.HD, p.vec);
  int qpos[4] = {}, qseg[4] = {};
  bool row_ok[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = i0 + rg * 4 + r;
    row_ok[r] = i < p.Tq;
    if constexpr (!kCausal) {
      if (row_ok[r]) {
        qpos[r] = p.qpos[int64_t(b) * p.Tq + i];
        qseg[r] = p.qseg[int64_t(b) * p.Tq + i];
      }
    }
  }
  float m[4], l[4], o[4][NE];  // running max (base 2), this lane's share of the running sum, output
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < NE; ++e) o[r][e] = 0.f;
  }
  const int kend = kCausal ? min(p.Tk, i0 + kRows) : p.Tk;  // causal: later keys are masked for every row
  for (int j0 = 0; j0 < kend; j0 += BC) {
    __syncthreads();  // the previous tile's readers of KVs, Pt and the key mask are done; Qs is loaded
    const uint32_t vis = visible_keys<kCausal, NC>(p, b, i0, j0, rg, cg, row_ok, qpos, qseg, kpos_s, kseg_s);
    if constexpr (!kCausal) {
      if (!__syncthreads_or(vis != 0)) continue;  // nothing visible in this tile (other documents, later positions)
    }
    load_tile<HDP, BC>(KVs, K, p.kv_stride, j0, p.Tk, p.HD, p.vec);
    __syncthreads();
    float s[4][NC];
    tile_dot<HDP, NC>(s, Qs, KVs, rg, cg);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        s[r][c] = (vis >> (r * NC + c)) & 1u ? s[r][c] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[r][c]);
      }
      const float mnew = fmaxf(m[r], max8(mx));
      const float base = mnew == -INFINITY ? 0.f : mnew;  // nothing visible yet: every term is exp2(-inf) = 0
      const float alpha = exp2f(m[r] - base);
      m[r] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        s[r][c] = exp2f(s[r][c] - base);
        sum += s[r][c];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int e = 0; e < NE; ++e) o[r][e] *= alpha;
    }
    store_transposed<NC>(Pt, s, rg, cg);
    __syncthreads();  // P^T is complete and nobody reads the keys any more
    load_tile<HDP, BC>(KVs, V, p.kv_stride, j0, p.Tk, p.HD, p.vec);
    __syncthreads();
    tile_accum<HDP, BC>(o, Pt, KVs, rg, cg);
  }
  const int64_t ldo = int64_t(p.NH) * p.HD;
  T* O = static_cast<T*>(p.out) + int64_t(b) * p.Tq * ldo + int64_t(h) * p.HD;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float sum = sum8(l[r]);  // every lane of the row group calls the shuffles
    const int i = i0 + rg * 4 + r;
    if (i >= p.Tq) continue;
    if (sum == 0.f) {  // no visible key: out 0 exactly (not 0 * whatever the values were)
#pragma unroll
      for (int e = 0; e < NE; ++e) o[r][e] = 0.f;
    }
    store_row<HDP>(O + int64_t(i) * ldo, o[r], sum > 0.f ? 1.f / sum : 0.f, cg, p.HD, p.vec, false);
    if (cg == 0) p.lse[(int64_t(b) * p.NH + h) * p.Tq + i] = sum > 0.f ? (m[r] + log2f(sum)) * kLn2 : -INFINITY;
  }
}

}  // namespace

void forward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  dispatch_float(dt, "attention", [&](auto tag) {
    using T = decltype(tag);
    dispatch_head_dim(p.HD, [&](auto hd) {
      constexpr int HDP = decltype(hd)::value;
      const dim3 grid(tiles(p.Tq, kRows), unsigned(p.NH), unsigned(p.B));
      launch(causal ? attention_fwd_kernel<T, HDP, true> : attention_fwd_kernel<T, HDP, false>, grid, fwd_smem<HDP>(),
             stream, p);
    });
  });
}

}  // namespace mpigpt::cuda::fma_attn
