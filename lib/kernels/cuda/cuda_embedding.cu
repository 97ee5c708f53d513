// CUDA backend: token (+ position) embedding lookup and its scatter-add backward.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "lib/kernels/cuda/cuda_common.cuh"
#include "lib/kernels/cuda/cuda_kernel_util.cuh"

namespace mpigpt::cuda {

namespace {

constexpr int kThreads = 256;

// Grid-stride launches cap the grid; each thread then walks several packs.
unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 1 << 20)); }

// out (N,C) = wte[tokens - vocab_start] (zeros outside [0, rows)) + wpe[positions] (optional).
// One thread per pack of W channels; a position outside wpe's rows (a caller bug the CPU backend
// reports) gives NaN rather than a read outside the table, so it cannot pass unnoticed.
template <class T, int W>
__global__ void embedding_forward_kernel(T* __restrict__ out, const int32_t* __restrict__ tokens,
                                         const int32_t* __restrict__ positions, const T* __restrict__ wte,
                                         const T* __restrict__ wpe, int64_t N, int64_t C, int64_t rows, int64_t max_pos,
                                         int64_t vocab_start) {
  const int64_t PC = C / W, total = N * PC;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / PC, c = (i - n * PC) * W;
    const int64_t r = int64_t(tokens[n]) - vocab_start;
    float acc[W];
    if (r >= 0 && r < rows) {
      const Pack<T, W> e = *reinterpret_cast<const Pack<T, W>*>(wte + r * C + c);
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = to_f(e.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = 0.0f;
    }
    if (wpe) {
      const int64_t p = positions[n];
      if (p >= 0 && p < max_pos) {
        const Pack<T, W> e = *reinterpret_cast<const Pack<T, W>*>(wpe + p * C + c);
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] += to_f(e.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) acc[j] = __int_as_float(0x7fc00000);  // NaN
      }
    }
    Pack<T, W> o;
#pragma unroll
    for (int j = 0; j < W; ++j) o.v[j] = from_f<T>(acc[j]);
    *reinterpret_cast<Pack<T, W>*>(out + n * C + c) = o;
  }
}

// ---- backward: a deterministic scatter-add of dout rows by key ----------------------------------
// d (rows,C) f32 += the dout rows n whose key k = keys[n] - off is in [0, rows), added up in order of
// n and grouped the same way on every run (sort by key, then segmented sums, as PyTorch's; no float
// atomics), so that a run and its resumption give the same bits. Sorting: a count per key, a scan,
// a placement by integer atomics, then each bucket put in order of n. P = start[rows] keys sort.

__global__ void count_keys_kernel(int32_t* count, const int32_t* keys, int64_t N, int64_t rows, int64_t off) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = keys[n] - off;
    if (k >= 0 && k < rows) atomicAdd(count + k, 1);
  }
}

// start[0..rows] = exclusive prefix sums of count; cursor = start. One block, a run of keys a thread.
constexpr int kScan = 512;
__global__ void scan_keys_kernel(int32_t* start, int32_t* cursor, const int32_t* count, int64_t rows) {
  __shared__ int32_t part[kScan];
  const int64_t per = (rows + kScan - 1) / kScan, a = min(rows, threadIdx.x * per), b = min(rows, a + per);
  int32_t s = 0;
  for (int64_t k = a; k < b; ++k) s += count[k];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int o = 1; o < kScan; o <<= 1) {  // inclusive scan of the threads' totals
    const int32_t v = int(threadIdx.x) >= o ? part[threadIdx.x - o] : 0;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  s = part[threadIdx.x] - s;
  for (int64_t k = a; k < b; ++k) {  // cursor may be count itself: read before writing
    const int32_t n = count[k];
    start[k] = cursor[k] = s;
    s += n;
  }
  if (threadIdx.x == kScan - 1) start[rows] = s;
}

// slot[cursor[k]++] = n: each bucket gets its members in an order that varies from run to run.
__global__ void place_keys_kernel(int32_t* slot, int32_t* cursor, const int32_t* keys, int64_t N, int64_t rows,
                                  int64_t off) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = keys[n] - off;
    if (k >= 0 && k < rows) slot[atomicAdd(cursor + k, 1)] = int32_t(n);
  }
}

