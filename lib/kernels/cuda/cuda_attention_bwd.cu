// CUDA backend: the fp32-FMA fused attention backward: the rowsum(dout * out) preprocessing, the dQ
// kernel and the dK/dV kernel, and their launchers.
#include <cmath>

#include "lib/kernels/cuda/cuda_attention_fma.cuh"

namespace mpigpt::cuda::fma_attn {

namespace {

// ---- backward ---------------------------------------------------------------------------------
// D = rowsum(dout * out) first; then one kernel per query tile accumulates dQ over the key tiles
// and one kernel per key tile accumulates dK and dV over the query tiles of all the query heads of
// its kv head. Both recompute the scores and dP (7 tile products instead of FlashAttention-2's 5)
// in exchange for no atomics and no fp32 dQ scratch: every gradient element is summed by one thread
// in a fixed order, so the backward is deterministic, and the blockwise backward can accumulate
// straight into dqkv and dkv. (A dQ fused into the dK/dV kernel, 5 products, its shares summed in a
// fixed order through an fp32 scratch, measured slower on an H200 at T 1024-2048:
// docs/performance.md.)

// D (B,NH,Tq) = rowsum(dout * out) per query head: one warp per (b, i, h).
template <class T>
__global__ void attention_rowdot_kernel(const Problem p) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= int64_t(p.B) * p.Tq * p.NH) return;  // whole warps only
  const int64_t bi = w / p.NH, h = w % p.NH;  // bi = b*Tq + i
  const int64_t off = bi * p.NH * p.HD + h * p.HD;
  const T* o = static_cast<const T*>(p.out) + off;
  const T* d = static_cast<const T*>(p.dout) + off;
  float s = 0.f;
  for (int e = lane; e < p.HD; e += 32) s += to_f(o[e]) * to_f(d[e]);
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) s += __shfl_xor_sync(0xffffffffu, s, k);
  if (lane == 0) p.D[(bi / p.Tq * p.NH + h) * p.Tq + bi % p.Tq] = s;
}

// The same for bf16 with 16-byte loads: G = HD/8 lanes per row (a power of two up to 32, so a
// row's lanes share a warp), rows in D's order (b, h, i) so that the stores are coalesced. A row of
// out/dout is one contiguous HD*2-byte segment. The one-warp-per-row kernel above moves 2 bytes per
// lane per load: on an H200 it took 0.181 ms for the GPT-2 124M shape (B 64, 12 heads, T 1024,
// 200 MB read), this one 0.052 ms (0.113 -> 0.066 at the 1.3B shape, 0.122 -> 0.036 at Llama 1B).
template <int G>
__global__ void attention_rowdot_bf16_kernel(const Problem p) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = idx / G;  // (b*NH + h)*Tq + i
  const int c = int(idx % G);
  float s = 0.f;
  if (row < int64_t(p.B) * p.NH * p.Tq) {
    const int64_t i = row % p.Tq, bh = row / p.Tq, b = bh / p.NH, h = bh % p.NH;
    const int64_t off = ((b * p.Tq + i) * p.NH + h) * p.HD + c * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.out) + off);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.dout) + off);
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 x = __bfloat1622float2(o2[e]), y = __bfloat1622float2(d2[e]);
      s += x.x * y.x + x.y * y.y;
    }
  }
#pragma unroll
  for (int k = G / 2; k > 0; k >>= 1) s += __shfl_xor_sync(0xffffffffu, s, k);
  if (c == 0 && row < int64_t(p.B) * p.NH * p.Tq) p.D[row] = s;
}

