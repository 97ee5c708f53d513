// CUDA backend, private: what the bf16 tensor-core attention's forward (cuda_attention_tc.cu) and
// backward (cuda_attention_tc_bwd.cu) share: the block layout, the tile sizes, and the loads and
// stores of shared-memory tiles.
#pragma once

#include <cuda_pipeline_primitives.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"
#include "lib/kernels/cuda/cuda_mma.cuh"

namespace mpigpt::cuda::tc {

using mma::load_a_all;
using mma::warp_abt;
using mma::warp_abt_m;
using mma::warp_acc_times;
using mma::warp_acc_times_m;

// Same contract and algorithm as the fp32-FMA kernels (online softmax in fp32 and base 2, lse saved
// in natural log, -inf lse and 0 output for a query with no visible key; the backward recomputes P
// from the lse), on mma.sync (cuda_mma.cuh): the score, probability and output tiles stay in
// registers, and shared memory holds only the bf16 Q, K, V (and dO) tiles that ldmatrix feeds to
// the products.
// Layout: 128 threads = 4 warps, each owning 16 rows of the block's 64 (queries in the masked
// forward and the dQ kernel, keys in the dK/dV kernel), or two m-tiles of 16, 32 consecutive rows
// of the block's 128 (the causal forward: kFwdRows). Lane l holds rows g = l/4 and g+8 of each
// m-tile of 16, at columns 2t and 2t+1 (t = l%4) of every 8-column tile: the row max and sum of
// the softmax reduce over the four lanes of a group. P is rounded to bf16 only as the operand of
// the next product; the row sum l (hence lse) is taken over the fp32 P.
constexpr int kTcThreads = 128;  // 4 warps
constexpr int kTcRows = 64;      // rows per block, 16 per warp
constexpr float kTcLn2 = 0.6931471805599453f;
constexpr float kTcLog2e = 1.4426950408889634f;

using ptx::exp2_ftz;  // 2^x for the softmax's probabilities and rescale factors

// The backward's per-score step with every score of the tile visible to the warp (a causal tile
// wholly at or before its rows, inside Tk and Tq): no mask tests, selects or zero guards.
struct AllVisible {};

// The dQ kernels' per-score step, in place of the scores s (dp: dO V^T) of this lane's two query
// rows rr = 0, 1 (lse2, base 2, and D per row) at tile columns c = 8 nt + 2t + {0, 1}: P = 2^(s
// scale_log2 - lse2) where visible(rr, c), 0 elsewhere, and dS = P (dP - D).
template <int NT, class Visible>
__device__ __forceinline__ void dq_scores_to_ds(float (&s)[NT][4], const float (&dp)[NT][4], float scale_log2,
                                                const float (&lse2)[2], const float (&D)[2], int t,
                                                Visible visible) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rr = e >> 1;
      if constexpr (std::is_same_v<Visible, AllVisible>) {
        s[nt][e] = exp2_ftz(s[nt][e] * scale_log2 - lse2[rr]) * (dp[nt][e] - D[rr]);
      } else {
        const float pr = visible(rr, nt * 8 + 2 * t + (e & 1)) ? exp2_ftz(s[nt][e] * scale_log2 - lse2[rr]) : 0.f;
        s[nt][e] = pr != 0.f ? pr * (dp[nt][e] - D[rr]) : 0.f;
      }
    }
}

// The dK/dV kernels' per-score step, in place of S^T and dP^T of this lane's two key rows rr = 0, 1
// at the tile's query columns c = 8 nt + 2t + {0, 1} (lse, natural log as saved, and D per column):
// P^T = 2^(s scale_log2 - lse log2(e)) where visible(rr, c), 0 elsewhere, and dS^T = P^T (dP^T - D).
template <int NT, class Visible>
__device__ __forceinline__ void dkdv_scores_to_p_ds(float (&st)[NT][4], float (&dpt)[NT][4], float scale_log2,
                                                    const float* lse, const float* D, int t, Visible visible) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + 2 * t + (e & 1);
      if constexpr (std::is_same_v<Visible, AllVisible>) {
        st[nt][e] = exp2_ftz(st[nt][e] * scale_log2 - lse[c] * kTcLog2e);
        dpt[nt][e] = st[nt][e] * (dpt[nt][e] - D[c]);
      } else {
        const float pr = visible(e >> 1, c) ? exp2_ftz(st[nt][e] * scale_log2 - lse[c] * kTcLog2e) : 0.f;
        st[nt][e] = pr;                                        // P^T
        dpt[nt][e] = pr != 0.f ? pr * (dpt[nt][e] - D[c]) : 0.f;  // dS^T
      }
    }
}

