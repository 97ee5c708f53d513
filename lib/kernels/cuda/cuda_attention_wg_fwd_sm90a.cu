// CUDA backend: the causal bf16 attention forward on Hopper's warpgroup products (wgmma,
// cuda_wgmma.cuh), head dims 64 and 128; compiled for sm_90a only, chosen as the backward is
// (engine.attention_backend = wgmma, or auto; cuda_attention_wg_bwd_sm90a.cu).
//
// The algorithm is cuda_attention_tc.cu's causal forward (FlashAttention-2: online softmax in fp32
// and base 2, the lse saved in natural log). A block of 256 threads is two warpgroups and owns 128
// queries, 64 per warpgroup, and streams 64-key tiles of K and V through shared memory, three
// buffers deep; per tile each warpgroup computes S = Q K^T (both operands from shared memory,
// K-major) and O += P V (P from the registers of S, V read MN-major), and issues the next tile's S
// behind that P V, so that one wait per tile retires both and the tensor cores go from one to the
// other without the warpgroup in between. A warpgroup whose queries all precede a tile's first key
// skips the tile's products (its condition is uniform over the warpgroup).
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_attention_tc_tiles.cuh"
#include "lib/kernels/cuda/cuda_wgmma.cuh"

namespace mpigpt::cuda {

namespace {

using namespace tc;
using mma::acc_to_a;
using wg::desc_k;
using wg::desc_mn;
using wg::Wgmma;

constexpr int kWgFwdThreads = 256;  // two warpgroups
constexpr int kWgFwdRows = 128;     // queries per block, 64 per warpgroup
constexpr int kWgFwdKeys = 64;      // keys per tile
// K and V tile buffers: tile n + 1's scores are issued behind tile n's P V (one wait retires both),
// so tile n + 2 goes into a third buffer while n and n + 1 are still read.
constexpr int kWgFwdBufs = 3;
using wg::tile_landed;

template <int HD, int ROWS>
__device__ __forceinline__ void load_cm_async(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  wg::load_tile_async<HD, ROWS, kWgFwdThreads>(dst, src, stride, row0, end);
}

// out (B,T,NH*HD), lse (B,NH,T) for the 128 queries [i0, i0+128) of head h, batch row b (causal).
// grid (ceil(T/128), NH, B).
template <int HD>
__global__ void __launch_bounds__(kWgFwdThreads) attention_fwd_wg_kernel(const AttentionTcForward p) {
#if MPIGPT_WGMMA_CODE
  constexpr int KS = HD / 16, DT = HD / 8, KC = kWgFwdKeys, NT = KC / 8, KCS = KC / 16;
  extern __shared__ __align__(128) unsigned char attn_wg_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_wg_smem);  // 128 x HD
  bf16* KVs = Qs + kWgFwdRows * HD;                   // [kWgFwdBufs] x (K, V), KC x HD each

  const QueryTile<bf16> qt = query_tile<bf16, kWgFwdRows, true>(p);
  const int h = qt.h, b = qt.b, i0 = qt.i0;
  const bf16 *K = qt.K, *V = qt.V;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wg_row = (threadIdx.x >> 7) * 64;                // the warpgroup's first row in the block
  const int wr = wg_row + ((threadIdx.x >> 5) & 3) * 16;     // the warp's
  const int rows[2] = {i0 + wr + g, i0 + wr + g + 8};        // this lane's queries
  const bf16* Qw = Qs + wg_row * HD;                         // the warpgroup's 64 rows (whole row groups)

  const int kend = min(p.Tk, i0 + kWgFwdRows), ntiles = (kend + KC - 1) / KC;
  auto load_tile = [&](int n) {  // keys [n KC, n KC + KC) into buffer n % kWgFwdBufs
    bf16* buf = KVs + (n % kWgFwdBufs) * 2 * KC * HD;
    load_cm_async<HD, KC>(buf, K, p.kv_stride, n * KC, p.Tk);
    load_cm_async<HD, KC>(buf + KC * HD, V, p.kv_stride, n * KC, p.Tk);
  };
  load_cm_async<HD, kWgFwdRows>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                                p.q_stride, i0, p.Tq);
  load_tile(0);
  __pipeline_commit();
  tile_landed();
  if (ntiles > 1) load_tile(1);
  __pipeline_commit();

