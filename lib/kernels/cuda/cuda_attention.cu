// CUDA backend: fused attention in the FlashAttention-2 manner (causal self-attention and the
// blockwise, explicitly masked form of ring attention and packed documents): query and key tiles
// pass through shared memory, the softmax is computed online in fp32 and the T x T matrix never
// exists; the forward saves only the log-sum-exp (B,NH,T), from which the backward recomputes P.
//
// Layout of every kernel: 128 threads = 16 row groups x 8 column lanes. The block owns 64 "rows"
// (queries in the forward and dQ kernels, keys in the dK/dV kernel) whose fp32 accumulators live
// in registers (4 rows x HD/8 columns per thread) and streams the other side through shared
// memory in tiles of 64 (forward) or 32 (backward) "columns", each thread computing a 4 x (tile/8)
// block of scores. Tiles sit in shared memory as fp32 rows of HD + 4 floats (the padding keeps
// the 128-bit reads of 8 consecutive rows on distinct banks), whatever the data dtype.
//
// Backward: a preprocessing kernel computes D = rowsum(dout * out); then one kernel per query
// tile accumulates dQ over the key tiles and one kernel per key tile accumulates dK and dV over
// the query tiles of all the query heads of its kv head. Both recompute the scores and dP (7
// tile products instead of FlashAttention-2's 5) in exchange for no atomics and no fp32 dQ
// scratch: every gradient element is summed by one thread in a fixed order, so the backward is
// deterministic, and the blockwise backward can accumulate straight into dqkv and dkv.
//
// Masks: the causal kernels mask j > i and skip the key tiles past a query tile (and query tiles
// before a key tile). The blockwise kernels take per-token positions and document ids; a tile
// with no visible pair is skipped after a block-wide vote. Packed variable-length sequences (the
// cu_seqlens of other libraries) are exactly this: one document id per packed sequence.
//
// Head dims: kernels are built for HD in {16, 32, 64, 80, 96, 128}; any other HD <= 128 runs in
// the next larger one with zero-padded columns (the padding adds nothing to the dot products and
// its output columns are not stored).
//
// This file holds the kernels, the causal ops and the entry points that cuda_attention_block.cu's
// blockwise ops call after checking their arguments.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "lib/kernels/cuda/cuda_attention_tc.cuh"
#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 128;     // 16 row groups (rg) x 8 column lanes (cg)
constexpr int kRows = 64;         // register-resident rows per block, 4 per thread
constexpr int kXLD = kRows + 4;   // row stride of the transposed score tiles in shared memory
constexpr int kFwdCols = 64;      // keys per tile in the forward
constexpr int kBwdCols = 32;      // columns per tile in the backward kernels (their shared memory is larger)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxHeadDim = 128;  // kernels for HD = 16, 32, 64, 80, 96, 128 (dispatch_head_dim)

// One attention problem. Element d of query head h of token (b, i) is q[(b*Tq + i)*q_stride +
// h*HD + d]; key/value head kh of token (b, j) is at k/v[(b*Tk + j)*kv_stride + kh*HD]; out and
// dout are (B,Tq,NH*HD); dq has q's layout, dk/dv k's.
struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;         // written by the forward, read by the backward
  float* lse;        // (B,NH,Tq), likewise
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* D;          // (B,NH,Tq) backward scratch: rowsum(dout * out)
  const int32_t* qpos;  // the explicit mask, (B,Tq) and (B,Tk); unused by the causal kernels
  const int32_t* qseg;
  const int32_t* kpos;
  const int32_t* kseg;
  int64_t q_stride, kv_stride;
  int B, Tq, Tk, NH, NKV, HD;
  float scale;       // 1/sqrt(HD)
  float scale_log2;  // log2(e)/sqrt(HD): scores in base 2, so the kernels use exp2
  bool vec;          // HD % 4 == 0 and every tensor aligned: 4-element vector loads, 2-element stores
  bool accumulate;   // backward: dq, dk, dv += (blockwise) instead of = (causal)
};

// ---- shared-memory tiles and the per-thread products ---------------------------------------