// Shared tiles: bf16 rows of HD elements and 8 of padding (the row stride of HD + 8 elements puts
// the eight rows an ldmatrix reads in distinct 16-byte bank groups).
template <int HD>
constexpr int kLd = HD + 8;
template <int HD>
__host__ __device__ constexpr size_t tile_bytes(int rows) {
  return size_t(rows) * kLd<HD> * 2;
}
// The other dimension's tile width: the key tile of the forward and the dQ kernel, the query tile of
// the dK/dV kernel. 32 at HD 128 keeps the backward's register tiles (two 16 x HD accumulators and
// two 16 x tile score tiles per warp) within the register file.
template <int HD>
constexpr int kFwdCols = 64;
// Queries per block of the forward: causal blocks give each warp two m-tiles of 16 rows, so that
// every K and V fragment it reads from shared memory feeds two products (FlashAttention-2's
// forward layout); the masked forward keeps 64 (its key-tile vote is written for 64 rows).
template <bool kCausal>
constexpr int kFwdRows = kCausal ? 128 : 64;
// Whether the forward keeps the warp's Q fragments in registers for every key tile: not at HD 128
// with two m-tiles, where they would take 64 registers beside the 128 of the output accumulators.
template <int HD, bool kCausal>
constexpr bool kFwdRegQ = !(HD == 128 && kFwdRows<kCausal> > kTcRows);
template <int HD>
constexpr int kBwdCols = HD == 128 ? 32 : 64;
// The dQ kernel's key tile: it holds one 16 x HD accumulator, so 64 fits at HD 128 too. At HD 128
// it also keeps the warp's Q and dO rows (the A operands of S and dP) in registers for the whole
// kernel instead of reading them from shared memory at every key tile. Measured on an H200
// (causal, bf16, the GPT-2 1.3B shape B 32, 16 heads, T 1024): backward 3.17 -> 3.09 ms; at HD 64
// neither change helped.
template <int HD>
constexpr int kDqCols = 64;
template <int HD>
constexpr bool kDqRegA = HD == 128;
// Blocks per multiprocessor the dK/dV kernel is compiled for (registers <= 65536 / (128 * N)): at
// HD 64, 3 instead of the 2 that its 218 registers allow (a 12-byte spill) took the GPT-2 124M
// shape's backward (B 64, 12 heads, T 1024) from 2.96 to 2.45 ms on an H200, and the Llama 1B
// shape's (B 8, 32 heads over 8 kv heads, T 2048) from 3.88 to 3.26 ms. The masked kernel would
// spill 88 bytes there and has not been measured, so it keeps the compiler's choice.
template <int HD, bool kCausal>
constexpr int kDkdvMinBlocks = HD == 64 && kCausal ? 3 : 1;

// dst [ROWS][HD + 8] (shared) = rows [row0, row0 + ROWS) of the strided bf16 matrix src (HD
// columns); rows at or past end are zero. 16-byte chunks: src, stride and HD are multiples of 8.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  constexpr int kChunks = HD / 8, LD = kLd<HD>;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kTcThreads) {
    const int r = idx / kChunks, c = (idx - r * kChunks) * 8, row = row0 + r;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (row < end) x = *reinterpret_cast<const uint4*>(src + int64_t(row) * stride + c);
    *reinterpret_cast<uint4*>(dst + r * LD + c) = x;
  }
}

// The same through asynchronous copies (cp.async, one 16-byte chunk each) into the current batch;
// rows past end are zeroed by plain stores. The caller commits the batch and waits for it.
template <int HD, int ROWS>
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  constexpr int kChunks = HD / 8, LD = kLd<HD>;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kTcThreads) {
    const int r = idx / kChunks, c = (idx - r * kChunks) * 8, row = row0 + r;
    if (row < end)
      __pipeline_memcpy_async(dst + r * LD + c, src + int64_t(row) * stride + c, 16);
    else
      *reinterpret_cast<uint4*>(dst + r * LD + c) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The 32-bit mask vectors of N positions [x0, x0 + N) of batch row b (0 past end).
template <int N>
__device__ __forceinline__ void load_mask(int* pos_s, int* seg_s, const int32_t* pos, const int32_t* seg, int b,
                                          int T, int x0) {
  for (int x = threadIdx.x; x < N; x += kTcThreads) {
    const int i = x0 + x;
    pos_s[x] = i < T ? pos[int64_t(b) * T + i] : 0;
    seg_s[x] = i < T ? seg[int64_t(b) * T + i] : 0;
  }
}

// Rows row_a and row_a + 8 (those below end) of a strided bf16 matrix (=, or += when acc) = the
// accumulator tile times scale[0] (row_a) or scale[1] (row_a + 8); lane t writes columns 2t, 2t+1
// of every 8-column tile.
template <int DT>
__device__ __forceinline__ void store_rows(const float (&x)[DT][4], bf16* base, int64_t stride, int row_a, int end,
                                           const float (&scale)[2], bool acc) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = row_a + 8 * rr;
    if (row >= end) continue;
    bf16* dst = base + int64_t(row) * stride + 2 * t;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      float a = x[dt][2 * rr] * scale[rr], z = x[dt][2 * rr + 1] * scale[rr];
      __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(dst + dt * 8);
      if (acc) {
        const float2 old = __bfloat1622float2(*q);
        a += old.x;
        z += old.y;
      }
      *q = __floats2bfloat162_rn(a, z);
    }
  }
}