  float o[DT][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running row max (base 2); lane's share of the sum
  float s[NT][4];       // no zero fill: the first product of a chain does not read it
  uint32_t a[KCS][4];   // P, the A operand of O += P V
  auto scores = [&](int n) {  // issues S = Q K^T for tile n
    const bf16* Ks = KVs + (n % kWgFwdBufs) * 2 * KC * HD;
#pragma unroll
    for (int k = 0; k < KS; ++k) Wgmma<KC>::template ss<0>(s, desc_k<HD>(Qw, k), desc_k<HD>(Ks, k), k > 0);
    wg::commit();
  };
  auto values = [&](int n) {  // issues O += P V for tile n
    const bf16* Vs = KVs + (n % kWgFwdBufs) * 2 * KC * HD + KC * HD;
#pragma unroll
    for (int k = 0; k < KCS; ++k) Wgmma<HD>::template rs<1>(o, a[k], desc_mn<HD>(Vs, k), 1);
    wg::commit();
  };
  // P (into a) from the retired S of tile n, and the running max, sum and O rescaled. A tile wholly
  // in the warpgroup's future (the last one of the first warpgroup) gives P = 0 and leaves them be.
  auto softmax = [&](int n) {
    const int j0 = n * KC;
    wg::fence_operands(s);
    // Mask (the scores stay unscaled until the exponential). A tile entirely at or below the warp's
    // first query and inside Tk needs no mask (rows past Tq are computed from zero Q rows and never
    // written).
    const bool unmasked = j0 + KC - 1 <= i0 + wr && j0 + KC <= p.Tk;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1, j = j0 + nt * 8 + 2 * t + (e & 1);
        const bool vis = unmasked || (j < p.Tk && j <= rows[rr]);
        s[nt][e] = vis ? s[nt][e] : -INFINITY;
        mx[rr] = fmaxf(mx[rr], s[nt][e]);
      }
    }
    float alpha[2], base[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
      mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
      const float mnew = fmaxf(m[rr], mx[rr]);
      // The row max is kept in score units and the base in base-2 units, so that each probability
      // is exp2 of one FFMA (scale > 0: the max commutes with the scaling). Nothing visible yet:
      // every term is exp2(-inf) = 0.
      base[rr] = mnew == -INFINITY ? 0.f : mnew * p.scale_log2;
      alpha[rr] = exp2_ftz(m[rr] * p.scale_log2 - base[rr]);
      m[rr] = mnew;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2_ftz(s[nt][e] * p.scale_log2 - base[e >> 1]);  // one FFMA
        sum[e >> 1] += s[nt][e];
      }
    }
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) l[rr] = l[rr] * alpha[rr] + sum[rr];
#pragma unroll
    for (int k = 0; k < KCS; ++k) acc_to_a<NT>(a[k], s, k);
    wg::fence_operands(o);
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
  };

  wg::fence();
  scores(0);
  wg::wait<0>();
  for (int n = 0; n + 1 < ntiles; ++n) {
    softmax(n);
    // Tile n + 1 has landed, and every warp has retired its products of tile n - 1, whose buffer
    // takes tile n + 2.
    tile_landed();
    if (n + 2 < ntiles) load_tile(n + 2);
    __pipeline_commit();
    wg::fence();
    values(n);
    scores(n + 1);  // queued behind P V: one wait retires both
    wg::wait<0>();
  }
  softmax(ntiles - 1);
  wg::fence();
  values(ntiles - 1);
  wg::wait<0>();
  wg::fence_operands(o);

  float inv[2], lse[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float total = l[rr] + __shfl_xor_sync(0xffffffffu, l[rr], 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    inv[rr] = total > 0.f ? 1.f / total : 0.f;  // no visible key: out 0 exactly
    lse[rr] = total > 0.f ? (m[rr] * p.scale_log2 + log2f(total)) * kTcLn2 : -INFINITY;
  }
  store_rows<DT>(o, static_cast<bf16*>(p.out) + int64_t(b) * p.Tq * (int64_t(p.NH) * HD) + int64_t(h) * HD,
                 int64_t(p.NH) * HD, rows[0], p.Tq, inv, false);
  if (t == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
      if (rows[rr] < p.Tq) p.lse[(int64_t(b) * p.NH + h) * p.Tq + rows[rr]] = lse[rr];
  }
#else
  __trap();  // not sm_90a code: the host never launches it (attention_wgmma_available)
#endif
}

template <int HD>
constexpr size_t fwd_wg_smem() {
  return size_t(kWgFwdRows + 2 * kWgFwdBufs * kWgFwdKeys) * HD * 2;
}

template <int HD>
void launch_fwd_wg(const AttentionTcForward& p, cudaStream_t stream) {
  auto kernel = attention_fwd_wg_kernel<HD>;
  const size_t smem = fwd_wg_smem<HD>();
  allow_smem(kernel, smem);
  const dim3 grid{unsigned((p.Tq + kWgFwdRows - 1) / kWgFwdRows), unsigned(p.NH), unsigned(p.B)};
  kernel<<<grid, kWgFwdThreads, smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

bool attention_forward_wg(const AttentionTcForward& p, DType dt, bool causal, cudaStream_t stream) {
  if (!causal || !tc_inputs_ok(p, dt, causal) || !aligned16(p.out) || !attention_wgmma_available()) return false;
  if (p.B == 0 || p.Tq == 0) return true;
  if (p.HD == 64)
    launch_fwd_wg<64>(p, stream);
  else
    launch_fwd_wg<128>(p, stream);
  return true;
}

}  // namespace mpigpt::cuda
