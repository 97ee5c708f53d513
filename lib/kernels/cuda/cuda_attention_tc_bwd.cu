// CUDA backend: the bf16 tensor-core attention's backward (causal and explicitly masked), head
// dims 64 and 128; its layout and tiles are in cuda_attention_tc_tiles.cuh, the forward in
// cuda_attention_tc.cu.
#include <cmath>
#include <cstdint>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_attention_tc_tiles.cuh"

namespace mpigpt::cuda {

namespace {

using namespace tc;

// A dQ kernel per query tile recomputes S and dP with queries as rows and sums dQ = dS K in
// registers; a dK/dV kernel per key tile, summing over the query heads of its kv head, works on the
// transposes S^T = K Q^T and dP^T = V dO^T (keys as rows), so that its products take their
// register operand from an accumulator tile: dV = P^T dO, dK = dS^T Q with dS = P (dP - D). Seven
// tile products per key and query tile where FlashAttention-2 has five, but every gradient element
// is summed by one thread in a fixed order: the result does not depend on timing. (dQ fused into
// the dK/dV kernel, its shares added in a fixed order through an fp32 scratch, ran slower on an
// H200 at the models' shapes: docs/performance.md.)

// dq (=, or +=) for the 64 queries [i0, i0+64) of head h, batch row b: dQ = dS K / sqrt(HD).
// grid (ceil(Tq/64), NH, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads) attention_bwd_dq_tc_kernel(const AttentionTcBackward pb) {
  constexpr int LD = kLd<HD>, KS = HD / 16, DT = HD / 8, KC = kDqCols<HD>, NT = KC / 8;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* dOs = reinterpret_cast<bf16*>(attn_tc_smem + tile_bytes<HD>(kTcRows));
  constexpr int NB = kCausal ? 2 : 1;  // K/V buffers, as in the forward
  bf16* KVs = reinterpret_cast<bf16*>(attn_tc_smem + 2 * tile_bytes<HD>(kTcRows));
  float* lse2_s =
      reinterpret_cast<float*>(attn_tc_smem + 2 * tile_bytes<HD>(kTcRows) + 2 * NB * tile_bytes<HD>(KC));
  int* qpos_s = reinterpret_cast<int*>(lse2_s + kTcRows);
  int* qseg_s = qpos_s + kTcRows;
  int* kpos_s = qseg_s + kTcRows;
  int* kseg_s = kpos_s + KC;