// What the forward and the dQ kernel know of their block of 64 queries: its query tile
// (cuda_kernel_util.cuh: head, batch row, first query, the kv head's K and V), the lane's fragment
// coordinates g and t (cuda_mma.cuh), its warp's first row wr and its two queries.
struct QueryBlock : QueryTile<bf16> {
  int g, t, wr;
  int rows[2];
};
template <bool kCausal>
__device__ __forceinline__ QueryBlock query_block(const AttentionTcForward& p) {
  QueryBlock q;
  static_cast<QueryTile<bf16>&>(q) = query_tile<bf16, kTcRows, kCausal>(p);
  const int lane = threadIdx.x & 31;
  q.g = lane >> 2;
  q.t = lane & 3;
  q.wr = (threadIdx.x >> 5) * 16;
  q.rows[0] = q.i0 + q.wr + q.g;
  q.rows[1] = q.rows[0] + 8;
  return q;
}

// The mask entries of the lane's two rows (wr + g and wr + g + 8 of the block's vectors).
__device__ __forceinline__ void lane_rows(int (&pos)[2], int (&seg)[2], const int* pos_s, const int* seg_s, int wr,
                                          int g) {
  for (int rr = 0; rr < 2; ++rr) {
    pos[rr] = pos_s[wr + g + 8 * rr];
    seg[rr] = seg_s[wr + g + 8 * rr];
  }
}

// The key tiles of the forward and the dQ kernel, K and V in shared memory at KVs (a K tile of KC
// rows, then its V tile). Causal tiles go through a two-buffer cp.async pipeline: kv_first issues
// tile 0, and kv_next, at the top of iteration n, issues tile n+1 into the other buffer (whose
// readers finished at the barrier that ends iteration n-1) and waits for tile n.
template <int HD, int KC>
__device__ __forceinline__ void kv_first(bf16* KVs, const bf16* K, const bf16* V, int64_t stride, int Tk) {
  load_tile_async<HD, KC>(KVs, K, stride, 0, Tk);
  load_tile_async<HD, KC>(KVs + KC * kLd<HD>, V, stride, 0, Tk);
  __pipeline_commit();
}
template <int HD, int KC>
__device__ __forceinline__ void kv_next(bf16* KVs, const bf16* K, const bf16* V, int64_t stride, int Tk, int n,
                                        int j0, int kend) {
  if (j0 + KC < kend) {
    bf16* next = KVs + ((n + 1) & 1) * 2 * KC * kLd<HD>;
    load_tile_async<HD, KC>(next, K, stride, j0 + KC, Tk);
    load_tile_async<HD, KC>(next + KC * kLd<HD>, V, stride, j0 + KC, Tk);
  }
  __pipeline_commit();
  __pipeline_wait_prior(1);
  __syncthreads();
}
// Masked tiles (one buffer): the key mask of [j0, j0 + KC) to kpos_s/kseg_s and a block vote (thread
// x checks block row x/2 against half of the keys; rows at or past Tq, or with lse2_s -inf when
// given, count as seeing nothing). Loads K and V and returns true when some row sees some key;
// returns false, loading nothing, otherwise.
template <int HD, int KC>
__device__ __forceinline__ bool kv_masked(bf16* KVs, const bf16* K, const bf16* V, const AttentionTcForward& p, int b,
                                          int i0, int j0, const int* qpos_s, const int* qseg_s, int* kpos_s,
                                          int* kseg_s, const float* lse2_s) {
  __syncthreads();  // the previous tile's readers of the K/V tiles and the key mask are done
  load_mask<KC>(kpos_s, kseg_s, p.kpos, p.kseg, b, p.Tk, j0);
  __syncthreads();
  bool any = false;
  const int rr = threadIdx.x >> 1, x0 = (threadIdx.x & 1) * (KC / 2);
  if (i0 + rr < p.Tq && (!lse2_s || lse2_s[rr] != -INFINITY)) {
    const int qp = qpos_s[rr], qs = qseg_s[rr];
    for (int x = x0; x < x0 + KC / 2; ++x) any = any || (j0 + x < p.Tk && kseg_s[x] == qs && kpos_s[x] <= qp);
  }
  if (!__syncthreads_or(any)) return false;
  load_tile<HD, KC>(KVs, K, p.kv_stride, j0, p.Tk);
  load_tile<HD, KC>(KVs + KC * kLd<HD>, V, p.kv_stride, j0, p.Tk);
  __syncthreads();
  return true;
}

// What both directions need of a problem: bf16, head dim 64 or 128, q, k and v 16-byte aligned with
// strides of whole 8-element groups (16-byte loads, 4-byte stores), and the mask arrays when not
// causal.
inline bool tc_inputs_ok(const AttentionTcForward& p, DType dt, bool causal) {
  if (dt != DType::BF16 || (p.HD != 64 && p.HD != 128)) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return false;
  if (p.q_stride % 8 != 0 || p.kv_stride % 8 != 0) return false;
  return causal || (p.qpos && p.qseg && p.kpos && p.kseg);
}

// Above 48 KiB a kernel must opt in to its dynamic shared memory (per device, so on every call).
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace mpigpt::cuda::tc
