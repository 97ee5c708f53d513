// CUDA backend: the causal bf16 attention backward on Hopper's warpgroup products (wgmma,
// cuda_wgmma.cuh), head dims 64 and 128. Compiled for sm_90a only (CMakeLists.txt: files named
// *_sm90a.cu), so it runs on H100/H200-class GPUs, in place of the mma.sync kernels of
// cuda_attention_tc_bwd.cu when engine.attention_backend = wgmma, or auto measured it faster
// (cuda_attention_causal.cu; docs/performance.md).
//
// The algorithm is cuda_attention_tc_bwd.cu's, deterministic as it is (every gradient element
// summed by one thread in a fixed order, no atomics): a dQ kernel per 64-query tile, a dK/dV kernel
// per 64-key tile summing over the query heads of its kv head. What changes is how the tile
// products run: each 128-thread block is one warpgroup, and every product is a chain of wgmma
// instructions (64 rows x N columns x 16 per instruction) that read their shared-memory operands
// through descriptors, where the mma.sync kernels issue 16 x 8 x 16 products fed by ldmatrix.
// Score-like products (S, dP and their transposes) read their B operand K-major from shared memory
// and take their A operand, the block's own rows that stay the same for every tile (Q and dO in the
// dQ kernel; K, and at HD 64 V, in the dK/dV kernel, as far as the registers allow), from
// registers: an instruction that reads both operands from shared memory (m64n64k16: 4 KB per 32
// cycles of tensor work) would use all of the shared-memory bandwidth. The gradient products take
// the probabilities or dS from registers (the accumulator layout is an A operand's) and read Q, dO
// or K MN-major from the same tiles. Tiles are stored in the canonical core-matrix layout
// (cm_index) by 16-byte asynchronous copies, two or three buffers deep (wg_two_buffers below).
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

// The canonical tiles of the block's 128 threads (one warpgroup).
template <int HD, int ROWS>
__device__ __forceinline__ void load_cm_async(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  wg::load_tile_async<HD, ROWS, kTcThreads>(dst, src, stride, row0, end);
}

template <int HD>
constexpr int kWgDqKeys = 64;  // the dQ kernel's key tile (the mma.sync kernel's kDqCols)

// Tile buffers. With 3, a tile's gradient products (dQ; dV and dK) stay in flight while the next
// tile's score products are issued behind them: the loop waits for both together, so the tensor
// cores are not left idle between the two chains while the warpgroup waits, and a buffer is
// refilled only after the barrier that follows its last reader's retirement (two tiles later).
// With 2, each tile's products are retired before the next tile. HD 128 has 2 only: the dQ
// kernel's three buffers (128 KiB of shared memory) would leave one block per multiprocessor, and
// with the dK/dV kernel's accumulators in flight across tiles ptxas serializes its wgmmas (C7515:
// at 199 registers it defines accumulator registers between the products). At HD 64, 3 unless
// MPIGPT_ATTENTION_WG_TWO_BUFFERS is set (kept for measuring the one against the other).
bool wg_two_buffers() { return attention_switch("MPIGPT_ATTENTION_WG_TWO_BUFFERS"); }

using wg::tile_landed;