__device__ __forceinline__ float4 zero4() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ float4 vload4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 vload4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);  // bf16 -> f32 is the upper half of the bits
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// Elements [d, d+4) of a row of hd elements, zero past hd.
template <class T>
__device__ __forceinline__ float4 load_chunk(const T* row, int d, int hd, bool vec) {
  if (vec) return d < hd ? vload4(row + d) : zero4();
  float x[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = d + k < hd ? to_f(row[d + k]) : 0.f;
  return make_float4(x[0], x[1], x[2], x[3]);
}

// dst [ROWS][HDP+4] (fp32, shared) = rows [row0, row0 + ROWS) of the strided matrix src; rows at
// or past `end` and columns past hd are zero, so masked or padded entries are finite and add 0.
template <int HDP, int ROWS, class T>
__device__ __forceinline__ void load_tile(float* dst, const T* src, int64_t stride, int row0, int end, int hd,
                                          bool vec) {
  constexpr int kChunks = HDP / 4, LD = HDP + 4;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kThreads) {
    const int r = idx / kChunks, d = (idx - r * kChunks) * 4, row = row0 + r;
    const float4 x = row < end ? load_chunk(src + int64_t(row) * stride, d, hd, vec) : zero4();
    *reinterpret_cast<float4*>(dst + r * LD + d) = x;
  }
}

// acc[r][c] = A[rg*4 + r] . B[cg + 8c] over HDP columns of two shared tiles. Within a quarter warp
// (the unit of a 128-bit shared load) rg is fixed, so A's reads are broadcasts and B's 8 rows are
// (HDP+4)/4 (odd) 16-byte slots apart: no bank conflicts.
template <int HDP, int NC>
__device__ __forceinline__ void tile_dot(float (&acc)[4][NC], const float* A, const float* B, int rg, int cg) {
  constexpr int LD = HDP + 4;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[r][c] = 0.f;
  const float* a = A + rg * 4 * LD;
  const float* b = B + cg * LD;
#pragma unroll 2
  for (int d = 0; d < HDP; d += 4) {
    float4 x[4], y[NC];
#pragma unroll
    for (int r = 0; r < 4; ++r) x[r] = *reinterpret_cast<const float4*>(a + r * LD + d);
#pragma unroll
    for (int c = 0; c < NC; ++c) y[c] = *reinterpret_cast<const float4*>(b + c * 8 * LD + d);
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float s = acc[r][c];
        s = fmaf(x[r].x, y[c].x, s);
        s = fmaf(x[r].y, y[c].y, s);
        s = fmaf(x[r].z, y[c].z, s);
        s = fmaf(x[r].w, y[c].w, s);
        acc[r][c] = s;
      }
  }
}

// X[cg + 8c][rg*4 + r] = v[r][c]: the thread's scores transposed, so that a thread later reads the
// values of its four rows for one column as one float4.
template <int NC>
__device__ __forceinline__ void store_transposed(float* X, const float (&v)[4][NC], int rg, int cg) {
#pragma unroll
  for (int c = 0; c < NC; ++c)
    *reinterpret_cast<float4*>(X + (cg + 8 * c) * kXLD + rg * 4) = make_float4(v[0][c], v[1][c], v[2][c], v[3][c]);
}

// acc[r][2m + t] += sum_{x < N} X[x][rg*4 + r] * M[x][cg*2 + 16m + t]: the (rows x N) tile held
// transposed in X times the (N x HDP) shared tile M.
template <int HDP, int N>
__device__ __forceinline__ void tile_accum(float (&acc)[4][HDP / 8], const float* X, const float* M, int rg, int cg) {
  constexpr int LD = HDP + 4;
#pragma unroll 4
  for (int x = 0; x < N; ++x) {
    const float4 p = *reinterpret_cast<const float4*>(X + x * kXLD + rg * 4);
    const float* mrow = M + x * LD + cg * 2;
#pragma unroll
    for (int m = 0; m < HDP / 16; ++m) {
      const float2 v = *reinterpret_cast<const float2*>(mrow + 16 * m);
      acc[0][2 * m] = fmaf(p.x, v.x, acc[0][2 * m]);
      acc[0][2 * m + 1] = fmaf(p.x, v.y, acc[0][2 * m + 1]);
      acc[1][2 * m] = fmaf(p.y, v.x, acc[1][2 * m]);
      acc[1][2 * m + 1] = fmaf(p.y, v.y, acc[1][2 * m + 1]);
      acc[2][2 * m] = fmaf(p.z, v.x, acc[2][2 * m]);
      acc[2][2 * m + 1] = fmaf(p.z, v.y, acc[2][2 * m + 1]);
      acc[3][2 * m] = fmaf(p.w, v.x, acc[3][2 * m]);
      acc[3][2 * m + 1] = fmaf(p.w, v.y, acc[3][2 * m + 1]);
    }
  }
}