// sorted = slot with each bucket in order of n (a member's place: the members below it).
__global__ void order_buckets_kernel(int32_t* sorted, const int32_t* slot, const int32_t* start,
                                     const int32_t* keys, int64_t rows, int64_t off) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= start[rows]) return;
  const int32_t v = slot[p];
  const int64_t k = keys[v] - off;
  int32_t r = start[k];
  for (int32_t q = start[k]; q < start[k + 1]; ++q) r += slot[q] < v;
  sorted[r] = v;
}

// Segmented sums over chunks of kChunk sorted places, one thread per (chunk j, pack of W columns).
// A run of one key inside the chunk is added to d directly (this thread is its only writer); a run
// cut by the chunk's start goes to part[2j], one cut only by its end to part[2j+1], for the fold.
constexpr int kChunk = 32;
template <class T, int W>
__global__ void chunk_sums_kernel(float* d, float* part, const T* __restrict__ dout, const int32_t* sorted,
                                  const int32_t* start, const int32_t* keys, int64_t rows, int64_t C, int64_t off,
                                  int64_t chunks) {
  const int64_t PC = C / W, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, P = start[rows];
  const int64_t j = i / PC, c = (i - j * PC) * W, a = j * kChunk, e = min(P, a + kChunk);
  if (j >= chunks || a >= P) return;
  for (int64_t p = a; p < e;) {
    const int64_t k = keys[sorted[p]] - off;
    float acc[W] = {};
    const int64_t q0 = p;
    for (; p < e && keys[sorted[p]] - off == k; ++p) {
      const Pack<T, W> g = load_pack<W>(dout + sorted[p] * C + c);
#pragma unroll
      for (int w = 0; w < W; ++w) acc[w] += to_f(g.v[w]);
    }
    const bool before = q0 == a && a > 0 && keys[sorted[a - 1]] - off == k;
    const bool after = p == e && e < P && keys[sorted[e]] - off == k;
    float* out = before ? part + (2 * j) * C + c : after ? part + (2 * j + 1) * C + c : d + k * C + c;
#pragma unroll
    for (int w = 0; w < W; ++w) out[w] = (before || after) ? acc[w] : out[w] + acc[w];
  }
}

// For each run cut by a chunk's end that started in that chunk: its part plus the next chunks'
// leading parts, in order, added to d.
template <int W>
__global__ void fold_chunks_kernel(float* d, const float* part, const int32_t* sorted, const int32_t* start,
                                   const int32_t* keys, int64_t rows, int64_t C, int64_t off, int64_t chunks) {
  const int64_t PC = C / W, i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, P = start[rows];
  const int64_t j = i / PC, c = (i - j * PC) * W, a = j * kChunk, e = min(P, a + kChunk);
  if (j >= chunks || e >= P) return;
  const int64_t k = keys[sorted[e - 1]] - off;
  if (keys[sorted[e]] - off != k || (a > 0 && keys[sorted[a - 1]] - off == k)) return;
  float acc[W];
#pragma unroll
  for (int w = 0; w < W; ++w) acc[w] = part[(2 * j + 1) * C + c + w];
  for (int64_t jj = j + 1, aa = e; aa < P && keys[sorted[aa]] - off == k; ++jj, aa += kChunk) {
#pragma unroll
    for (int w = 0; w < W; ++w) acc[w] += part[(2 * jj) * C + c + w];
  }
#pragma unroll
  for (int w = 0; w < W; ++w) d[k * C + c + w] += acc[w];
}

