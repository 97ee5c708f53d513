// CUDA backend: the bf16 tensor-core attention's backward (causal and explicitly masked), head
// dims 64 and 128; its layout and tiles are in cuda_attention_tc_tiles.cuh, the forward in
// cuda_attention_tc.cu.
//
// A dK/dV kernel per key tile summing over the query heads of its kv head works on the transposes
// S^T = K Q^T and dP^T = V dO^T (keys as rows), so that its products take their register operand
// from an accumulator tile: dV = P^T dO, dK = dS^T Q with dS = P (dP - D). dQ = dS K comes either
// from the same kernel (causal: dS^T goes through shared memory, and each key tile's share is added
// to an fp32 scratch in a fixed order, below), five tile products per key and query tile as in
// FlashAttention-2; or from a dQ kernel per query tile that recomputes S and dP with queries as rows
// (the masked backward, and the causal one under MPIGPT_ATTENTION_SPLIT_BWD): seven products, but
// every dQ element summed in registers. Either way the result does not depend on timing.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_attention_tc_tiles.cuh"

namespace mpigpt::cuda {

namespace {

using namespace tc;

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
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1, j = j0 + nt * 8 + 2 * t + (e & 1);
        bool vis = lse2[rr] != -INFINITY && j < p.Tk;
        if constexpr (kCausal)
          vis = vis && j <= rows[rr];
        else
          vis = vis && kseg_s[j - j0] == myqseg[rr] && kpos_s[j - j0] <= myqpos[rr];
        const float pr = vis ? exp2f(s[nt][e] * p.scale_log2 - lse2[rr]) : 0.f;
        s[nt][e] = pr != 0.f ? pr * (dp[nt][e] - Dr[rr]) : 0.f;  // dS
      }
    }
    warp_acc_times<NT, DT, LD>(dq, s, Ks);  // dQ += dS K
    if constexpr (kCausal) __syncthreads();  // this buffer's readers are done before it is refilled
  }
  const float scale[2] = {pb.scale, pb.scale};
  store_rows<DT>(dq, static_cast<bf16*>(pb.dq) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD, p.q_stride,
                 rows[0], p.Tq, scale, pb.accumulate);
}

// The fused causal backward's ordered dQ sum. The dK/dV kernel also forms each query tile's share
// of dQ from its 64 keys, dS K, and adds it to dq_acc (B,NH,Tq,HD f32); dq_store_kernel then writes
// dq = dq_acc / sqrt(HD). The shares of one query tile qt, from key tiles kmax(qt) down to 0, are
// added in that order, so the sum is deterministic: the first stores, the others add once a count
// per (b, h, qt) in `sync` says that all before them have. That is also the order in which they
// become ready, as key tile kt + 1 starts its queries one tile after kt and so reaches every query
// tile before it. Blocks take their key tiles in the same order by ticket (sync[0]), key tile
// nkt-1 of a (b, kv head) first, so a block only ever waits for blocks that already run: no
// deadlock, whatever order the hardware starts blocks in.

// The last key tile whose keys some query of query tile qt (QC queries) sees.
template <int QC>
__device__ __forceinline__ int last_key_tile(int qt, int nkt) {
  return min(nkt - 1, (qt * QC + QC - 1) / kTcRows);
}

// Waits until *count reaches want (every lane: each load is an acquire at GPU scope).
__device__ __forceinline__ void wait_count(const unsigned* count, unsigned want) {
#ifdef __CUDACC__
  for (unsigned spins = 0;; ++spins) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(count) : "memory");
    if (v >= want) return;
    if (spins == (1u << 24)) __trap();  // a count that never comes is a bug: fail the launch, do not hang
  }
#else
  // The emulator runs blocks one at a time in ticket order: the count must be there already.
  if (*count < want) {
    std::fprintf(stderr, "attention backward: dQ count %u, waiting for %u: the order of key tiles is broken\n",
                 *count, want);
    std::abort();
  }
#endif
}

