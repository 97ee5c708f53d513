// CUDA backend: the bf16 tensor-core attention's forward (causal and explicitly masked), head dims
// 64 and 128; its layout and tiles are in cuda_attention_tc_tiles.cuh, the backward in
// cuda_attention_tc_bwd.cu.
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_attention_tc_tiles.cuh"

namespace mpigpt::cuda {

namespace {

using namespace tc;

// out (B,Tq,NH*HD), lse (B,NH,Tq) for the ROWS queries [i0, i0+ROWS) of head h, batch row b: each
// warp owns MT m-tiles of 16 consecutive rows. grid (ceil(Tq/ROWS), NH, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads) attention_fwd_tc_kernel(const AttentionTcForward p) {
  constexpr int ROWS = kFwdRows<kCausal>, MT = ROWS / kTcRows;
  constexpr int LD = kLd<HD>, KS = HD / 16, DT = HD / 8, KC = kFwdCols<HD>, NT = KC / 8;
  constexpr int NB = kCausal ? 2 : 1;  // K/V buffers: causal tiles are prefetched one ahead
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* KVs = reinterpret_cast<bf16*>(attn_tc_smem + tile_bytes<HD>(ROWS));  // [NB] x (K tile, V tile)
  int* qpos_s = reinterpret_cast<int*>(attn_tc_smem + tile_bytes<HD>(ROWS) + 2 * NB * tile_bytes<HD>(KC));
  int* qseg_s = qpos_s + ROWS;
  int* kpos_s = qseg_s + ROWS;
  int* kseg_s = kpos_s + KC;

  const QueryTile<bf16> qt = query_tile<bf16, ROWS, kCausal>(p);
  const int h = qt.h, b = qt.b, i0 = qt.i0;
  const bf16 *K = qt.K, *V = qt.V;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wr = (threadIdx.x >> 5) * 16 * MT;  // the warp's first row in the block
  int rows[MT][2];                              // this lane's queries
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    rows[mt][0] = i0 + wr + 16 * mt + g;
    rows[mt][1] = rows[mt][0] + 8;
  }