// dq = dS K / sqrt(HD) for the 64 queries [i0, i0+64) of head h, batch row b (causal).
// grid (ceil(T/64), NH, B).
template <int HD, int NB>
__global__ void __launch_bounds__(kTcThreads, 2) attention_bwd_dq_wg_kernel(const AttentionTcBackward pb) {
#if MPIGPT_WGMMA_CODE
  constexpr int KS = HD / 16, DT = HD / 8, KC = kWgDqKeys<HD>, NT = KC / 8, KCS = KC / 16;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_wg_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_wg_smem);
  bf16* dOs = Qs + kTcRows * HD;
  bf16* KVs = dOs + kTcRows * HD;  // [NB] x (K, V), KC x HD each
  float* lse2_s = reinterpret_cast<float*>(KVs + NB * 2 * KC * HD);

  const QueryBlock qb = query_block<true>(p);
  const int g = qb.g, t = qb.t, h = qb.h, b = qb.b, i0 = qb.i0, wr = qb.wr;
  const int rows[2] = {qb.rows[0], qb.rows[1]};
  const bf16 *K = qb.K, *V = qb.V;
  const int64_t ldo = int64_t(p.NH) * HD;
  load_cm_async<HD, kTcRows>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                             p.q_stride, i0, p.Tq);
  load_cm_async<HD, kTcRows>(dOs, static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * HD,
                             ldo, i0, p.Tq);
  __pipeline_commit();  // Q and dO
  load_cm_async<HD, KC>(KVs, K, p.kv_stride, 0, p.Tk);
  load_cm_async<HD, KC>(KVs + KC * HD, V, p.kv_stride, 0, p.Tk);
  if (threadIdx.x < kTcRows) {
    const int ii = i0 + threadIdx.x;
    // -inf for a query past Tq or one that saw no key: no gradient flows through it.
    lse2_s[threadIdx.x] = ii < p.Tq ? p.lse[(int64_t(b) * p.NH + h) * p.Tq + ii] * kTcLog2e : -INFINITY;
  }
  float Dr[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr)
    Dr[rr] = rows[rr] < p.Tq ? pb.D[(int64_t(b) * p.NH + h) * p.Tq + rows[rr]] : 0.f;
  __pipeline_commit();  // the first key tile
  tile_landed();         // Q, dO and the first key tile
  const float lse2[2] = {lse2_s[wr + g], lse2_s[wr + g + 8]};
  // The warp's Q and dO rows, the A operands of S and dP for every key tile, stay in registers:
  // those products read only K and V from shared memory.
  uint32_t qa[KS][4], doa[KS][4];
  wg::load_a_regs<HD, KS>(qa, Qs, wr);
  wg::load_a_regs<HD, KS>(doa, dOs, wr);
  float dq[DT][4] = {};

  const int kend = min(p.Tk, i0 + kTcRows);
  for (int j0 = 0, n = 0; j0 < kend; j0 += KC, ++n) {
    const bf16* Ks = KVs + (n % NB) * 2 * KC * HD;
    const bf16* Vs = Ks + KC * HD;
    if (n > 0) tile_landed();
    if (j0 + KC < kend) {  // the next key tile, into the buffer whose products were retired before the barrier
      bf16* next = KVs + ((n + 1) % NB) * 2 * KC * HD;
      load_cm_async<HD, KC>(next, K, p.kv_stride, j0 + KC, p.Tk);
      load_cm_async<HD, KC>(next + KC * HD, V, p.kv_stride, j0 + KC, p.Tk);
    }
    __pipeline_commit();

    float s[NT][4], dp[NT][4];  // no zero fill, as in the dK/dV kernel below
    wg::fence();
#pragma unroll
    for (int k = 0; k < KS; ++k) Wgmma<KC>::template rs<0>(s, qa[k], desc_k<HD>(Ks, k), k > 0);  // S = Q K^T
#pragma unroll
    for (int k = 0; k < KS; ++k) Wgmma<KC>::template rs<0>(dp, doa[k], desc_k<HD>(Vs, k), k > 0);  // dP = dO V^T
    wg::commit();
    wg::wait<0>();
    wg::fence_operands(s);
    wg::fence_operands(dp);
    // dS. A tile wholly visible to the warp's 16 queries (its last key at or before the first of
    // them, inside Tk; queries inside Tq, so each saw a key and has a finite lse) needs no mask:
    // most tiles of a long sequence, and the mask is a third of this per-element work.
    if (j0 + KC - 1 <= i0 + wr && j0 + KC <= p.Tk && i0 + wr + 16 <= p.Tq) {
      dq_scores_to_ds(s, dp, p.scale_log2, lse2, Dr, t, AllVisible{});
    } else {
      dq_scores_to_ds(s, dp, p.scale_log2, lse2, Dr, t, [&](int rr, int c) {
        const int j = j0 + c;
        return lse2[rr] != -INFINITY && j < p.Tk && j <= rows[rr];
      });
    }
    uint32_t a[KCS][4];
#pragma unroll
    for (int k = 0; k < KCS; ++k) acc_to_a<NT>(a[k], s, k);
    wg::fence_operands(dq);
    wg::fence();
#pragma unroll
    for (int k = 0; k < KCS; ++k) Wgmma<HD>::template rs<1>(dq, a[k], desc_mn<HD>(Ks, k), 1);  // dQ += dS K
    wg::commit();
    if constexpr (NB == 2) wg::wait<0>();  // else retired with the next tile's S and dP
  }
  wg::wait<0>();
  wg::fence_operands(dq);
  const float scale[2] = {pb.scale, pb.scale};
  store_rows<DT>(dq, static_cast<bf16*>(pb.dq) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD, p.q_stride,
                 rows[0], p.Tq, scale, pb.accumulate);
