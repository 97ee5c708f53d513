// CUDA backend: the bf16 tensor-core attention forward (causal and explicitly masked), for head dims
// 64 and 128. Same contract and algorithm as cuda_attention.cu's attention_fwd_kernel (online
// softmax in fp32 and base 2, lse saved in natural log, -inf lse and 0 output for a query with no
// visible key) but the two products run on tensor cores through nvcuda::wmma: bf16 16x16x16
// fragments with fp32 accumulators.
//
// Layout: 128 threads = 4 warps; the block owns 64 queries, each warp 16 of them. Per key tile of
// 64: K and V tiles go to shared memory as bf16; each warp computes its S = Q K^T (16 x 64) into
// accumulator fragments and stores it to a per-warp fp32 scratch; the softmax is then done from
// shared memory with two lanes per row (lane 2r + t holds row r's columns 2c + t), which writes P
// as bf16 to a per-warp tile and rescales the row's output; the output O (16 x HD, fp32) lives in
// a per-warp shared tile that each tile's O += P V loads into accumulator fragments and stores
// back. The row sum l (hence lse, which the backward uses to recompute P) is taken over the fp32 P;
// only the P V product sees P rounded to bf16.
//
// Every wmma pointer is 32-byte aligned (the tile strides below keep every region and fragment
// origin on a 32-byte boundary) and every leading dimension a multiple of 8 (bf16) or 4 (fp32).
#include "lib/kernels/cuda/cuda_attention_tc.cuh"

#include <mma.h>

#include <cmath>
#include <cstdint>

namespace mpigpt::cuda {

namespace {

constexpr int kTcThreads = 128;  // 4 warps
constexpr int kTcRows = 64;      // queries per block, 16 per warp
constexpr int kTcCols = 64;      // keys per tile
constexpr float kTcLn2 = 0.6931471805599453f;

template <int HD>
struct TcLayout {
  static constexpr int LDB = HD + 8;        // bf16 Q, K, V tiles (row stride in elements)
  static constexpr int LDS = kTcCols + 4;   // fp32 S scratch
  static constexpr int LDP = kTcCols + 8;   // bf16 P tile
  static constexpr int LDO = HD + 4;        // fp32 O tile
  static constexpr size_t q_bytes = size_t(kTcRows) * LDB * 2;
  static constexpr size_t kv_bytes = size_t(kTcCols) * LDB * 2;
  static constexpr size_t s_bytes = size_t(kTcRows) * LDS * 4;
  static constexpr size_t p_bytes = size_t(kTcRows) * LDP * 2;
  static constexpr size_t o_bytes = size_t(kTcRows) * LDO * 4;
  static constexpr size_t mask_bytes = size_t(2 * kTcRows + 2 * kTcCols) * 4;
  static constexpr size_t smem = q_bytes + 2 * kv_bytes + s_bytes + p_bytes + o_bytes + mask_bytes;
  static_assert(q_bytes % 32 == 0 && kv_bytes % 32 == 0 && s_bytes % 32 == 0 && p_bytes % 32 == 0 &&
                    o_bytes % 32 == 0,
                "regions must keep 32-byte alignment");
  static_assert((16 * LDB * 2) % 32 == 0 && (16 * LDS * 4) % 32 == 0 && (16 * LDP * 2) % 32 == 0 &&
                    (16 * LDO * 4) % 32 == 0,
                "16-row fragment origins must be 32-byte aligned");
};

// dst [64][LDB] (bf16, shared) = rows [row0, row0 + 64) of the strided bf16 matrix src (HD columns);
// rows at or past end are zero. 16-byte chunks: src, stride and HD are multiples of 8 elements.
template <int HD>
__device__ __forceinline__ void tc_load_tile(bf16* dst, const bf16* src, int64_t stride, int row0, int end) {
  constexpr int kChunks = HD / 8, LDB = TcLayout<HD>::LDB;
  for (int idx = threadIdx.x; idx < 64 * kChunks; idx += kTcThreads) {
    const int r = idx / kChunks, c = (idx - r * kChunks) * 8, row = row0 + r;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (row < end) x = *reinterpret_cast<const uint4*>(src + int64_t(row) * stride + c);
    *reinterpret_cast<uint4*>(dst + r * LDB + c) = x;
  }
}

// out (B,Tq,NH*HD) bf16, lse (B,NH,Tq) for the 64 queries [i0, i0+64) of head h, batch row b.
// grid (ceil(Tq/64), NH, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads) attention_fwd_tc_kernel(const AttentionTcForward p) {
  using namespace nvcuda;
  using L = TcLayout<HD>;
  constexpr int LDB = L::LDB, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO, KD = HD / 16;
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* Ks = reinterpret_cast<bf16*>(attn_tc_smem + L::q_bytes);
  bf16* Vs = reinterpret_cast<bf16*>(attn_tc_smem + L::q_bytes + L::kv_bytes);
  float* Ss = reinterpret_cast<float*>(attn_tc_smem + L::q_bytes + 2 * L::kv_bytes);
  bf16* Ps = reinterpret_cast<bf16*>(attn_tc_smem + L::q_bytes + 2 * L::kv_bytes + L::s_bytes);
  float* Os = reinterpret_cast<float*>(attn_tc_smem + L::q_bytes + 2 * L::kv_bytes + L::s_bytes + L::p_bytes);
  int* qpos_s = reinterpret_cast<int*>(attn_tc_smem + L::q_bytes + 2 * L::kv_bytes + L::s_bytes + L::p_bytes +
                                       L::o_bytes);
  int* qseg_s = qpos_s + kTcRows;
  int* kpos_s = qseg_s + kTcRows;
  int* kseg_s = kpos_s + kTcCols;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r = lane >> 1, half = lane & 1;  // this lane's row of the warp's 16, and its column parity
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (p.NH / p.NKV);
  const int i0 = int(kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kTcRows;
  const int wr = warp * 16;  // the warp's first row within the block
  bf16* Qw = Qs + wr * LDB;
  float* Sw = Ss + wr * LDS;
  bf16* Pw = Ps + wr * LDP;
  float* Ow = Os + wr * LDO;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * HD;
  const bf16* K = static_cast<const bf16*>(p.k) + kv_off;
  const bf16* V = static_cast<const bf16*>(p.v) + kv_off;

  tc_load_tile<HD>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                   p.q_stride, i0, p.Tq);
  for (int idx = lane; idx < 16 * LDO; idx += 32) Ow[idx] = 0.f;
  if constexpr (!kCausal) {
    if (threadIdx.x < kTcRows) {
      const int i = i0 + threadIdx.x;
      qpos_s[threadIdx.x] = i < p.Tq ? p.qpos[int64_t(b) * p.Tq + i] : 0;
      qseg_s[threadIdx.x] = i < p.Tq ? p.qseg[int64_t(b) * p.Tq + i] : 0;
    }
  }
  __syncthreads();

  wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> qf[KD];
#pragma unroll
  for (int k = 0; k < KD; ++k) wmma::load_matrix_sync(qf[k], Qw + k * 16, LDB);

  const int i = i0 + wr + r;  // this lane's query
  const bool row_ok = i < p.Tq;
  int myqpos = 0, myqseg = 0;
  if constexpr (!kCausal) {
    myqpos = qpos_s[wr + r];
    myqseg = qseg_s[wr + r];
  }
  float m = -INFINITY, l = 0.f;  // running max (base 2) and this lane's share of the running sum

  const int kend = kCausal ? min(p.Tk, i0 + kTcRows) : p.Tk;
  for (int j0 = 0; j0 < kend; j0 += kTcCols) {
    __syncthreads();  // the previous tile's readers of Ks, Vs and the key mask are done
    if constexpr (!kCausal) {
      if (threadIdx.x < kTcCols) {
        const int j = j0 + threadIdx.x;
        kpos_s[threadIdx.x] = j < p.Tk ? p.kpos[int64_t(b) * p.Tk + j] : 0;
        kseg_s[threadIdx.x] = j < p.Tk ? p.kseg[int64_t(b) * p.Tk + j] : 0;
      }
      __syncthreads();
      // Block vote: thread t checks block row t/2 against half of the tile's keys.
      bool any = false;
      {
        const int rr = threadIdx.x >> 1, x0 = (threadIdx.x & 1) * (kTcCols / 2);
        if (i0 + rr < p.Tq) {
          const int qp = qpos_s[rr], qs = qseg_s[rr];
          for (int x = x0; x < x0 + kTcCols / 2; ++x)
            any = any || (j0 + x < p.Tk && kseg_s[x] == qs && kpos_s[x] <= qp);
        }
      }
      if (!__syncthreads_or(any)) continue;  // nothing visible in this tile
    }
    tc_load_tile<HD>(Ks, K, p.kv_stride, j0, p.Tk);
    tc_load_tile<HD>(Vs, V, p.kv_stride, j0, p.Tk);
    __syncthreads();

    // S = Q K^T (16 x 64 per warp) to the warp's fp32 scratch. K^T as a col-major matrix_b is K row-major.
#pragma unroll
    for (int n = 0; n < kTcCols / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> sacc;
      wmma::fill_fragment(sacc, 0.f);
#pragma unroll
      for (int k = 0; k < KD; ++k) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> kf;
        wmma::load_matrix_sync(kf, Ks + n * 16 * LDB + k * 16, LDB);
        wmma::mma_sync(sacc, qf[k], kf, sacc);
      }
      wmma::store_matrix_sync(Sw + n * 16, sacc, LDS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of row r over columns 2c + half; P (bf16) to the warp's tile, O rescaled.
    float sv[kTcCols / 2];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kTcCols / 2; ++c) {
      const int x = 2 * c + half, j = j0 + x;
      bool vis = row_ok && j < p.Tk;
      if constexpr (kCausal)
        vis = vis && j <= i;
      else
        vis = vis && kseg_s[x] == myqseg && kpos_s[x] <= myqpos;
      sv[c] = vis ? Sw[r * LDS + x] * p.scale_log2 : -INFINITY;
      mx = fmaxf(mx, sv[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float mnew = fmaxf(m, mx);
    const float base = mnew == -INFINITY ? 0.f : mnew;  // nothing visible yet: every term is exp2(-inf) = 0
    const float alpha = exp2f(m - base);
    m = mnew;
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < kTcCols / 2; ++c) {
      const float pr = exp2f(sv[c] - base);
      Pw[r * LDP + 2 * c + half] = __float2bfloat16_rn(pr);
      sum += pr;
    }
    l = l * alpha + sum;
    if (alpha != 1.f) {
#pragma unroll 8
      for (int c = 0; c < HD / 2; ++c) Ow[r * LDO + 2 * c + half] *= alpha;
    }
    __syncwarp();

    // O += P V.
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pf[kTcCols / 16];
#pragma unroll
    for (int k = 0; k < kTcCols / 16; ++k) wmma::load_matrix_sync(pf[k], Pw + k * 16, LDP);
#pragma unroll
    for (int n = 0; n < KD; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> oacc;
      wmma::load_matrix_sync(oacc, Ow + n * 16, LDO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kTcCols / 16; ++k) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> vf;
        wmma::load_matrix_sync(vf, Vs + k * 16 * LDB + n * 16, LDB);
        wmma::mma_sync(oacc, pf[k], vf, oacc);
      }
      wmma::store_matrix_sync(Ow + n * 16, oacc, LDO, wmma::mem_row_major);
    }
    __syncwarp();  // O complete before the next tile's rescale (and the epilogue) read it
  }

  const float total = l + __shfl_xor_sync(0xffffffffu, l, 1);
  if (!row_ok) return;
  const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible key: out 0 exactly
  bf16* O = static_cast<bf16*>(p.out) + (int64_t(b) * p.Tq + i) * (int64_t(p.NH) * HD) + int64_t(h) * HD;
#pragma unroll 4
  for (int c = 0; c < HD / 4; ++c) {
    const int e = (2 * c + half) * 2;
    const float a = total > 0.f ? Ow[r * LDO + e] * inv : 0.f;
    const float z = total > 0.f ? Ow[r * LDO + e + 1] * inv : 0.f;
    *reinterpret_cast<__nv_bfloat162*>(O + e) = __floats2bfloat162_rn(a, z);
  }
  if (half == 0) p.lse[(int64_t(b) * p.NH + h) * p.Tq + i] = total > 0.f ? (m + log2f(total)) * kTcLn2 : -INFINITY;
}

// ---- backward -----------------------------------------------------------------------------------
//
// Same split as cuda_attention.cu (a dQ kernel per query tile, a dK/dV kernel per key tile summing
// over the query heads of its kv head; no atomics, so deterministic), on tensor cores: each warp
// owns 16 rows (queries, resp. keys) and keeps its gradient accumulators in wmma fragments; the
// 16 x 64 score and dP tiles go through the per-warp fp32 scratch, where two lanes per row form
// P (from the saved lse) and dS = P (dP - D), written as bf16 for the next products.

constexpr float kTcLog2e = 1.4426950408889634f;

template <int HD>
struct TcBwdLayout {
  static constexpr int LDB = HD + 8, LDS = kTcCols + 4, LDP = kTcCols + 8, LDO = HD + 4;
  static constexpr size_t tile_bytes = size_t(64) * LDB * 2;  // a bf16 tile of 64 rows
  static constexpr size_t s_bytes = size_t(kTcRows) * LDS * 4;
  static constexpr size_t p_bytes = size_t(kTcRows) * LDP * 2;
  static constexpr size_t vec_bytes = size_t(64) * 4 * 6;       // six int/float vectors of 64
  static constexpr size_t dq_smem = 4 * tile_bytes + s_bytes + p_bytes + vec_bytes;
  static constexpr size_t dkdv_smem = 4 * tile_bytes + s_bytes + 2 * p_bytes + vec_bytes;
  // The epilogue's per-warp fp32 16 x LDO tiles reuse two bf16 tiles.
  static_assert(size_t(kTcRows) * LDO * 4 <= 2 * tile_bytes, "epilogue scratch must fit in two tiles");
  static_assert(tile_bytes % 32 == 0 && s_bytes % 32 == 0 && p_bytes % 32 == 0, "32-byte alignment");
};

// rows [row0, row0 + 16) (those below end) of a strided bf16 matrix (=, or += when acc) scale * the
// warp's fp32 tile X [16][LDO]; two lanes per row, 2-element stores. The caller syncs the warp
// after the fragments were stored to X.
// One warp: S (16 x 16*NCH, fp32, leading dimension lds) = A (16 x HD) B^T, with A's rows and
// B's 16*NCH rows of HD bf16 each at leading dimension ldb (row-major in shared memory).
template <int HD, int NCH>
__device__ __forceinline__ void tc_warp_abt(float* S, int lds, const bf16* A, const bf16* B, int ldb) {
  using namespace nvcuda;
  constexpr int KD = HD / 16;
#pragma unroll
  for (int n = 0; n < NCH; ++n) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
#pragma unroll
    for (int k = 0; k < KD; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> af;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> bf;
      wmma::load_matrix_sync(af, A + k * 16, ldb);
      wmma::load_matrix_sync(bf, B + n * 16 * ldb + k * 16, ldb);
      wmma::mma_sync(acc, af, bf, acc);
    }
    wmma::store_matrix_sync(S + n * 16, acc, lds, wmma::mem_row_major);
  }
}

template <int HD>
__device__ __forceinline__ void tc_warp_store_rows(const float* X, bf16* base, int64_t stride, int row0, int end,
                                                   float scale, bool acc) {
  constexpr int LDO = HD + 4;
  const int lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1, row = row0 + r;
  if (row >= end) return;
  bf16* dst = base + int64_t(row) * stride;
#pragma unroll 4
  for (int c = 0; c < HD / 4; ++c) {
    const int e = (2 * c + half) * 2;
    float a = X[r * LDO + e] * scale, z = X[r * LDO + e + 1] * scale;
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(dst + e);
    if (acc) {
      const float2 old = __bfloat1622float2(*q);
      a += old.x;
      z += old.y;
    }
    *q = __floats2bfloat162_rn(a, z);
  }
}

// dq (=, or +=) for the 64 queries [i0, i0+64) of head h, batch row b: dQ = dS K / sqrt(HD).
// grid (ceil(Tq/64), NH, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads) attention_bwd_dq_tc_kernel(const AttentionTcBackward pb) {
  using namespace nvcuda;
  using L = TcBwdLayout<HD>;
  constexpr int LDB = L::LDB, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO, KD = HD / 16, NCH = kTcCols / 16;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Qs = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* dOs = reinterpret_cast<bf16*>(attn_tc_smem + L::tile_bytes);
  bf16* Ks = reinterpret_cast<bf16*>(attn_tc_smem + 2 * L::tile_bytes);
  bf16* Vs = reinterpret_cast<bf16*>(attn_tc_smem + 3 * L::tile_bytes);
  float* Ss = reinterpret_cast<float*>(attn_tc_smem + 4 * L::tile_bytes);
  bf16* Ps = reinterpret_cast<bf16*>(attn_tc_smem + 4 * L::tile_bytes + L::s_bytes);
  float* lse2_s = reinterpret_cast<float*>(attn_tc_smem + 4 * L::tile_bytes + L::s_bytes + L::p_bytes);
  int* qpos_s = reinterpret_cast<int*>(lse2_s + 64);
  int* qseg_s = qpos_s + 64;
  int* kpos_s = qseg_s + 64;
  int* kseg_s = kpos_s + 64;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (p.NH / p.NKV);
  const int i0 = int(kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kTcRows;
  const int wr = warp * 16;
  const int64_t ldo = int64_t(p.NH) * HD;
  float* Sw = Ss + wr * LDS;
  bf16* Pw = Ps + wr * LDP;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * HD;
  const bf16* K = static_cast<const bf16*>(p.k) + kv_off;
  const bf16* V = static_cast<const bf16*>(p.v) + kv_off;
  tc_load_tile<HD>(Qs, static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                   p.q_stride, i0, p.Tq);
  tc_load_tile<HD>(dOs, static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * HD, ldo, i0,
                   p.Tq);
  if (threadIdx.x < kTcRows) {
    const int x = threadIdx.x, ii = i0 + x;
    lse2_s[x] = ii < p.Tq ? p.lse[(int64_t(b) * p.NH + h) * p.Tq + ii] * kTcLog2e : -INFINITY;
    if constexpr (!kCausal) {
      qpos_s[x] = ii < p.Tq ? p.qpos[int64_t(b) * p.Tq + ii] : 0;
      qseg_s[x] = ii < p.Tq ? p.qseg[int64_t(b) * p.Tq + ii] : 0;
    }
  }
  const int i = i0 + wr + r;
  const float Dr = i < p.Tq ? pb.D[(int64_t(b) * p.NH + h) * p.Tq + i] : 0.f;
  __syncthreads();
  const float lse2 = lse2_s[wr + r];
  const bool row_ok = lse2 != -INFINITY;  // a real query with some visible key (a -inf lse gets no gradient)
  int myqpos = 0, myqseg = 0;
  if constexpr (!kCausal) {
    myqpos = qpos_s[wr + r];
    myqseg = qseg_s[wr + r];
  }
  const bf16* Qw = Qs + wr * LDB;
  const bf16* dOw = dOs + wr * LDB;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dq[KD];
#pragma unroll
  for (int n = 0; n < KD; ++n) wmma::fill_fragment(dq[n], 0.f);

  const int kend = kCausal ? min(p.Tk, i0 + kTcRows) : p.Tk;
  for (int j0 = 0; j0 < kend; j0 += kTcCols) {
    __syncthreads();  // the previous tile's readers of Ks, Vs and the key mask are done
    if constexpr (!kCausal) {
      if (threadIdx.x < kTcCols) {
        const int j = j0 + threadIdx.x;
        kpos_s[threadIdx.x] = j < p.Tk ? p.kpos[int64_t(b) * p.Tk + j] : 0;
        kseg_s[threadIdx.x] = j < p.Tk ? p.kseg[int64_t(b) * p.Tk + j] : 0;
      }
      __syncthreads();
      bool any = false;
      {
        const int rr = threadIdx.x >> 1, x0 = (threadIdx.x & 1) * (kTcCols / 2);
        if (lse2_s[rr] != -INFINITY) {
          const int qp = qpos_s[rr], qs = qseg_s[rr];
          for (int x = x0; x < x0 + kTcCols / 2; ++x)
            any = any || (j0 + x < p.Tk && kseg_s[x] == qs && kpos_s[x] <= qp);
        }
      }
      if (!__syncthreads_or(any)) continue;
    }
    tc_load_tile<HD>(Ks, K, p.kv_stride, j0, p.Tk);
    tc_load_tile<HD>(Vs, V, p.kv_stride, j0, p.Tk);
    __syncthreads();
    // S = Q K^T to the scratch.
    tc_warp_abt<HD, NCH>(Sw, LDS, Qw, Ks, LDB);
    __syncwarp();
    float pr[kTcCols / 2];
#pragma unroll
    for (int c = 0; c < kTcCols / 2; ++c) {
      const int x = 2 * c + half, j = j0 + x;
      bool vis = row_ok && j < p.Tk;
      if constexpr (kCausal)
        vis = vis && j <= i;
      else
        vis = vis && kseg_s[x] == myqseg && kpos_s[x] <= myqpos;
      pr[c] = vis ? exp2f(Sw[r * LDS + x] * p.scale_log2 - lse2) : 0.f;
    }
    __syncwarp();  // the scores are read before dP replaces them
    // dP = dO V^T to the scratch.
    tc_warp_abt<HD, NCH>(Sw, LDS, dOw, Vs, LDB);
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kTcCols / 2; ++c) {
      const int x = 2 * c + half;
      const float ds = pr[c] != 0.f ? pr[c] * (Sw[r * LDS + x] - Dr) : 0.f;
      Pw[r * LDP + x] = __float2bfloat16_rn(ds);
    }
    __syncwarp();
    // dQ += dS K.
#pragma unroll
    for (int k = 0; k < NCH; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> af;
      wmma::load_matrix_sync(af, Pw + k * 16, LDP);
#pragma unroll
      for (int n = 0; n < KD; ++n) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> bf;
        wmma::load_matrix_sync(bf, Ks + k * 16 * LDB + n * 16, LDB);
        wmma::mma_sync(dq[n], af, bf, dq[n]);
      }
    }
  }
  __syncthreads();  // every warp is done with Ks and Vs, which the epilogue reuses
  float* Xw = reinterpret_cast<float*>(Ks) + wr * LDO;