template <int G>
void rowdot_bf16(const Problem& p, cudaStream_t stream) {
  const int64_t threads = int64_t(p.B) * p.NH * p.Tq * G;
  attention_rowdot_bf16_kernel<G><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

// dq (=, or += when accumulating) for the 64 queries [i0, i0+64) of head h: sum over the visible
// keys of dS K / sqrt(HD), dS = P (dO.v - D), P = exp(q.k / sqrt(HD) - lse). grid (ceil(Tq/64), NH, B).
template <class T, int HDP, bool kCausal>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const Problem p) {
  constexpr int LD = HDP + 4, BC = kBwdCols, NC = BC / 8, NE = HDP / 8;
  extern __shared__ float4 attn_smem[];
  float* Qs = reinterpret_cast<float*>(attn_smem);
  float* dOs = Qs + kRows * LD;
  float* KVs = dOs + kRows * LD;
  float* Xt = KVs + BC * LD;
  int* kpos_s = reinterpret_cast<int*>(Xt + BC * kXLD);
  int* kseg_s = kpos_s + BC;
  const int rg = threadIdx.x >> 3, cg = threadIdx.x & 7;
  const QueryTile<T> qt = query_tile<T, kRows, kCausal>(p);
  const int h = qt.h, b = qt.b, i0 = qt.i0;
  const T *K = qt.K, *V = qt.V;
  const int64_t ldo = int64_t(p.NH) * p.HD;
  load_tile<HDP, kRows>(Qs, static_cast<const T*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * p.HD,
                        p.q_stride, i0, p.Tq, p.HD, p.vec);
  load_tile<HDP, kRows>(dOs, static_cast<const T*>(p.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * p.HD, ldo, i0,
                        p.Tq, p.HD, p.vec);
  int qpos[4] = {}, qseg[4] = {};
  float lse2[4], Dr[4];
  bool row_ok[4];  // a real query with some visible key somewhere (a -inf lse gets no gradient)
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = i0 + rg * 4 + r;
    const int64_t row = (int64_t(b) * p.NH + h) * p.Tq + i;
    lse2[r] = i < p.Tq ? p.lse[row] * kLog2e : -INFINITY;
    Dr[r] = i < p.Tq ? p.D[row] : 0.f;
    row_ok[r] = lse2[r] != -INFINITY;
    if constexpr (!kCausal) {
      if (i < p.Tq) {
        qpos[r] = p.qpos[int64_t(b) * p.Tq + i];
        qseg[r] = p.qseg[int64_t(b) * p.Tq + i];
      }
    }
  }
  float dq[4][NE];
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int e = 0; e < NE; ++e) dq[r][e] = 0.f;
  const int kend = kCausal ? min(p.Tk, i0 + kRows) : p.Tk;
  for (int j0 = 0; j0 < kend; j0 += BC) {
    __syncthreads();  // the previous tile's readers of KVs, Xt and the key mask are done; Qs, dOs loaded
    const uint32_t vis = visible_keys<kCausal, NC>(p, b, i0, j0, rg, cg, row_ok, qpos, qseg, kpos_s, kseg_s);
    if constexpr (!kCausal) {
      if (!__syncthreads_or(vis != 0)) continue;
    }
    load_tile<HDP, BC>(KVs, V, p.kv_stride, j0, p.Tk, p.HD, p.vec);
    __syncthreads();
    float dp[4][NC];
    tile_dot<HDP, NC>(dp, dOs, KVs, rg, cg);  // dP = dO V^T
    __syncthreads();  // every thread is done with the values before the keys replace them
    load_tile<HDP, BC>(KVs, K, p.kv_stride, j0, p.Tk, p.HD, p.vec);
    __syncthreads();
    float s[4][NC];
    tile_dot<HDP, NC>(s, Qs, KVs, rg, cg);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float pr = (vis >> (r * NC + c)) & 1u ? exp2f(s[r][c] * p.scale_log2 - lse2[r]) : 0.f;
        s[r][c] = pr * (dp[r][c] - Dr[r]);  // dS
      }
    store_transposed<NC>(Xt, s, rg, cg);
    __syncthreads();
    tile_accum<HDP, BC>(dq, Xt, KVs, rg, cg);  // dQ += dS K
  }
  T* dQ = static_cast<T*>(p.dq) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * p.HD;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = i0 + rg * 4 + r;
    if (i < p.Tq) store_row<HDP>(dQ + int64_t(i) * p.q_stride, dq[r], p.scale, cg, p.HD, p.vec, p.accumulate);
  }
}