  const QueryBlock qb = query_block<kCausal>(p);
  const int g = qb.g, t = qb.t, h = qb.h, b = qb.b, i0 = qb.i0, wr = qb.wr;
  const int rows[2] = {qb.rows[0], qb.rows[1]};
  const bf16 *K = qb.K, *V = qb.V;
  const int64_t ldo = int64_t(p.NH) * HD;
  if constexpr (kCausal) kv_first<HD, KC>(KVs, K, V, p.kv_stride, p.Tk);
  load_tile<HD, kTcRows>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                         p.q_stride, i0, p.Tq);
  load_tile<HD, kTcRows>(dOs, static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * HD, ldo,
                         i0, p.Tq);
  if constexpr (!kCausal) load_mask<kTcRows>(qpos_s, qseg_s, p.qpos, p.qseg, b, p.Tq, i0);
  if (threadIdx.x < kTcRows) {
    const int ii = i0 + threadIdx.x;
    // -inf for a query past Tq or one that saw no key: no gradient flows through it.
    lse2_s[threadIdx.x] = ii < p.Tq ? p.lse[(int64_t(b) * p.NH + h) * p.Tq + ii] * kTcLog2e : -INFINITY;
  }
  float lse2[2], Dr[2];
  int myqpos[2] = {0, 0}, myqseg[2] = {0, 0};
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    Dr[rr] = rows[rr] < p.Tq ? pb.D[(int64_t(b) * p.NH + h) * p.Tq + rows[rr]] : 0.f;
  __syncthreads();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) lse2[rr] = lse2_s[wr + g + 8 * rr];
  if constexpr (!kCausal) lane_rows(myqpos, myqseg, qpos_s, qseg_s, wr, g);
  uint32_t qa[KS][4], doa[KS][4];
  if constexpr (kDqRegA<HD>) {
    load_a_all<KS, LD>(qa, Qs + wr * LD);
    load_a_all<KS, LD>(doa, dOs + wr * LD);
  }
  float dq[DT][4] = {};

  const int kend = kCausal ? min(p.Tk, i0 + kTcRows) : p.Tk;
  for (int j0 = 0, n = 0; j0 < kend; j0 += KC, ++n) {
    const bf16* Ks = KVs + (n % NB) * 2 * KC * LD;
    const bf16* Vs = Ks + KC * LD;
    if constexpr (kCausal)
      kv_next<HD, KC>(KVs, K, V, p.kv_stride, p.Tk, n, j0, kend);
    else if (!kv_masked<HD, KC>(KVs, K, V, p, b, i0, j0, qpos_s, qseg_s, kpos_s, kseg_s, lse2_s))
      continue;

    float s[NT][4] = {}, dp[NT][4] = {};
    if constexpr (kDqRegA<HD>) {
      warp_abt<KS, NT, LD>(s, qa, Ks);   // S = Q K^T
      warp_abt<KS, NT, LD>(dp, doa, Vs);  // dP = dO V^T
    } else {
      warp_abt<KS, NT, LD>(s, Qs + wr * LD, Ks);
      warp_abt<KS, NT, LD>(dp, dOs + wr * LD, Vs);
    }
    // dS. A causal tile wholly visible to the warp's 16 queries (its last key at or before the first
    // of them, inside Tk; the queries inside Tq, so each saw a key and has a finite lse) needs no
    // per-element mask: most tiles of a long sequence, and the mask's tests and selects are about
    // half of this per-element work.
    if (kCausal && j0 + KC - 1 <= i0 + wr && j0 + KC <= p.Tk && i0 + wr + 16 <= p.Tq) {
      dq_scores_to_ds(s, dp, p.scale_log2, lse2, Dr, t, AllVisible{});
    } else {
      dq_scores_to_ds(s, dp, p.scale_log2, lse2, Dr, t, [&](int rr, int c) {
        const int j = j0 + c;
        if constexpr (kCausal)
          return lse2[rr] != -INFINITY && j < p.Tk && j <= rows[rr];
        else
          return lse2[rr] != -INFINITY && j < p.Tk && kseg_s[c] == myqseg[rr] && kpos_s[c] <= myqpos[rr];
      });
    }
    warp_acc_times<NT, DT, LD>(dq, s, Ks);  // dQ += dS K
    if constexpr (kCausal) __syncthreads();  // this buffer's readers are done before it is refilled
  }
  const float scale[2] = {pb.scale, pb.scale};
  store_rows<DT>(dq, static_cast<bf16*>(pb.dq) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD, p.q_stride,
                 rows[0], p.Tq, scale, pb.accumulate);
}