__device__ __forceinline__ void store_pair(float* p, float a, float b, bool acc) {
  float2* q = reinterpret_cast<float2*>(p);
  if (acc) {
    const float2 old = *q;
    a += old.x;
    b += old.y;
  }
  *q = make_float2(a, b);
}
__device__ __forceinline__ void store_pair(bf16* p, float a, float b, bool acc) {
  __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p);
  if (acc) {
    const float2 old = __bfloat1622float2(*q);
    a += old.x;
    b += old.y;
  }
  *q = __floats2bfloat162_rn(a, b);
}

// row[cg*2 + 16m + t] (=, or += when acc) s * v[2m + t] for the columns below hd: one thread's
// share of an output row.
template <int HDP, class T>
__device__ __forceinline__ void store_row(T* row, const float (&v)[HDP / 8], float s, int cg, int hd, bool vec,
                                          bool acc) {
#pragma unroll
  for (int m = 0; m < HDP / 16; ++m) {
    const int e = cg * 2 + 16 * m;
    const float a = v[2 * m] * s, b = v[2 * m + 1] * s;
    if (vec) {  // hd % 4 == 0 and e even: both or neither of e, e+1 are below hd
      if (e < hd) store_pair(row + e, a, b, acc);
    } else {
      if (e < hd) row[e] = from_f<T>(acc ? to_f(row[e]) + a : a);
      if (e + 1 < hd) row[e + 1] = from_f<T>(acc ? to_f(row[e + 1]) + b : b);
    }
  }
}

__device__ __forceinline__ float max8(float x) {  // over the 8 column lanes of a row group
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
}
__device__ __forceinline__ float sum8(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 4);
}

// The key tile [j0, j0 + 8*NC) against the thread's 4 query rows: bit r*NC + c is set when row
// i0 + rg*4 + r (row_ok[r]) sees key j0 + cg + 8c. The blockwise mask stages the tile's key
// positions and document ids in shared memory (the caller's barrier orders their previous use).
template <bool kCausal, int NC>
__device__ __forceinline__ uint32_t visible_keys(const Problem& p, int b, int i0, int j0, int rg, int cg,
                                                 const bool (&row_ok)[4], const int (&qpos)[4], const int (&qseg)[4],
                                                 int* kpos_s, int* kseg_s) {
  uint32_t vis = 0;
  if constexpr (kCausal) {
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int i = i0 + rg * 4 + r, j = j0 + cg + 8 * c;
        if (row_ok[r] && j <= i && j < p.Tk) vis |= 1u << (r * NC + c);
      }
  } else {
    if (threadIdx.x < 8 * NC) {
      const int j = j0 + threadIdx.x;
      kpos_s[threadIdx.x] = j < p.Tk ? p.kpos[int64_t(b) * p.Tk + j] : 0;
      kseg_s[threadIdx.x] = j < p.Tk ? p.kseg[int64_t(b) * p.Tk + j] : 0;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int x = cg + 8 * c;
        if (row_ok[r] && j0 + x < p.Tk && kseg_s[x] == qseg[r] && kpos_s[x] <= qpos[r]) vis |= 1u << (r * NC + c);
      }
  }
  return vis;
}