// dk, dv (=, or += when accumulating) for the 64 keys [j0, j0+64) of kv head kh, summed over its
// NH/NKV query heads and the visible queries: dK = dS^T Q / sqrt(HD), dV = P^T dO.
// grid (ceil(Tk/64), NKV, B).
template <class T, int HDP, bool kCausal>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(const Problem p) {
  constexpr int LD = HDP + 4, BC = kBwdCols, NC = BC / 8, NE = HDP / 8;
  extern __shared__ float4 attn_smem[];
  float* Ks = reinterpret_cast<float*>(attn_smem);
  float* Vs = Ks + kRows * LD;
  float* Qs = Vs + kRows * LD;
  float* dOs = Qs + BC * LD;
  float* Xt = dOs + BC * LD;  // [query][key]: P^T, then dS^T
  float* lse2_s = Xt + BC * kXLD;
  float* D_s = lse2_s + BC;
  int* qpos_s = reinterpret_cast<int*>(D_s + BC);
  int* qseg_s = qpos_s + BC;
  const int rg = threadIdx.x >> 3, cg = threadIdx.x & 7;
  const int kh = blockIdx.y, b = blockIdx.z, j0 = blockIdx.x * kRows, G = p.NH / p.NKV;
  const int64_t ldo = int64_t(p.NH) * p.HD;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * p.HD;
  load_tile<HDP, kRows>(Ks, static_cast<const T*>(p.k) + kv_off, p.kv_stride, j0, p.Tk, p.HD, p.vec);
  load_tile<HDP, kRows>(Vs, static_cast<const T*>(p.v) + kv_off, p.kv_stride, j0, p.Tk, p.HD, p.vec);
  int kpos[4] = {}, kseg[4] = {};
  bool key_ok[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = j0 + rg * 4 + r;
    key_ok[r] = j < p.Tk;
    if constexpr (!kCausal) {
      if (key_ok[r]) {
        kpos[r] = p.kpos[int64_t(b) * p.Tk + j];
        kseg[r] = p.kseg[int64_t(b) * p.Tk + j];
      }
    }
  }
  float dk[4][NE], dv[4][NE];
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int e = 0; e < NE; ++e) dk[r][e] = dv[r][e] = 0.f;
  const int istart = kCausal ? j0 : 0;  // causal: queries before the first key see none of the tile
  for (int g = 0; g < G; ++g) {
    const int h = kh * G + g;
    const T* Q = static_cast<const T*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * p.HD;
    const T* dO = static_cast<const T*>(p.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * p.HD;
    const int64_t row0 = (int64_t(b) * p.NH + h) * p.Tq;
    for (int i0 = istart; i0 < p.Tq; i0 += BC) {
      __syncthreads();  // the previous tile's readers of Qs, dOs, Xt and the query data are done; Ks, Vs loaded
      if (threadIdx.x < BC) {
        const int x = threadIdx.x, i = i0 + x;
        lse2_s[x] = i < p.Tq ? p.lse[row0 + i] * kLog2e : -INFINITY;  // -inf: no gradient through the query
        D_s[x] = i < p.Tq ? p.D[row0 + i] : 0.f;
        if constexpr (!kCausal) {
          qpos_s[x] = i < p.Tq ? p.qpos[int64_t(b) * p.Tq + i] : 0;
          qseg_s[x] = i < p.Tq ? p.qseg[int64_t(b) * p.Tq + i] : 0;
        }
      }
      __syncthreads();
      uint32_t vis = 0;  // bit r*NC + c: key j0 + rg*4 + r is visible to query i0 + cg + 8c
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int x = cg + 8 * c;
          bool seen = key_ok[r] && lse2_s[x] != -INFINITY;
          if constexpr (kCausal)
            seen = seen && j0 + rg * 4 + r <= i0 + x;
          else
            seen = seen && qseg_s[x] == kseg[r] && kpos[r] <= qpos_s[x];
          if (seen) vis |= 1u << (r * NC + c);
        }
      if constexpr (!kCausal) {
        if (!__syncthreads_or(vis != 0)) continue;
      }
      load_tile<HDP, BC>(Qs, Q, p.q_stride, i0, p.Tq, p.HD, p.vec);
      load_tile<HDP, BC>(dOs, dO, ldo, i0, p.Tq, p.HD, p.vec);
      __syncthreads();
      float s[4][NC], dp[4][NC];
      tile_dot<HDP, NC>(s, Ks, Qs, rg, cg);    // S^T
      tile_dot<HDP, NC>(dp, Vs, dOs, rg, cg);  // dP^T = V dO^T
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int x = cg + 8 * c;
          const float pr = (vis >> (r * NC + c)) & 1u ? exp2f(s[r][c] * p.scale_log2 - lse2_s[x]) : 0.f;
          s[r][c] = pr;
          dp[r][c] = pr * (dp[r][c] - D_s[x]);  // dS^T
        }
      store_transposed<NC>(Xt, s, rg, cg);
      __syncthreads();
      tile_accum<HDP, BC>(dv, Xt, dOs, rg, cg);  // dV += P^T dO
      __syncthreads();  // every thread is done with P^T before dS^T replaces it
      store_transposed<NC>(Xt, dp, rg, cg);
      __syncthreads();
      tile_accum<HDP, BC>(dk, Xt, Qs, rg, cg);  // dK += dS^T Q
    }
  }
  T* dK = static_cast<T*>(p.dk) + kv_off;
  T* dV = static_cast<T*>(p.dv) + kv_off;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = j0 + rg * 4 + r;
    if (j >= p.Tk) continue;
    store_row<HDP>(dK + int64_t(j) * p.kv_stride, dk[r], p.scale, cg, p.HD, p.vec, p.accumulate);
    store_row<HDP>(dV + int64_t(j) * p.kv_stride, dv[r], 1.f, cg, p.HD, p.vec, p.accumulate);
  }
}

}  // namespace