// Counts one more share added, after the block's barrier: the fence (cumulative over the barrier)
// makes every thread's additions visible GPU-wide before the count is.
__device__ __forceinline__ void signal_count(unsigned* count) {
  __threadfence();
  atomicAdd(count, 1u);
}

// dk, dv (=, or +=) for the 64 keys [j0, j0+64) of kv head kh, summed over its NH/NKV query heads:
// dK = dS^T Q / sqrt(HD), dV = P^T dO. grid (ceil(Tk/64), NKV, B); with kFuseDq (causal only) a
// 1-D grid of B * NKV * ceil(Tk/64) blocks taking their key tiles by ticket, which also add the
// dQ shares to dq_acc (above).
template <int HD, bool kCausal, bool kFuseDq>
__global__ void __launch_bounds__(kTcThreads, (kDkdvMinBlocks<HD, kCausal>))
    attention_bwd_dkdv_tc_kernel(const AttentionTcBackward pb) {
  static_assert(kCausal || !kFuseDq, "the fused dQ is causal only");
  constexpr int LD = kLd<HD>, KS = HD / 16, DT = HD / 8, QC = kBwdCols<HD>, NT = QC / 8;
  constexpr int LDS = QC + 8;  // dS^T rows (bf16), padded as the other tiles
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
  bf16* dSs = reinterpret_cast<bf16*>(kseg_b + kTcRows);  // kFuseDq: dS^T, [64 keys][LDS]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int G = p.NH / p.NKV, nkt = (p.Tk + kTcRows - 1) / kTcRows;
  int kt = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
  if constexpr (kFuseDq) {
    __shared__ unsigned ticket_s;
    if (threadIdx.x == 0) ticket_s = atomicAdd(pb.sync, 1u);
    __syncthreads();
    const unsigned ticket = ticket_s, group = ticket / unsigned(nkt);
    kt = nkt - 1 - int(ticket % unsigned(nkt));
    kh = int(group % unsigned(p.NKV));
    b = int(group / unsigned(p.NKV));
  }
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
  unsigned* added = nullptr;  // kFuseDq: the count of the query tile this block added to last
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
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = e >> 1, x = nt * 8 + 2 * t + (e & 1);
        bool vis = keys[rr] < p.Tk && lse_s[x] != -INFINITY;
        if constexpr (kCausal)
          vis = vis && keys[rr] <= i0 + x;
        else
          vis = vis && qseg_s[x] == mykseg[rr] && mykpos[rr] <= qpos_s[x];
        const float pr = vis ? exp2f(st[nt][e] * p.scale_log2 - lse_s[x] * kTcLog2e) : 0.f;
        st[nt][e] = pr;                                             // P^T
        dpt[nt][e] = pr != 0.f ? pr * (dpt[nt][e] - D_s[x]) : 0.f;  // dS^T
      }
    }
    if constexpr (kFuseDq) {  // dS^T in bf16 (as the dK product rounds it) for the dQ product
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const uint32_t x = mma::pack_bf16(dpt[nt][2 * rr], dpt[nt][2 * rr + 1]);
          std::memcpy(dSs + (wr + g + 8 * rr) * LDS + nt * 8 + 2 * t, &x, 4);
        }
      }
    }
    warp_acc_times<NT, DT, LD>(dv, st, dOs);  // dV += P^T dO
    warp_acc_times<NT, DT, LD>(dk, dpt, Qs);  // dK += dS^T Q
    if constexpr (kFuseDq) {
      __syncthreads();  // dS^T is complete; every thread's additions to the previous query tile are issued
      if (threadIdx.x == 0 && added) signal_count(added);
      // The share of query tile qt of head hq: each warp 16 of its QC rows and HD/CW of its columns,
      // in passes of PC columns (fewer live registers beside dK and dV).
      constexpr int RW = QC / 16, CW = 4 / RW, PC = HD == 128 ? 32 : 64;
      const int hq = kh * G + n / nq, qt = i0 / QC, nqt = (p.Tq + QC - 1) / QC;
      const int rank = last_key_tile<QC>(qt, nkt) - kt;  // 0: the first share
      added = pb.sync + 1 + (int64_t(b) * p.NH + hq) * nqt + qt;
      const int r0 = (warp % RW) * 16, c0 = (warp / RW) * (HD / CW);
      if (rank > 0) wait_count(added, unsigned(rank));
      float* acc = pb.dq_acc + ((int64_t(b) * p.NH + hq) * p.Tq + i0) * HD;
#pragma unroll
      for (int pass = 0; pass < HD / CW / PC; ++pass) {
        const int c = c0 + pass * PC;
        float part[PC / 8][4] = {};
        mma::warp_atb<kTcRows / 16, PC / 8, LDS, LD>(part, dSs, r0, Ks + c);  // dS K
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int row = r0 + g + 8 * rr;
          if (i0 + row >= p.Tq) continue;
          float2* dst = reinterpret_cast<float2*>(acc + int64_t(row) * HD + c + 2 * t);
#pragma unroll
          for (int nt = 0; nt < PC / 8; ++nt) {
            const float2 v = make_float2(part[nt][2 * rr], part[nt][2 * rr + 1]);
            if (rank == 0)
              dst[4 * nt] = v;
            else
              atomicAdd(dst + 4 * nt, v);
          }
        }
      }
    }
    if constexpr (kCausal) __syncthreads();  // this buffer's and the query data's readers are done
  }
  if constexpr (kFuseDq) {
    __syncthreads();
    if (threadIdx.x == 0 && added) signal_count(added);
  }
  const float kscale[2] = {pb.scale, pb.scale}, vscale[2] = {1.f, 1.f};
  store_rows<DT>(dk, static_cast<bf16*>(pb.dk) + kv_off, p.kv_stride, keys[0], p.Tk, kscale, pb.accumulate);
  store_rows<DT>(dv, static_cast<bf16*>(pb.dv) + kv_off, p.kv_stride, keys[0], p.Tk, vscale, pb.accumulate);
}