template <int HDP>
constexpr size_t fwd_smem() {  // Q tile, K-then-V tile, P^T, key positions and ids
  return size_t(kRows + kFwdCols) * (HDP + 4) * 4 + size_t(kFwdCols) * kXLD * 4 + 2 * kFwdCols * 4;
}
template <int HDP>
constexpr size_t dq_smem() {  // Q and dO tiles, V-then-K tile, dS^T, key positions and ids
  return size_t(2 * kRows + kBwdCols) * (HDP + 4) * 4 + size_t(kBwdCols) * kXLD * 4 + 2 * kBwdCols * 4;
}
template <int HDP>
constexpr size_t dkdv_smem() {  // K, V, Q, dO tiles, P^T-then-dS^T, query lse, D, positions, ids
  return size_t(2 * kRows + 2 * kBwdCols) * (HDP + 4) * 4 + size_t(kBwdCols) * kXLD * 4 + 4 * kBwdCols * 4;
}

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
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (p.NH / p.NKV);
  // Causal: the last query tiles see the most keys, so they are started first.
  const int i0 = int(kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kRows;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * p.HD;
  const T* K = static_cast<const T*>(p.k) + kv_off;
  const T* V = static_cast<const T*>(p.v) + kv_off;
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

// ---- backward ---------------------------------------------------------------------------------

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
  const int h = blockIdx.y, b = blockIdx.z, kh = h / (p.NH / p.NKV);
  const int i0 = int(kCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * kRows;
  const int64_t ldo = int64_t(p.NH) * p.HD;
  const int64_t kv_off = int64_t(b) * p.Tk * p.kv_stride + int64_t(kh) * p.HD;
  const T* K = static_cast<const T*>(p.k) + kv_off;
  const T* V = static_cast<const T*>(p.v) + kv_off;
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

// ---- launchers --------------------------------------------------------------------------------

unsigned tiles(int n, int per) { return unsigned((n + per - 1) / per); }

template <class Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, const Problem& p) {
  // Above 48 KiB a kernel must opt in to its dynamic shared memory (per device, so on every call).
  MPIGPT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  MPIGPT_CUDA_LAUNCHED();
}

// Runs body(std::integral_constant<int, HDP>) for the kernels' head dim that holds p.HD.
template <class F>
void dispatch_head_dim(int HD, F&& body) {
  switch (HD <= 16 ? 16 : HD <= 32 ? 32 : HD <= 64 ? 64 : HD <= 80 ? 80 : HD <= 96 ? 96 : 128) {
    case 16: body(std::integral_constant<int, 16>{}); break;
    case 32: body(std::integral_constant<int, 32>{}); break;
    case 64: body(std::integral_constant<int, 64>{}); break;
    case 80: body(std::integral_constant<int, 80>{}); break;
    case 96: body(std::integral_constant<int, 96>{}); break;
    default: body(std::integral_constant<int, 128>{}); break;
  }
}

// The bf16 forward and backward for HD 64 and 128 run on tensor cores (cuda_attention_tc.cu) unless
// the environment variable MPIGPT_ATTENTION_FMA is set to a value other than "0" or "": then they
// use the scalar fp32-FMA kernels of this file (read on every call, so tests can compare the two).
bool fma_forced() {
  const char* e = std::getenv("MPIGPT_ATTENTION_FMA");
  return e != nullptr && e[0] != '\0' && std::strcmp(e, "0") != 0;
}

void forward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  if (p.B == 0 || p.Tq == 0) return;
  if (dt == DType::BF16 && !fma_forced()) {
    const AttentionTcForward tc{p.q,    p.k,    p.v,    p.out,  p.lse,  p.qpos, p.qseg, p.kpos, p.kseg,
                                p.q_stride, p.kv_stride, p.B, p.Tq, p.Tk, p.NH, p.NKV, p.HD, p.scale_log2};
    if (attention_forward_tc(tc, dt, causal, stream)) return;
  }
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

// p.D must hold B*NH*Tq floats of scratch.
void backward(const Problem& p, DType dt, bool causal, cudaStream_t stream) {
  if (p.B == 0 || p.Tq == 0 || p.Tk == 0) return;  // (causal: Tq == Tk) nothing to add or to overwrite
  dispatch_float(dt, "attention", [&](auto tag) {
    using T = decltype(tag);
    const int64_t warps = int64_t(p.B) * p.Tq * p.NH;
    attention_rowdot_kernel<T><<<unsigned((warps + 7) / 8), 256, 0, stream>>>(p);
    MPIGPT_CUDA_LAUNCHED();
    if (dt == DType::BF16 && !fma_forced()) {
      const AttentionTcBackward tc{{p.q, p.k, p.v, p.out, p.lse, p.qpos, p.qseg, p.kpos, p.kseg, p.q_stride,
                                    p.kv_stride, p.B, p.Tq, p.Tk, p.NH, p.NKV, p.HD, p.scale_log2},
                                   p.dout, p.dq, p.dk, p.dv, p.D, p.scale, p.accumulate};
      if (attention_backward_tc(tc, dt, causal, stream)) return;
    }
    dispatch_head_dim(p.HD, [&](auto hd) {
      constexpr int HDP = decltype(hd)::value;
      launch(causal ? attention_bwd_dq_kernel<T, HDP, true> : attention_bwd_dq_kernel<T, HDP, false>,
             dim3(tiles(p.Tq, kRows), unsigned(p.NH), unsigned(p.B)), dq_smem<HDP>(), stream, p);
      launch(causal ? attention_bwd_dkdv_kernel<T, HDP, true> : attention_bwd_dkdv_kernel<T, HDP, false>,
             dim3(tiles(p.Tk, kRows), unsigned(p.NKV), unsigned(p.B)), dkdv_smem<HDP>(), stream, p);
    });
  });
}

// ---- problems -----------------------------------------------------------------------------------

bool aligned(const void* p, size_t bytes) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The 4-element vector path: HD % 4 == 0 (so strides and head offsets are multiples of 4) and
// every data tensor aligned to 4 elements.
bool vector_ok(const Problem& p, DType dt) {
  const size_t a = 4 * dtype_size(dt);
  return p.HD % 4 == 0 && aligned(p.q, a) && aligned(p.k, a) && aligned(p.v, a) && aligned(p.out, a) &&
         aligned(p.dout, a) && aligned(p.dq, a) && aligned(p.dk, a) && aligned(p.dv, a);
}

void* offset(const Tensor& t, int64_t elements) {
  return static_cast<char*>(t.ptr) + elements * int64_t(dtype_size(t.dtype));
}

// The inputs of a (checked) call: queries from qkv; keys and values from qkv (causal, kv
// undefined) or from kv with the explicit mask.
Problem make_problem(const char* op, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                     Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  const bool causal = !kv.defined();
  const int64_t B = qkv.size(0), Tq = qkv.size(1), Tk = causal ? Tq : kv.size(1);
  // The grid puts NH (or NKV) and B in its y and z dimensions; tokens are indexed with int.
  MPIGPT_CHECK(B <= 65535 && NH <= 65535, "{}: batch {} and heads {} must each be at most 65535 (CUDA grid limit)", op,
               B, NH);
  MPIGPT_CHECK(Tq <= INT32_MAX - kRows && Tk <= INT32_MAX - kRows, "{}: sequence lengths {} and {} exceed 2^31", op,
               Tq, Tk);
  Problem p{};
  p.B = int(B);
  p.Tq = int(Tq);
  p.Tk = int(Tk);
  p.NH = NH;
  p.NKV = NKV;
  p.HD = HD;
  p.scale = float(1.0 / std::sqrt(double(HD)));
  p.scale_log2 = float(1.4426950408889634 / std::sqrt(double(HD)));
  p.q = qkv.ptr;
  p.q_stride = qkv.size(2);
  if (causal) {
    p.k = offset(qkv, int64_t(NH) * HD);
    p.v = offset(qkv, int64_t(NH + NKV) * HD);
    p.kv_stride = p.q_stride;
  } else {
    p.k = kv.ptr;
    p.v = offset(kv, int64_t(NKV) * HD);
    p.kv_stride = kv.size(2);
    p.qpos = ptr<const int32_t>(qpos);
    p.qseg = ptr<const int32_t>(qseg);
    p.kpos = ptr<const int32_t>(kpos);
    p.kseg = ptr<const int32_t>(kseg);
  }
  p.out = out.ptr;
  p.lse = ptr<float>(lse);
  return p;
}

}  // namespace