#else
  __trap();  // not sm_90a code: the host never launches it (wgmma_backward_available)
#endif
}

// dk = dS^T Q / sqrt(HD), dv = P^T dO for the 64 keys [j0, j0+64) of kv head kh, summed over its
// NH/NKV query heads (causal). grid (ceil(T/64), NKV, B).
template <int HD, int NB>
__global__ void __launch_bounds__(kTcThreads, 2) attention_bwd_dkdv_wg_kernel(const AttentionTcBackward pb) {
#if MPIGPT_WGMMA_CODE
  constexpr int KS = HD / 16, DT = HD / 8, QC = kBwdCols<HD>, NT = QC / 8, QS = QC / 16;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_wg_smem[];
  bf16* Ks = reinterpret_cast<bf16*>(attn_wg_smem);
  bf16* Vs = Ks + kTcRows * HD;
  bf16* QdOs = Vs + kTcRows * HD;  // [NB] x (Q, dO), QC x HD each
  // [NB] x QC of the query tile's lse (natural log, as saved) and D, copied with its Q and dO.
  float* lse_b = reinterpret_cast<float*>(QdOs + NB * 2 * QC * HD);
  float* D_b = lse_b + NB * QC;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int G = p.NH / p.NKV;
  const int kh = blockIdx.y, b = blockIdx.z;
  const int j0 = int(blockIdx.x) * kTcRows, wr = warp * 16;
  const int keys[2] = {j0 + wr + g, j0 + wr + g + 8};  // this lane's two keys
  const int64_t ldo = int64_t(p.NH) * HD;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * HD;
  load_cm_async<HD, kTcRows>(Ks, static_cast<const bf16*>(p.k) + kv_off, p.kv_stride, j0, p.Tk);
  load_cm_async<HD, kTcRows>(Vs, static_cast<const bf16*>(p.v) + kv_off, p.kv_stride, j0, p.Tk);
  __pipeline_commit();  // K and V
  // The query tiles, head by head: tile n is head kh*G + n/nq, queries j0 + (n%nq)*QC (queries
  // before the block's first key see none of its keys).
  const int nq = j0 < p.Tq ? (p.Tq - j0 + QC - 1) / QC : 0;
  auto q_src = [&](int n) {
    return static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(kh * G + n / nq) * HD;
  };
  auto do_src = [&](int n) {
    return static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(kh * G + n / nq) * HD;
  };
  // Tile n's Q, dO, lse and D into buffer n % NB (lse and D by 4-byte copies: a row of them need not
  // be 16-byte aligned; -inf and 0 past Tq, so that no gradient flows through those queries).
  auto tile_async = [&](int n) {
    const int i0 = j0 + (n % nq) * QC;
    bf16* Qn = QdOs + (n % NB) * 2 * QC * HD;
    load_cm_async<HD, QC>(Qn, q_src(n), p.q_stride, i0, p.Tq);
    load_cm_async<HD, QC>(Qn + QC * HD, do_src(n), ldo, i0, p.Tq);
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
  if (nq > 0) tile_async(0);
  __pipeline_commit();  // the first query tile
  tile_landed();        // K, V and the first query tile
  // The warp's K rows, the A operand of S^T for every query tile, stay in registers, so that S^T
  // reads only Q from shared memory; at HD 64 its V rows too (dP^T reads only dO). At HD 128 the V
  // rows' 32 registers are not there (K's take the kernel to 230), and dP^T reads both operands.
  constexpr bool kRegKV = HD == 64;
  uint32_t ka[KS][4], va[kRegKV ? KS : 1][4];
  wg::load_a_regs<HD, KS>(ka, Ks, wr);
  if constexpr (kRegKV) wg::load_a_regs<HD, KS>(va, Vs, wr);

  float dk[DT][4] = {}, dv[DT][4] = {};
  for (int n = 0; n < G * nq; ++n) {
    const int i0 = j0 + (n % nq) * QC;
    const bf16* Qs = QdOs + (n % NB) * 2 * QC * HD;
    const bf16* dOs = Qs + QC * HD;
    const float* lse_s = lse_b + (n % NB) * QC;
    const float* D_s = D_b + (n % NB) * QC;
    if (n > 0) tile_landed();
    if (n + 1 < G * nq) tile_async(n + 1);  // into the buffer whose products were retired before the barrier
    __pipeline_commit();

    // No zero fill: the first product of each chain does not read its accumulators (and a write to
    // them here, with the last tile's products in flight, would make ptxas serialize the wgmmas).
    float st[NT][4], dpt[NT][4];
    wg::fence();
#pragma unroll
    for (int k = 0; k < KS; ++k) {  // S^T = K Q^T, dP^T = V dO^T
      if constexpr (kRegKV) {
        Wgmma<QC>::template rs<0>(st, ka[k], desc_k<HD>(Qs, k), k > 0);
        Wgmma<QC>::template rs<0>(dpt, va[k], desc_k<HD>(dOs, k), k > 0);
      } else {
        Wgmma<QC>::template rs<0>(st, ka[k], desc_k<HD>(Qs, k), k > 0);
        Wgmma<QC>::template ss<0>(dpt, desc_k<HD>(Vs, k), desc_k<HD>(dOs, k), k > 0);
      }
    }
    wg::commit();
    wg::wait<0>();
    wg::fence_operands(st);
    wg::fence_operands(dpt);
    // P^T and dS^T. Unmasked when the warp's 16 keys (inside Tk) all precede the tile's first query
    // and the tile's queries are inside Tq (each saw a key: a finite lse), as in the dQ kernel.
    if (j0 + wr + 15 <= i0 && j0 + wr + 16 <= p.Tk && i0 + QC <= p.Tq) {
      dkdv_scores_to_p_ds(st, dpt, p.scale_log2, lse_s, D_s, t, AllVisible{});
    } else {
      dkdv_scores_to_p_ds(st, dpt, p.scale_log2, lse_s, D_s, t, [&](int rr, int x) {
        return keys[rr] < p.Tk && lse_s[x] != -INFINITY && keys[rr] <= i0 + x;
      });
    }
    uint32_t ap[QS][4], ads[QS][4];
#pragma unroll
    for (int k = 0; k < QS; ++k) {
      acc_to_a<NT>(ap[k], st, k);
      acc_to_a<NT>(ads[k], dpt, k);
    }
    wg::fence_operands(dv);
    wg::fence_operands(dk);
    wg::fence();
#pragma unroll
    for (int k = 0; k < QS; ++k) Wgmma<HD>::template rs<1>(dv, ap[k], desc_mn<HD>(dOs, k), 1);  // dV += P^T dO
#pragma unroll
    for (int k = 0; k < QS; ++k) Wgmma<HD>::template rs<1>(dk, ads[k], desc_mn<HD>(Qs, k), 1);  // dK += dS^T Q
    wg::commit();
    if constexpr (NB == 2) wg::wait<0>();  // else retired with the next tile's S^T and dP^T
  }
  wg::wait<0>();
  wg::fence_operands(dv);
  wg::fence_operands(dk);
  const float kscale[2] = {pb.scale, pb.scale}, vscale[2] = {1.f, 1.f};
  store_rows<DT>(dk, static_cast<bf16*>(pb.dk) + kv_off, p.kv_stride, keys[0], p.Tk, kscale, pb.accumulate);
  store_rows<DT>(dv, static_cast<bf16*>(pb.dv) + kv_off, p.kv_stride, keys[0], p.Tk, vscale, pb.accumulate);
#else
  __trap();
#endif
}

template <int HD, int NB>
constexpr size_t dq_wg_smem() {
  return size_t(2 * kTcRows + 2 * NB * kWgDqKeys<HD>) * HD * 2 + size_t(kTcRows) * 4;
}
template <int HD, int NB>
constexpr size_t dkdv_wg_smem() {
  constexpr size_t cols = size_t(NB) * kBwdCols<HD>;  // query rows buffered
  return (2 * kTcRows + 2 * cols) * HD * 2 + 2 * cols * 4;
}

template <int HD, int NB>
void launch_bwd_wg(const AttentionTcBackward& p, cudaStream_t stream) {
  static_assert(HD == 64 || NB == 2, "HD 128 has two tile buffers (see wg_two_buffers)");
  const unsigned tiles = unsigned((p.f.Tq + kTcRows - 1) / kTcRows);
  auto dq = attention_bwd_dq_wg_kernel<HD, NB>;
  auto dkdv = attention_bwd_dkdv_wg_kernel<HD, NB>;
  const size_t dq_bytes = dq_wg_smem<HD, NB>(), dkdv_bytes = dkdv_wg_smem<HD, NB>();
  allow_smem(dq, dq_bytes);
  allow_smem(dkdv, dkdv_bytes);
  const dim3 gq{tiles, unsigned(p.f.NH), unsigned(p.f.B)};
  const dim3 gk{tiles, unsigned(p.f.NKV), unsigned(p.f.B)};
  dq<<<gq, kTcThreads, dq_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
  dkdv<<<gk, kTcThreads, dkdv_bytes, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

bool attention_wgmma_available() {
  // The kernels exist only as sm_90a code: on another GPU there is no image to load.
  constexpr int kMaxDevices = 64;
  static int known[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  MPIGPT_CUDA(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) return false;
  if (known[dev] == 0) {
    cudaFuncAttributes a{};
    const cudaError_t rc = cudaFuncGetAttributes(&a, attention_bwd_dq_wg_kernel<64, 3>);
    if (rc != cudaSuccess) (void)cudaGetLastError();  // clear the sticky "no kernel image" error
    known[dev] = rc == cudaSuccess ? 1 : 2;
  }
  return known[dev] == 1;
}

bool attention_wg_applies(const AttentionTcBackward& p, DType dt, bool causal) {
  return causal && tc_inputs_ok(p.f, dt, causal) && aligned16(p.dout) && aligned16(p.dq) && aligned16(p.dk) &&
         aligned16(p.dv) && attention_wgmma_available();
}

bool attention_backward_wg(const AttentionTcBackward& p, DType dt, bool causal, cudaStream_t stream) {
  const AttentionTcForward& f = p.f;
  if (!attention_wg_applies(p, dt, causal)) return false;
  if (f.B == 0 || f.Tq == 0) return true;
  if (f.HD == 128)
    launch_bwd_wg<128, 2>(p, stream);
  else if (wg_two_buffers())
    launch_bwd_wg<64, 2>(p, stream);
  else
    launch_bwd_wg<64, 3>(p, stream);
  return true;
}

}  // namespace mpigpt::cuda