#pragma unroll
  for (int n = 0; n < KD; ++n) wmma::store_matrix_sync(Xw + n * 16, dq[n], LDO, wmma::mem_row_major);
  __syncwarp();
  tc_warp_store_rows<HD>(Xw, static_cast<bf16*>(pb.dq) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD,
                         p.q_stride, i0 + wr, p.Tq, pb.scale, pb.accumulate);
}

// dk, dv (=, or +=) for the 64 keys [j0, j0+64) of kv head kh, summed over its NH/NKV query heads:
// dK = dS^T Q / sqrt(HD), dV = P^T dO. grid (ceil(Tk/64), NKV, B).
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kTcThreads) attention_bwd_dkdv_tc_kernel(const AttentionTcBackward pb) {
  using namespace nvcuda;
  using L = TcBwdLayout<HD>;
  constexpr int LDB = L::LDB, LDS = L::LDS, LDP = L::LDP, LDO = L::LDO, KD = HD / 16, NCH = kTcCols / 16;
  const AttentionTcForward& p = pb.f;
  extern __shared__ __align__(128) unsigned char attn_tc_smem[];
  bf16* Ks = reinterpret_cast<bf16*>(attn_tc_smem);
  bf16* Vs = reinterpret_cast<bf16*>(attn_tc_smem + L::tile_bytes);
  bf16* Qs = reinterpret_cast<bf16*>(attn_tc_smem + 2 * L::tile_bytes);
  bf16* dOs = reinterpret_cast<bf16*>(attn_tc_smem + 3 * L::tile_bytes);
  float* Ss = reinterpret_cast<float*>(attn_tc_smem + 4 * L::tile_bytes);
  bf16* Pts = reinterpret_cast<bf16*>(attn_tc_smem + 4 * L::tile_bytes + L::s_bytes);
  bf16* dSts = reinterpret_cast<bf16*>(attn_tc_smem + 4 * L::tile_bytes + L::s_bytes + L::p_bytes);
  float* lse2_s = reinterpret_cast<float*>(attn_tc_smem + 4 * L::tile_bytes + L::s_bytes + 2 * L::p_bytes);
  float* D_s = lse2_s + 64;
  int* qpos_s = reinterpret_cast<int*>(D_s + 64);
  int* qseg_s = qpos_s + 64;
  int* kpos_b = qseg_s + 64;  // the block's keys
  int* kseg_b = kpos_b + 64;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
  const int kh = blockIdx.y, b = blockIdx.z, j0 = blockIdx.x * kTcRows, G = p.NH / p.NKV;
  const int wr = warp * 16;
  const int64_t ldo = int64_t(p.NH) * HD;
  float* Sw = Ss + wr * LDS;
  bf16* Ptw = Pts + wr * LDP;
  bf16* dStw = dSts + wr * LDP;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * HD;
  tc_load_tile<HD>(Ks, static_cast<const bf16*>(p.k) + kv_off, p.kv_stride, j0, p.Tk);
  tc_load_tile<HD>(Vs, static_cast<const bf16*>(p.v) + kv_off, p.kv_stride, j0, p.Tk);
  if constexpr (!kCausal) {
    if (threadIdx.x < kTcRows) {
      const int j = j0 + threadIdx.x;
      kpos_b[threadIdx.x] = j < p.Tk ? p.kpos[int64_t(b) * p.Tk + j] : 0;
      kseg_b[threadIdx.x] = j < p.Tk ? p.kseg[int64_t(b) * p.Tk + j] : 0;
    }
  }
  const int j = j0 + wr + r;  // this lane's key
  const bool key_ok = j < p.Tk;
  const bf16* Kw = Ks + wr * LDB;
  const bf16* Vw = Vs + wr * LDB;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dk[KD], dv[KD];
#pragma unroll
  for (int n = 0; n < KD; ++n) {
    wmma::fill_fragment(dk[n], 0.f);
    wmma::fill_fragment(dv[n], 0.f);
  }
  const int istart = kCausal ? j0 : 0;  // causal: queries before the first key see none of the tile
  for (int g = 0; g < G; ++g) {
    const int h = kh * G + g;
    const bf16* Q = static_cast<const bf16*>(p.q) + int64_t(b) * p.Tq * p.q_stride + int64_t(h) * HD;
    const bf16* dO = static_cast<const bf16*>(pb.dout) + int64_t(b) * p.Tq * ldo + int64_t(h) * HD;
    const int64_t row0 = (int64_t(b) * p.NH + h) * p.Tq;
    for (int i0 = istart; i0 < p.Tq; i0 += kTcCols) {
      __syncthreads();  // the previous tile's readers of Qs, dOs and the query data are done
      if (threadIdx.x < kTcCols) {
        const int x = threadIdx.x, ii = i0 + x;
        lse2_s[x] = ii < p.Tq ? p.lse[row0 + ii] * kTcLog2e : -INFINITY;  // -inf: no gradient through the query
        D_s[x] = ii < p.Tq ? pb.D[row0 + ii] : 0.f;
        if constexpr (!kCausal) {
          qpos_s[x] = ii < p.Tq ? p.qpos[int64_t(b) * p.Tq + ii] : 0;
          qseg_s[x] = ii < p.Tq ? p.qseg[int64_t(b) * p.Tq + ii] : 0;
        }
      }
      __syncthreads();
      if constexpr (!kCausal) {
        bool any = false;
        {
          const int kr = threadIdx.x >> 1, x0 = (threadIdx.x & 1) * (kTcCols / 2);
          if (j0 + kr < p.Tk) {
            const int kp = kpos_b[kr], ks = kseg_b[kr];
            for (int x = x0; x < x0 + kTcCols / 2; ++x)
              any = any || (lse2_s[x] != -INFINITY && qseg_s[x] == ks && kp <= qpos_s[x]);
          }
        }
        if (!__syncthreads_or(any)) continue;
      }
      tc_load_tile<HD>(Qs, Q, p.q_stride, i0, p.Tq);
      tc_load_tile<HD>(dOs, dO, ldo, i0, p.Tq);
      __syncthreads();
      // S^T = K Q^T to the scratch.
      tc_warp_abt<HD, NCH>(Sw, LDS, Kw, Qs, LDB);
      __syncwarp();
      float pr[kTcCols / 2];
#pragma unroll
      for (int c = 0; c < kTcCols / 2; ++c) {
        const int x = 2 * c + half;
        bool vis = key_ok && lse2_s[x] != -INFINITY;
        if constexpr (kCausal)
          vis = vis && j <= i0 + x;
        else
          vis = vis && qseg_s[x] == kseg_b[wr + r] && kpos_b[wr + r] <= qpos_s[x];
        pr[c] = vis ? exp2f(Sw[r * LDS + x] * p.scale_log2 - lse2_s[x]) : 0.f;
        Ptw[r * LDP + x] = __float2bfloat16_rn(pr[c]);
      }
      __syncwarp();  // the scores are read before dP^T replaces them
      // dP^T = V dO^T to the scratch.
      tc_warp_abt<HD, NCH>(Sw, LDS, Vw, dOs, LDB);
      __syncwarp();
#pragma unroll
      for (int c = 0; c < kTcCols / 2; ++c) {
        const int x = 2 * c + half;
        const float ds = pr[c] != 0.f ? pr[c] * (Sw[r * LDS + x] - D_s[x]) : 0.f;
        dStw[r * LDP + x] = __float2bfloat16_rn(ds);
      }
      __syncwarp();
      // dV += P^T dO, dK += dS^T Q.
#pragma unroll
      for (int k = 0; k < NCH; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> pf, sf;
        wmma::load_matrix_sync(pf, Ptw + k * 16, LDP);
        wmma::load_matrix_sync(sf, dStw + k * 16, LDP);
#pragma unroll
        for (int n = 0; n < KD; ++n) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> bf;
          wmma::load_matrix_sync(bf, dOs + k * 16 * LDB + n * 16, LDB);
          wmma::mma_sync(dv[n], pf, bf, dv[n]);
          wmma::load_matrix_sync(bf, Qs + k * 16 * LDB + n * 16, LDB);
          wmma::mma_sync(dk[n], sf, bf, dk[n]);
        }
      }
    }
  }
  __syncthreads();  // every warp is done with Qs and dOs, which the epilogue reuses
  float* Xw = reinterpret_cast<float*>(Qs) + wr * LDO;
  bf16* dK = static_cast<bf16*>(pb.dk) + kv_off;
  bf16* dV = static_cast<bf16*>(pb.dv) + kv_off;