// ---- entry points shared with cuda_attention_block.cu -------------------------------------------

void check_attention_heads(const char* op, int NH, int NKV, int HD) {
  MPIGPT_CHECK(NH > 0 && NKV > 0 && HD > 0 && NH % NKV == 0,
               "{}: need NH, NKV, HD > 0 and NH divisible by NKV, got NH={} NKV={} HD={}", op, NH, NKV, HD);
  if (HD > kMaxHeadDim)
    fail("{}: head dim HD = {} is not supported by the fused CUDA attention kernels: they are built for HD = 16, 32, "
         "64, 80, 96 and 128 (smaller head dims run zero-padded in the next one), so HD must be at most 128",
         op, HD);
}

void fused_attention_forward(CudaOps& ops, DType dt, Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos,
                             Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  Problem p = make_problem("attention", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  p.vec = vector_ok(p, dt);
  forward(p, dt, !kv.defined(), ops.cuda_stream());
}

void fused_attention_backward(CudaOps& ops, DType dt, Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv,
                              Tensor out, Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH,
                              int NKV, int HD) {
  const bool causal = !kv.defined();
  Problem p = make_problem("attention", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  const int64_t C = int64_t(NH) * HD;
  p.dout = dout.ptr;
  p.dq = dqkv.ptr;
  p.dk = causal ? offset(dqkv, C) : dkv.ptr;
  p.dv = causal ? offset(dqkv, C + int64_t(NKV) * HD) : offset(dkv, int64_t(NKV) * HD);
  p.accumulate = !causal;
  p.vec = vector_ok(p, dt);
  CudaOps::Scratch D = ops.scratch(std::max<size_t>(1, size_t(p.B) * p.NH * p.Tq * sizeof(float)));
  p.D = static_cast<float*>(D.ptr);
  backward(p, dt, causal, ops.cuda_stream());
}

// ---- the causal ops -------------------------------------------------------------------------------

void CudaOps::attention_forward(Tensor out, Tensor saved, Tensor qkv, int NH, int NKV, int HD) {
  // out (B,T,NH*HD), saved = lse (B,NH,T) f32, qkv (B,T,(NH+2*NKV)*HD)
  const char* op = "attention_forward";
  check_device(out, op, "out");
  check_f32(saved, op, "saved");
  check_device(qkv, op, "qkv");
  const DType dt = data_dtype(op, {{"out", out}, {"qkv", qkv}});
  check_attention_heads(op, NH, NKV, HD);
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  MPIGPT_CHECK(qkv.ndim() == 3 && qkv.size(2) == R, "{}: qkv {} must be (B, T, (NH+2*NKV)*HD = {})", op,
               qkv.shape.str(), R);
  const int64_t B = qkv.size(0), T = qkv.size(1);
  MPIGPT_CHECK(out.numel() == B * T * NH * HD, "{}: out {} must be (B, T, NH*HD) = ({}, {}, {})", op, out.shape.str(),
               B, T, int64_t(NH) * HD);
  MPIGPT_CHECK(saved.numel() >= attention_saved_numel(B, T, NH), "{}: saved {} needs {} elements", op, saved.str(),
               attention_saved_numel(B, T, NH));
  fused_attention_forward(*this, dt, out, saved, qkv, {}, {}, {}, {}, {}, NH, NKV, HD);
}

void CudaOps::attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor saved, int NH, int NKV,
                                 int HD) {
  // dqkv (B,T,(NH+2*NKV)*HD) overwritten, dout and out (B,T,NH*HD), qkv as forward, saved = lse (B,NH,T)
  const char* op = "attention_backward";
  check_device(dqkv, op, "dqkv");
  check_device(dout, op, "dout");
  check_device(qkv, op, "qkv");
  check_device(out, op, "out");
  check_f32(saved, op, "saved");
  const DType dt = data_dtype(op, {{"dqkv", dqkv}, {"dout", dout}, {"qkv", qkv}, {"out", out}});
  check_attention_heads(op, NH, NKV, HD);
  const int64_t R = int64_t(NH + 2 * NKV) * HD;
  MPIGPT_CHECK(qkv.ndim() == 3 && qkv.size(2) == R, "{}: qkv {} must be (B, T, (NH+2*NKV)*HD = {})", op,
               qkv.shape.str(), R);
  const int64_t B = qkv.size(0), T = qkv.size(1), C = int64_t(NH) * HD;
  MPIGPT_CHECK(dqkv.numel() == qkv.numel(), "{}: dqkv {} must have the shape of qkv {}", op, dqkv.shape.str(),
               qkv.shape.str());
  MPIGPT_CHECK(dout.numel() == B * T * C && out.numel() == B * T * C,
               "{}: dout {} and out {} must be (B, T, NH*HD) = ({}, {}, {})", op, dout.shape.str(), out.shape.str(), B,
               T, C);
  MPIGPT_CHECK(saved.numel() >= attention_saved_numel(B, T, NH), "{}: saved {} needs {} elements", op, saved.str(),
               attention_saved_numel(B, T, NH));
  fused_attention_backward(*this, dt, dqkv, {}, dout, qkv, {}, out, saved, {}, {}, {}, {}, NH, NKV, HD);
}

}  // namespace mpigpt::cuda