template <class T, int W>
void scatter_rows_sorted(CudaOps& ops, float* d, int64_t rows, const T* dout, const int32_t* keys, int64_t N,
                         int64_t C, int64_t off) {
  const int64_t chunks = (N + kChunk - 1) / kChunk, ints = 2 * (rows + 1) + 2 * N;
  CudaOps::Scratch ws = ops.scratch(size_t(ints) * sizeof(int32_t) + size_t(2 * chunks * C) * sizeof(float));
  int32_t *count = static_cast<int32_t*>(ws.ptr), *start = count + rows + 1, *slot = start + rows + 1,
          *sorted = slot + N;
  float* part = reinterpret_cast<float*>(sorted + N);
  cudaStream_t s = ops.cuda_stream();
  MPIGPT_CUDA(cudaMemsetAsync(count, 0, size_t(rows) * sizeof(int32_t), s));
  count_keys_kernel<<<grid_for(N), kThreads, 0, s>>>(count, keys, N, rows, off);
  scan_keys_kernel<<<1, kScan, 0, s>>>(start, count, count, rows);  // count becomes the cursor
  place_keys_kernel<<<grid_for(N), kThreads, 0, s>>>(slot, count, keys, N, rows, off);
  order_buckets_kernel<<<unsigned((N + kThreads - 1) / kThreads), kThreads, 0, s>>>(sorted, slot, start, keys, rows,
                                                                                     off);
  const unsigned g = unsigned((chunks * (C / W) + kThreads - 1) / kThreads);
  chunk_sums_kernel<T, W><<<g, kThreads, 0, s>>>(d, part, dout, sorted, start, keys, rows, C, off, chunks);
  fold_chunks_kernel<W><<<g, kThreads, 0, s>>>(d, part, sorted, start, keys, rows, C, off, chunks);
  MPIGPT_CUDA_LAUNCHED();
}

}  // namespace

void CudaOps::embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                     int64_t vocab_start) {
  // out (N,C), tokens (N) i32, positions (N) i32 (with wpe), wte (rows,C) = vocabulary rows
  // [vocab_start, vocab_start+rows), wpe (maxT,C) optional
  const char* op = "embedding_forward";
  const DType dt = out.dtype;
  const RowsCols mo = rows_cols(out), me = rows_cols(wte);
  const int64_t N = mo.rows, C = mo.cols;
  int64_t max_pos = 0;
  if (wpe.defined()) {
    max_pos = rows_cols(wpe).rows;
  }
  if (N == 0 || C == 0) return;
  dispatch_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const bool vec = C % V == 0 && aligned16(out) && aligned16(wte) && (!wpe.defined() || aligned16(wpe));
    const int32_t* pos = wpe.defined() ? ptr<int32_t>(positions) : nullptr;
    const T* P = wpe.defined() ? ptr<T>(wpe) : nullptr;
    if (vec)
      embedding_forward_kernel<T, V><<<grid_for(N * C / V), kThreads, 0, cuda_stream()>>>(
          ptr<T>(out), ptr<int32_t>(tokens), pos, ptr<T>(wte), P, N, C, me.rows, max_pos, vocab_start);
    else
      embedding_forward_kernel<T, 1><<<grid_for(N * C), kThreads, 0, cuda_stream()>>>(
          ptr<T>(out), ptr<int32_t>(tokens), pos, ptr<T>(wte), P, N, C, me.rows, max_pos, vocab_start);
    MPIGPT_CUDA_LAUNCHED();
  });
}

void CudaOps::embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                      int64_t vocab_start) {
  // dwte (rows,C) f32 += scatter of dout (N,C) rows by token; dwpe (maxT,C) f32 += scatter by position
  const RowsCols mo = rows_cols(dout);
  const int64_t N = mo.rows, C = mo.cols;
  if (N == 0 || C == 0) return;
  dispatch_float(dout.dtype, "embedding_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    const auto scatter = [&](Tensor d, Tensor keys, int64_t off) {
      if (!d.defined()) return;
      if (C % V == 0 && aligned16(dout))
        scatter_rows_sorted<T, V>(*this, ptr<float>(d), rows_cols(d).rows, ptr<T>(dout), ptr<int32_t>(keys), N, C, off);
      else
        scatter_rows_sorted<T, 1>(*this, ptr<float>(d), rows_cols(d).rows, ptr<T>(dout), ptr<int32_t>(keys), N, C, off);
    };
    scatter(dwte, tokens, vocab_start);
    scatter(dwpe, positions, 0);
  });
}

}  // namespace mpigpt::cuda