  if constexpr (kCausal) kv_first<HD, KC>(KVs, K, V, p.kv_stride, p.Tk);  // on its way while Q loads
  load_tile<HD, ROWS>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD, p.q_stride,
                      i0, p.Tq);
  if constexpr (!kCausal) load_mask<ROWS>(qpos_s, qseg_s, p.qpos, p.qseg, b, p.Tq, i0);
  __syncthreads();

  uint32_t qa[MT][KS][4];  // the warp's Q rows as A fragments, for every key tile (kFwdRegQ)
  if constexpr (kFwdRegQ<HD, kCausal>)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) load_a_all<KS, LD>(qa[mt], Qs + (wr + 16 * mt) * LD);
  int myqpos[MT][2] = {}, myqseg[MT][2] = {};
  if constexpr (!kCausal)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) lane_rows(myqpos[mt], myqseg[mt], qpos_s, qseg_s, wr + 16 * mt, g);
  float o[MT][DT][4] = {};
  float m[MT][2], l[MT][2];  // running row max (base 2); this lane's share of the running row sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    for (int rr = 0; rr < 2; ++rr) {
      m[mt][rr] = -INFINITY;
      l[mt][rr] = 0.f;
    }

  const int kend = kCausal ? min(p.Tk, i0 + ROWS) : p.Tk;
  for (int j0 = 0, n = 0; j0 < kend; j0 += KC, ++n) {
    const bf16* Ks = KVs + (n % NB) * 2 * KC * LD;
    const bf16* Vs = Ks + KC * LD;
    if constexpr (kCausal)
      kv_next<HD, KC>(KVs, K, V, p.kv_stride, p.Tk, n, j0, kend);
    else if (!kv_masked<HD, KC>(KVs, K, V, p, b, i0, j0, qpos_s, qseg_s, kpos_s, kseg_s, nullptr))
      continue;  // nothing visible in this tile

    // Causal: a warp whose rows all come before the tile's first key has nothing to do in it (the
    // block's last tile, for the warps of its first rows); it still meets the barrier below.
    if (!kCausal || j0 <= i0 + wr + 16 * MT - 1) {
      float s[MT][NT][4] = {};
      if constexpr (kFwdRegQ<HD, kCausal>)
        warp_abt_m<MT, KS, NT, LD>(s, qa, Ks);  // S = Q K^T
      else
        warp_abt_m<MT, KS, NT, LD>(s, Qs + wr * LD, Ks);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // Mask (the scores stay unscaled until the exponential). A causal tile entirely at or below
        // the m-tile's first query and inside Tk needs no mask (rows past Tq are computed from zero
        // Q rows and never written).
        const bool unmasked = kCausal && j0 + KC - 1 <= i0 + wr + 16 * mt && j0 + KC <= p.Tk;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int rr = e >> 1, x = nt * 8 + 2 * t + (e & 1), j = j0 + x;
            bool vis = true;
            if (!unmasked) {
              vis = j < p.Tk;
              if constexpr (kCausal)
                vis = vis && j <= rows[mt][rr];
              else
                vis = vis && kseg_s[x] == myqseg[mt][rr] && kpos_s[x] <= myqpos[mt][rr];
            }
            s[mt][nt][e] = vis ? s[mt][nt][e] : -INFINITY;
            mx[rr] = fmaxf(mx[rr], s[mt][nt][e]);
          }
        }
        float alpha[2], base[2], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
          mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
          const float mnew = fmaxf(m[mt][rr], mx[rr]);
          // The row max is kept in score units and the base in base-2 units, so that each probability
          // is exp2 of one FFMA (scale > 0: the max commutes with the scaling). Nothing visible yet:
          // every term is exp2(-inf) = 0.
          base[rr] = mnew == -INFINITY ? 0.f : mnew * p.scale_log2;
          alpha[rr] = exp2_ftz(m[mt][rr] * p.scale_log2 - base[rr]);
          m[mt][rr] = mnew;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[mt][nt][e] = exp2_ftz(s[mt][nt][e] * p.scale_log2 - base[e >> 1]);  // one FFMA
            sum[e >> 1] += s[mt][nt][e];
          }
        }
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) l[mt][rr] = l[mt][rr] * alpha[rr] + sum[rr];
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
          o[mt][dt][0] *= alpha[0];
          o[mt][dt][1] *= alpha[0];
          o[mt][dt][2] *= alpha[1];
          o[mt][dt][3] *= alpha[1];
        }
      }
      warp_acc_times_m<MT, NT, DT, LD>(o, s, Vs);  // O += P V
    }
    if constexpr (kCausal) __syncthreads();  // this buffer's readers are done before it is refilled
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2], lse[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float total = l[mt][rr] + __shfl_xor_sync(0xffffffffu, l[mt][rr], 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      inv[rr] = total > 0.f ? 1.f / total : 0.f;  // no visible key: out 0 exactly
      lse[rr] = total > 0.f ? (m[mt][rr] * p.scale_log2 + log2f(total)) * kTcLn2 : -INFINITY;
    }
    store_rows<DT>(o[mt], static_cast<bf16*>(p.out) + int64_t(b) * p.Tq * (int64_t(p.NH) * HD) + int64_t(h) * HD,
                   int64_t(p.NH) * HD, rows[mt][0], p.Tq, inv, false);
    if (t == 0) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr)
        if (rows[mt][rr] < p.Tq) p.lse[(int64_t(b) * p.NH + h) * p.Tq + rows[mt][rr]] = lse[rr];
    }
  }
}

template <int HD, bool kCausal>
constexpr size_t fwd_smem() {
  return tile_bytes<HD>(kFwdRows<kCausal>) + (kCausal ? 4 : 2) * tile_bytes<HD>(kFwdCols<HD>) +
         size_t(2 * kFwdRows<kCausal> + 2 * kFwdCols<HD>) * 4;
}

template <int HD>
void launch_tc(const AttentionTcForward& p, bool causal, cudaStream_t stream) {
  auto kernel = causal ? attention_fwd_tc_kernel<HD, true> : attention_fwd_tc_kernel<HD, false>;
  const size_t smem = causal ? fwd_smem<HD, true>() : fwd_smem<HD, false>();
  allow_smem(kernel, smem);
  const int rows = causal ? kFwdRows<true> : kFwdRows<false>;
  const dim3 grid(unsigned((p.Tq + rows - 1) / rows), unsigned(p.NH), unsigned(p.B));
  kernel<<<grid, kTcThreads, smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

bool attention_forward_tc(const AttentionTcForward& p, DType dt, bool causal, cudaStream_t stream) {
  if (!tc_inputs_ok(p, dt, causal) || !aligned16(p.out)) return false;
  if (p.B == 0 || p.Tq == 0) return true;
  if (p.HD == 64)
    launch_tc<64>(p, causal, stream);
  else
    launch_tc<128>(p, causal, stream);
  return true;
}

}  // namespace mpigpt::cuda