void rowdot(const Problem& p, DType dt, cudaStream_t stream) {
  const int G = p.HD / 8;
  if (dt == DType::BF16 && p.HD % 8 == 0 && G <= 32 && (G & (G - 1)) == 0 && aligned16(p.out) &&
      aligned16(p.dout)) {
    if (G == 1)
      rowdot_bf16<1>(p, stream);
    else if (G == 2)
      rowdot_bf16<2>(p, stream);
    else if (G == 4)
      rowdot_bf16<4>(p, stream);
    else if (G == 8)
      rowdot_bf16<8>(p, stream);
    else if (G == 16)
      rowdot_bf16<16>(p, stream);
    else
      rowdot_bf16<32>(p, stream);
    return;
  }
  dispatch_float(dt, "attention", [&](auto tag) {
    using T = decltype(tag);
    const int64_t warps = int64_t(p.B) * p.Tq * p.NH;
    attention_rowdot_kernel<T><<<unsigned((warps + 7) / 8), 256, 0, stream>>>(p);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void backward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  dispatch_float(dt, "attention", [&](auto tag) {
    using T = decltype(tag);
    dispatch_head_dim(p.HD, [&](auto hd) {
      constexpr int HDP = decltype(hd)::value;
      launch(causal ? attention_bwd_dq_kernel<T, HDP, true> : attention_bwd_dq_kernel<T, HDP, false>,
             dim3(tiles(p.Tq, kRows), unsigned(p.NH), unsigned(p.B)), dq_smem<HDP>(), stream, p);
      launch(causal ? attention_bwd_dkdv_kernel<T, HDP, true> : attention_bwd_dkdv_kernel<T, HDP, false>,
             dim3(tiles(p.Tk, kRows), unsigned(p.NKV), unsigned(p.B)), dkdv_smem<HDP>(), stream, p);
    });
  });
}

}  // namespace mpigpt::cuda::fma_attn