// dk, dv (=, or +=) for the 64 keys [j0, j0+64) of kv head kh, summed over its NH/NKV query heads:
// dK = dS^T Q / sqrt(HD), dV = P^T dO. grid (ceil(Tk/64), NKV, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads, (kDkdvMinBlocks<HD, kCausal>))
    attention_bwd_dkdv_tc_kernel(const AttentionTcBackward pb) {
  constexpr int LD = kLd<HD>, KS = HD / 16, DT = HD / 8, QC = kBwdCols<HD>, NT = QC / 8;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Ks = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* Vs = reinterpret_cast<bf16*>(attn_tc_smem + tile_bytes<HD>(kTcRows));
  constexpr int NB = kCausal ? 2 : 1;  // Q/dO buffers: causal tiles are prefetched one ahead
  bf16* QdOs = reinterpret_cast<bf16*>(attn_tc_smem + 2 * tile_bytes<HD>(kTcRows));  // [NB] x (Q, dO)
  // [NB] x QC of the tile's lse (natural log, as saved) and D, prefetched with its Q and dO.
  float* lse_b = reinterpret_cast<float*>(attn_tc_smem + 2 * tile_bytes<HD>(kTcRows) + 2 * NB * tile_bytes<HD>(QC));
  float* D_b = lse_b + NB * QC;
  int* qpos_s = reinterpret_cast<int*>(D_b + NB * QC);
  int* qseg_s = qpos_s + QC;
  int* kpos_b = qseg_s + QC;  // the block's keys
  int* kseg_b = kpos_b + kTcRows;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int G = p.NH / p.NKV;
  const int kt = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  const int j0 = kt * kTcRows, wr = warp * 16;
  const int keys[2] = {j0 + wr + g, j0 + wr + g + 8};  // this lane's two keys
  const int64_t ldo = int64_t(p.NH) * HD;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * HD;
  load_tile<HD, kTcRows>(Ks, static_cast<const bf16*>(p.k) + kv_off, p.kv_stride, j0, p.Tk);
  load_tile<HD, kTcRows>(Vs, static_cast<const bf16*>(p.v) + kv_off, p.kv_stride, j0, p.Tk);
  if constexpr (!kCausal) load_mask<kTcRows>(kpos_b, kseg_b, p.kpos, p.kseg, b, p.Tk, j0);
  __syncthreads();
  int mykpos[2] = {0, 0}, mykseg[2] = {0, 0};
  if constexpr (!kCausal) lane_rows(mykpos, mykseg, kpos_b, kseg_b, wr, g);
  float dk[DT][4] = {}, dv[DT][4] = {};
  // The query tiles, head by head: tile n is head kh*G + n/nq, queries istart + (n%nq)*QC.
  const int istart = kCausal ? j0 : 0;  // causal: queries before the first key see none of the tile
  const int nq = istart < p.Tq ? (p.Tq - istart + QC - 1) / QC : 0;
  auto q_src = [&](int n) {
    return static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(kh * G + n / nq) * HD;
  };
  auto do_src = [&](int n) {
    return static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(kh * G + n / nq) * HD;
  };
  // Tile n's lse and D to buffer n % NB: asynchronous copies (4 bytes each: a row of lse need not be
  // 16-byte aligned), -inf and 0 past Tq (no gradient through those queries).
  auto rows_async = [&](int n) {
    const int i0 = istart + (n % nq) * QC;
    const int64_t row0 = (int64_t(b) * p.NH + kh * G + n / nq) * p.Tq;
    for (int x = threadIdx.x; x < 2 * QC; x += kTcThreads) {
      const bool is_lse = x < QC;
      const int c = is_lse ? x : x - QC, ii = i0 + c;
      float* dst = (is_lse ? lse_b : D_b) + (n % NB) * QC + c;
      if (ii < p.Tq)
        __pipeline_memcpy_async(dst, (is_lse ? p.lse : pb.D) + row0 + ii, 4);
      else
        *dst = is_lse ? -INFINITY : 0.f;
    }
  };
  if constexpr (kCausal) {
    if (nq > 0) {
      load_tile_async<HD, QC>(QdOs, q_src(0), p.q_stride, istart, p.Tq);
      load_tile_async<HD, QC>(QdOs + QC * LD, do_src(0), ldo, istart, p.Tq);
      rows_async(0);
      __pipeline_commit();
    }
  }
  for (int n = 0; n < G * nq; ++n) {
    const int i0 = istart + (n % nq) * QC;
    const bf16* Qs = QdOs + (n % NB) * 2 * QC * LD;
    const bf16* dOs = Qs + QC * LD;
    const float* lse_s = lse_b + (n % NB) * QC;
    const float* D_s = D_b + (n % NB) * QC;
    if constexpr (kCausal) {
      // Prefetch tile n+1 into the other buffer (whose readers finished at the barrier ending
      // iteration n-1), then wait for tile n.
      if (n + 1 < G * nq) {
        bf16* next = QdOs + ((n + 1) % NB) * 2 * QC * LD;
        const int inext = istart + ((n + 1) % nq) * QC;
        load_tile_async<HD, QC>(next, q_src(n + 1), p.q_stride, inext, p.Tq);
        load_tile_async<HD, QC>(next + QC * LD, do_src(n + 1), ldo, inext, p.Tq);
        rows_async(n + 1);
      }
      __pipeline_commit();
      __pipeline_wait_prior(1);
      __syncthreads();
    } else {
      __syncthreads();  // the previous tile's readers of the query data are done
      if (threadIdx.x < QC) {
        const int x = threadIdx.x, ii = i0 + x;
        const int64_t row0 = (int64_t(b) * p.NH + kh * G + n / nq) * p.Tq;
        lse_b[x] = ii < p.Tq ? p.lse[row0 + ii] : -INFINITY;
        D_b[x] = ii < p.Tq ? pb.D[row0 + ii] : 0.f;
      }
      load_mask<QC>(qpos_s, qseg_s, p.qpos, p.qseg, b, p.Tq, i0);
      __syncthreads();
      bool any = false;
      const int kr = threadIdx.x >> 1, x0 = (threadIdx.x & 1) * (QC / 2);
      if (j0 + kr < p.Tk) {
        const int kp = kpos_b[kr], ks = kseg_b[kr];
        for (int x = x0; x < x0 + QC / 2; ++x)
          any = any || (lse_s[x] != -INFINITY && qseg_s[x] == ks && kp <= qpos_s[x]);
      }
      if (!__syncthreads_or(any)) continue;
      load_tile<HD, QC>(QdOs, q_src(n), p.q_stride, i0, p.Tq);
      load_tile<HD, QC>(QdOs + QC * LD, do_src(n), ldo, i0, p.Tq);
      __syncthreads();
    }

    float st[NT][4] = {}, dpt[NT][4] = {};
    warp_abt<KS, NT, LD>(st, Ks + wr * LD, Qs);   // S^T = K Q^T
    warp_abt<KS, NT, LD>(dpt, Vs + wr * LD, dOs);  // dP^T = V dO^T
    // P^T and dS^T. Unmasked when the warp's 16 keys (inside Tk) all precede the tile's first query
    // and the tile's queries are inside Tq (each saw a key: a finite lse), as in the dQ kernel; not
    // where the kernel is compiled for 3 blocks per multiprocessor (HD 64): there the second copy
    // of the loop takes its spill from 12 to 48 bytes, which would need a GPU to weigh.
    constexpr bool kUnmaskedPath = kCausal && kDkdvMinBlocks<HD, kCausal> < 3;
    if (kUnmaskedPath && j0 + wr + 15 <= i0 && j0 + wr + 16 <= p.Tk && i0 + QC <= p.Tq) {
      dkdv_scores_to_p_ds(st, dpt, p.scale_log2, lse_s, D_s, t, AllVisible{});
    } else {
      dkdv_scores_to_p_ds(st, dpt, p.scale_log2, lse_s, D_s, t, [&](int rr, int x) {
        if constexpr (kCausal)
          return keys[rr] < p.Tk && lse_s[x] != -INFINITY && keys[rr] <= i0 + x;
        else
          return keys[rr] < p.Tk && lse_s[x] != -INFINITY && qseg_s[x] == mykseg[rr] && mykpos[rr] <= qpos_s[x];
      });
    }
    warp_acc_times<NT, DT, LD>(dv, st, dOs);  // dV += P^T dO
    warp_acc_times<NT, DT, LD>(dk, dpt, Qs);  // dK += dS^T Q
    if constexpr (kCausal) __syncthreads();  // this buffer's and the query data's readers are done
  }
  const float kscale[2] = {pb.scale, pb.scale}, vscale[2] = {1.f, 1.f};
  store_rows<DT>(dk, static_cast<bf16*>(pb.dk) + kv_off, p.kv_stride, keys[0], p.Tk, kscale, pb.accumulate);
  store_rows<DT>(dv, static_cast<bf16*>(pb.dv) + kv_off, p.kv_stride, keys[0], p.Tk, vscale, pb.accumulate);
}