// dq (=, or += when accumulate) = dq_acc / sqrt(HD), eight elements per thread, in the order of dq's
// rows. grid ceil(B * Tq * NH * HD / 8 / 256) of 256 threads.
template <int HD>
__global__ void dq_store_kernel(const AttentionTcBackward pb) {
  const AttentionTcForward& p = pb.f;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.B) * p.Tq * p.NH * (HD / 8)) return;
  const int d = int(idx % (HD / 8)) * 8;
  int64_t r = idx / (HD / 8);
  const int h = int(r % p.NH);
  r /= p.NH;
  const int i = int(r % p.Tq), b = int(r / p.Tq);
  const float* src = pb.dq_acc + ((int64_t(b) * p.NH + h) * p.Tq + i) * HD + d;
  bf16* dst = static_cast<bf16*>(pb.dq) + (int64_t(b) * p.Tq + i) * p.q_stride + int64_t(h) * HD + d;
  const Pack<float, 4> lo = load_pack<4>(src), hi = load_pack<4>(src + 4);
  Pack<bf16, 8> out;
  if (pb.accumulate) out = load_pack<8>(dst);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float x = (e < 4 ? lo.v[e] : hi.v[e - 4]) * pb.scale;
    if (pb.accumulate) x += __bfloat162float(out.v[e]);
    out.v[e] = __float2bfloat16_rn(x);
  }
  store_pack<8>(dst, out);
}

template <int HD, bool kCausal>
constexpr size_t dq_smem() {
  return 2 * tile_bytes<HD>(kTcRows) + (kCausal ? 4 : 2) * tile_bytes<HD>(kDqCols<HD>) +
         size_t(3 * kTcRows + 2 * kDqCols<HD>) * 4;
}
template <int HD, bool kCausal, bool kFuseDq>
constexpr size_t dkdv_smem() {
  return 2 * tile_bytes<HD>(kTcRows) + (kCausal ? 4 : 2) * tile_bytes<HD>(kBwdCols<HD>) +
         size_t((kCausal ? 6 : 4) * kBwdCols<HD> + 2 * kTcRows) * 4 +
         (kFuseDq ? size_t(kTcRows) * (kBwdCols<HD> + 8) * 2 : 0);
}