#pragma unroll
  for (int n = 0; n < KD; ++n) wmma::store_matrix_sync(Xw + n * 16, dk[n], LDO, wmma::mem_row_major);
  __syncwarp();
  tc_warp_store_rows<HD>(Xw, dK, p.kv_stride, j0 + wr, p.Tk, pb.scale, pb.accumulate);
  __syncwarp();
#pragma unroll
  for (int n = 0; n < KD; ++n) wmma::store_matrix_sync(Xw + n * 16, dv[n], LDO, wmma::mem_row_major);
  __syncwarp();
  tc_warp_store_rows<HD>(Xw, dV, p.kv_stride, j0 + wr, p.Tk, 1.f, pb.accumulate);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <int HD>
void launch_tc(const AttentionTcForward& p, bool causal, cudaStream_t stream) {
  auto kernel = causal ? attention_fwd_tc_kernel<HD, true> : attention_fwd_tc_kernel<HD, false>;
  constexpr size_t smem = TcLayout<HD>::smem;
  // Above 48 KiB a kernel must opt in to its dynamic shared memory (per device, so on every call).
  MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((p.Tq + kTcRows - 1) / kTcRows), unsigned(p.NH), unsigned(p.B));
  kernel<<<grid, kTcThreads, smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

template <int HD>
void launch_bwd_tc(const AttentionTcBackward& p, bool causal, cudaStream_t stream) {
  auto dq = causal ? attention_bwd_dq_tc_kernel<HD, true> : attention_bwd_dq_tc_kernel<HD, false>;
  auto dkdv = causal ? attention_bwd_dkdv_tc_kernel<HD, true> : attention_bwd_dkdv_tc_kernel<HD, false>;
  constexpr size_t dq_smem = TcBwdLayout<HD>::dq_smem, dkdv_smem = TcBwdLayout<HD>::dkdv_smem;
  MPIGPT_CUDA(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dq_smem)));
  MPIGPT_CUDA(cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dkdv_smem)));
  const dim3 gq(unsigned((p.f.Tq + kTcRows - 1) / kTcRows), unsigned(p.f.NH), unsigned(p.f.B));
  const dim3 gk(unsigned((p.f.Tk + kTcRows - 1) / kTcRows), unsigned(p.f.NKV), unsigned(p.f.B));
  dq<<<gq, kTcThreads, dq_smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
  dkdv<<<gk, kTcThreads, dkdv_smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

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

bool attention_forward_tc(const AttentionTcForward& p, DType dt, bool causal, cudaStream_t stream) {
  if (dt != DType::BF16 || (p.HD != 64 && p.HD != 128)) return false;
  // 16-byte (8-element) loads and 4-byte stores: every base and row stride a multiple of 8 elements.
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.out)) return false;
  if (p.q_stride % 8 != 0 || p.kv_stride % 8 != 0) return false;
  if (!causal && (!p.qpos || !p.qseg || !p.kpos || !p.kseg)) return false;
  if (p.B == 0 || p.Tq == 0) return true;
  if (p.HD == 64)
    launch_tc<64>(p, causal, stream);
  else
    launch_tc<128>(p, causal, stream);
  return true;
}

}  // namespace mpigpt::cuda