template <int HD, bool kCausal>
constexpr size_t dq_smem() {
  return 2 * tile_bytes<HD>(kTcRows) + (kCausal ? 4 : 2) * tile_bytes<HD>(kDqCols<HD>) +
         size_t(3 * kTcRows + 2 * kDqCols<HD>) * 4;
}
template <int HD, bool kCausal>
constexpr size_t dkdv_smem() {
  return 2 * tile_bytes<HD>(kTcRows) + (kCausal ? 4 : 2) * tile_bytes<HD>(kBwdCols<HD>) +
         size_t((kCausal ? 6 : 4) * kBwdCols<HD> + 2 * kTcRows) * 4;
}

template <int HD>
void launch_bwd_tc(const AttentionTcBackward& p, bool causal, cudaStream_t stream) {
  const int nkt = (p.f.Tk + kTcRows - 1) / kTcRows;
  auto dq = causal ? attention_bwd_dq_tc_kernel<HD, true> : attention_bwd_dq_tc_kernel<HD, false>;
  auto dkdv = causal ? attention_bwd_dkdv_tc_kernel<HD, true> : attention_bwd_dkdv_tc_kernel<HD, false>;
  const size_t dq_bytes = causal ? dq_smem<HD, true>() : dq_smem<HD, false>();
  allow_smem(dq, dq_bytes);
  const size_t dkdv_bytes = causal ? dkdv_smem<HD, true>() : dkdv_smem<HD, false>();
  allow_smem(dkdv, dkdv_bytes);
  const dim3 gq(unsigned((p.f.Tq + kTcRows - 1) / kTcRows), unsigned(p.f.NH), unsigned(p.f.B));
  const dim3 gk(unsigned(nkt), unsigned(p.f.NKV), unsigned(p.f.B));
  dq<<<gq, kTcThreads, dq_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
  dkdv<<<gk, kTcThreads, dkdv_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

bool attention_backward_tc(const AttentionTcBackward& p, DType dt, bool causal, cudaStream_t stream) {
  const AttentionTcForward& f = p.f;
  if (!tc_inputs_ok(f, dt, causal) || !aligned16(p.dout) || !aligned16(p.dq) || !aligned16(p.dk) ||
      !aligned16(p.dv))
    return false;
  if (f.B == 0 || f.Tq == 0 || f.Tk == 0) return true;
  if (f.HD == 64)
    launch_bwd_tc<64>(p, causal, stream);
  else
    launch_bwd_tc<128>(p, causal, stream);
  return true;
}

}  // namespace mpigpt::cuda