template <int HD>
void launch_bwd_tc(const AttentionTcBackward& p, bool causal, cudaStream_t stream) {
  const int nkt = (p.f.Tk + kTcRows - 1) / kTcRows;
  if (causal && p.dq_acc && p.sync) {  // the fused backward
    const size_t sync_bytes = attention_backward_tc_scratch(p.f, DType::BF16, true).sync_bytes;
    MPIGPT_CUDA(cudaMemsetAsync(p.sync, 0, sync_bytes, stream));
    constexpr size_t bytes = dkdv_smem<HD, true, true>();
    allow_smem(attention_bwd_dkdv_tc_kernel<HD, true, true>, bytes);
    const int64_t blocks = int64_t(p.f.B) * p.f.NKV * nkt;
    MPIGPT_CHECK(blocks <= INT32_MAX, "attention backward: {} key tiles exceed the CUDA grid", blocks);
    attention_bwd_dkdv_tc_kernel<HD, true, true><<<unsigned(blocks), kTcThreads, bytes, stream>>>(p);
    MPIGPT_CUDA_LAUNCHED();
    const int64_t threads = int64_t(p.f.B) * p.f.Tq * p.f.NH * (HD / 8);
    dq_store_kernel<HD><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(p);
    MPIGPT_CUDA_LAUNCHED();
    return;
  }
  auto dq = causal ? attention_bwd_dq_tc_kernel<HD, true> : attention_bwd_dq_tc_kernel<HD, false>;
  auto dkdv = causal ? attention_bwd_dkdv_tc_kernel<HD, true, false> : attention_bwd_dkdv_tc_kernel<HD, false, false>;
  const size_t dq_bytes = causal ? dq_smem<HD, true>() : dq_smem<HD, false>();
  allow_smem(dq, dq_bytes);
  const size_t dkdv_bytes = causal ? dkdv_smem<HD, true, false>() : dkdv_smem<HD, false, false>();
  allow_smem(dkdv, dkdv_bytes);
  const dim3 gq(unsigned((p.f.Tq + kTcRows - 1) / kTcRows), unsigned(p.f.NH), unsigned(p.f.B));
  const dim3 gk(unsigned(nkt), unsigned(p.f.NKV), unsigned(p.f.B));
  dq<<<gq, kTcThreads, dq_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
  dkdv<<<gk, kTcThreads, dkdv_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

AttentionTcScratch attention_backward_tc_scratch(const AttentionTcForward& f, DType dt, bool causal) {
  AttentionTcScratch s;
  if (!causal || dt != DType::BF16 || (f.HD != 64 && f.HD != 128)) return s;
  const int QC = f.HD == 64 ? kBwdCols<64> : kBwdCols<128>;
  const int64_t nqt = (int64_t(f.Tq) + QC - 1) / QC;
  s.dq_acc_bytes = size_t(f.B) * f.NH * f.Tq * f.HD * sizeof(float);
  s.sync_bytes = size_t(1 + int64_t(f.B) * f.NH * nqt) * sizeof(unsigned);
  return s;
}

bool attention_backward_tc(const AttentionTcBackward& p, DType dt, bool causal, cudaStream_t stream) {
  const AttentionTcForward& f = p.f;
  if (dt != DType::BF16 || (f.HD != 64 && f.HD != 128)) return false;
  if (!aligned16(f.q) || !aligned16(f.k) || !aligned16(f.v) || !aligned16(p.dout) || !aligned16(p.dq) ||
      !aligned16(p.dk) || !aligned16(p.dv))
    return false;
  if (f.q_stride % 8 != 0 || f.kv_stride % 8 != 0) return false;
  if (!causal && (!f.qpos || !f.qseg || !f.kpos || !f.kseg)) return false;
  if (f.B == 0 || f.Tq == 0 || f.Tk == 0) return true;
  if (f.HD == 64)
    launch_bwd_tc<64>(p, causal, stream);
  else
    launch_bwd_tc<128>(p, causal, stream);
  return true;
}

}  // namespace mpigpt::cuda
