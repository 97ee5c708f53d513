// CUDA backend: matrix products through cuBLASLt (gemm, linear forward/backward, the GELU epilogues
// of the GPT-2 MLP, grouped linear for the MoE experts), and the bias gradient by the deterministic
// column-sum kernel.
#include <algorithm>

#include "lib/kernels/cuda/cuda_kernel_util.cuh"
#include "lib/kernels/cuda/cuda_matmul.cuh"
#include "lib/kernels/op_checks.h"

namespace mpigpt::cuda {

namespace {

// ---- kernels ---------------------------------------------------------------------------------

// out (rows, cols) += bias (cols) broadcast over rows (when the epilogue cannot take the bias).
template <class T>
__global__ void add_bias_kernel(T* out, const T* bias, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f<T>(to_f(out[i]) + to_f(bias[i % cols]));
}

// Column sums of x (rows, cols) over the row range of chunk blockIdx.y: a (32 x 8) block owns 32
// columns, its 8 warps stride over the rows, and shared memory adds their 8 partial sums in a
// fixed order (no atomics: the result is the same on every run). With accumulate, out (cols) +=
// the sums; otherwise out (chunks, cols) receives one row of partial sums per chunk.
constexpr int kSumCols = 32, kSumRows = 8;
template <class T>
__global__ void column_sums_kernel(float* out, const T* x, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                                   bool accumulate) {
  __shared__ float part[kSumRows][kSumCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kSumCols + threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float s = 0.0f;
  if (col < cols)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kSumRows) s += to_f(x[r * cols + col]);
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float t = 0.0f;
    for (int y = 0; y < kSumRows; ++y) t += part[y][threadIdx.x];
    if (accumulate)
      out[col] += t;
    else
      out[int64_t(blockIdx.y) * cols + col] = t;
  }
}

// The same sums with 16-byte loads (W elements; cols % W == 0, x 16-byte aligned): a block of
// kSumRows warps owns 32 W columns, lane l the W from l W on; the warps stride over the chunk's
// rows four at a time (four loads in flight, summed in row order), and shared memory adds their
// partial sums in a fixed order, as above.
template <class T, int W>
__global__ void __launch_bounds__(32 * kSumRows)
    column_sums_vec_kernel(float* out, const T* x, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                           bool accumulate) {
  __shared__ float part[kSumRows][32 * W];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t col = int64_t(blockIdx.x) * 32 * W + lane * W;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(rows, r0 + rows_per_chunk);
  float s[W] = {};
  if (col < cols) {
    int64_t r = r0 + warp;
    for (; r + 3 * kSumRows < r1; r += 4 * kSumRows) {
      Pack<T, W> v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = load_pack<W>(x + (r + u * kSumRows) * cols + col);
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int j = 0; j < W; ++j) s[j] += to_f(v[u].v[j]);
    }
    for (; r < r1; r += kSumRows) {
      const Pack<T, W> v = load_pack<W>(x + r * cols + col);
#pragma unroll
      for (int j = 0; j < W; ++j) s[j] += to_f(v.v[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < W; ++j) part[warp][lane * W + j] = s[j];
  __syncthreads();
  for (int c = threadIdx.x; c < 32 * W; c += blockDim.x) {
    const int64_t oc = int64_t(blockIdx.x) * 32 * W + c;
    if (oc >= cols) break;
    float t = 0.0f;
    for (int y = 0; y < kSumRows; ++y) t += part[y][c];
    if (accumulate)
      out[oc] += t;
    else
      out[int64_t(blockIdx.y) * cols + oc] = t;
  }
}

// out (cols) += the sum over chunks of partial (chunks, cols), chunks in order.
__global__ void sum_partials_kernel(float* out, const float* partial, int64_t chunks, int64_t cols) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < cols; c += int64_t(gridDim.x) * blockDim.x) {
    float t = 0.0f;
    for (int64_t j = 0; j < chunks; ++j) t += partial[j * cols + c];
    out[c] += t;
  }
}

constexpr int kThreads = 256;
inline unsigned grid_for(int64_t n) { return std::min<unsigned>(blocks_for(n, kThreads), 8192u); }

// dbias (cols) f32 += column sums of x (rows, cols) in the data dtype.
void column_sums_accumulate(CudaOps& ops, float* dbias, const Tensor& x, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  cudaStream_t s = ops.cuda_stream();
  dispatch_float(x.dtype, "linear_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int W = 16 / sizeof(T);
    // Whole rows in 16-byte loads when they allow it: 32 W columns per block, else 32.
    const bool vec = cols % W == 0 && aligned16(x.ptr);
    const int64_t strip = vec ? 32 * W : kSumCols;
    // Tall inputs are cut into row chunks so that enough blocks run (a few columns x many rows
    // would otherwise leave most of the GPU idle); the chunks' partial sums are added in order.
    const int64_t col_blocks = (cols + strip - 1) / strip;
    const int64_t chunks = std::clamp<int64_t>((rows + 255) / 256, 1, std::max<int64_t>(1, 1024 / col_blocks));
    const int64_t per_chunk = (rows + chunks - 1) / chunks;
    const dim3 grid{unsigned(col_blocks), unsigned(chunks)};
    const dim3 block = vec ? dim3{32 * kSumRows} : dim3{unsigned(kSumCols), unsigned(kSumRows)};
    auto sums = [&](float* out, bool accumulate) {
      if (vec)
        column_sums_vec_kernel<T, W><<<grid, block, 0, s>>>(out, ptr<T>(x), rows, cols, per_chunk, accumulate);
      else
        column_sums_kernel<T><<<grid, block, 0, s>>>(out, ptr<T>(x), rows, cols, per_chunk, accumulate);
      MPIGPT_CUDA_LAUNCHED();
    };
    if (chunks == 1) {
      sums(dbias, true);
      return;
    }
    auto partial = ops.scratch(size_t(chunks * cols) * sizeof(float));
    sums(static_cast<float*>(partial.ptr), false);
    sum_partials_kernel<<<grid_for(cols), kThreads, 0, s>>>(dbias, static_cast<float*>(partial.ptr), chunks, cols);
    MPIGPT_CUDA_LAUNCHED();
  });
}

// ---- row-major products ------------------------------------------------------------------------

// Row-major, contiguous c (M,N) = alpha op(a) op(b) + beta c, with a stored (M,K) or (K,M) when
// ta, b stored (K,N) or (N,K) when tb, as the column-major product cuBLASLt computes. A row-major
// (r, c) matrix is the same memory as a column-major (c, r) one, its transpose, so row-major
// C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the operands swap, each keeps its
// transpose flag, and M and N exchange.
LtMatmul rowmajor_product(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* a, const void* b, void* c,
                          DType ab, DType cd, float alpha, float beta) {
  LtMatmul mm;
  mm.ta = tb;  // column-major C^T = op(b)^T op(a)^T: b is the first operand
  mm.tb = ta;
  mm.m = N;
  mm.n = M;
  mm.k = K;
  mm.A = b;
  mm.lda = tb ? K : N;  // b's row length
  mm.B = a;
  mm.ldb = ta ? M : K;  // a's row length
  mm.C = c;
  mm.ldc = N;
  mm.ab = ab;
  mm.cd = cd;
  mm.alpha = alpha;
  mm.beta = beta;
  return mm;
}

// The bias an epilogue may take: only a 16-byte aligned one (some cuBLASLt kernels read the bias
// vectorised without saying so to the heuristic; the per-group biases of grouped_linear are often
// not aligned); null otherwise, and the caller adds it.
const void* epilogue_bias(const void* bias) { return bias && alignment(bias) >= 16 ? bias : nullptr; }

// Row-major, contiguous c (M,N) = alpha op(a) op(b) + beta c (+ bias (N) on every row), with a
// stored (M,K) or (K,M) when ta, b stored (K,N) or (N,K) when tb. a, b in `ab`, c and bias in `cd`.
void rowmajor_gemm(CudaOps& ops, const char* op, bool ta, bool tb, int64_t M, int64_t N, int64_t K, const void* a,
                   const void* b, void* c, DType ab, DType cd, const void* bias, float alpha, float beta) {
  if (M == 0 || N == 0) return;
  Tensor ct(c, {M * N}, cd, Device::CUDA);
  if (K == 0) {  // op(a) op(b) is zero; cuBLASLt rejects k = 0
    if (beta == 0.0f)
      ops.fill(ct, 0.0f);
    else
      ops.scale(ct, beta);
  } else {
    LtMatmul mm = rowmajor_product(ta, tb, M, N, K, a, b, c, ab, cd, alpha, beta);
    mm.bias = epilogue_bias(bias);
    if (!run_matmul(ops, mm, op)) {
      mm.bias = nullptr;
      run_matmul(ops, mm, op);
    }
    if (mm.bias) return;  // the epilogue added it
  }
  if (!bias) return;
  dispatch_float(cd, op, [&](auto tag) {
    using T = decltype(tag);
    add_bias_kernel<<<grid_for(M * N), kThreads, 0, ops.cuda_stream()>>>(static_cast<T*>(c),
                                                                        static_cast<const T*>(bias), M, N);
  });
  MPIGPT_CUDA_LAUNCHED();
}

// Row-major c (M,N) = gelu(a (M,K) op(b) + bias) with aux = a op(b) + bias (Gelu::Forward, b
// stored (N,K)), or c = (a op(b)) * gelu'(aux) (Gelu::Backward, b stored (K,N), no bias), through
// cuBLASLt's GELU epilogues, all in bf16. False, with nothing queued, where they do not apply:
// f32 data (the epilogue's GELU is not the CPU's to fp32 rounding; f32 runs are the reference
// checks, so they take the separate kernels), K = 0, N not a multiple of 8 (cuBLASLt's rule for
// aux), a bias not 16-byte aligned, or no algorithm for the shape.
bool gelu_gemm(CudaOps& ops, const char* op, Gelu gelu, int64_t M, int64_t N, int64_t K, const void* a,
               const void* b, void* c, void* aux, const void* bias, DType dt) {
  if (dt != DType::BF16 || M == 0 || N == 0 || K == 0 || N % 8 != 0) return false;
  if (alignment(aux) < 16 || (bias && alignment(bias) < 16)) return false;
  LtMatmul mm = rowmajor_product(false, gelu == Gelu::Forward, M, N, K, a, b, c, dt, dt, 1.0f, 0.0f);
  mm.gelu = gelu;
  mm.aux = aux;
  mm.bias = bias;
  return run_matmul(ops, mm, op);
}

// The i-th element of t as a pointer (row slices of grouped matmuls), for any dtype.
inline void* at(const Tensor& t, int64_t i) { return static_cast<char*>(t.ptr) + i * int64_t(dtype_size(t.dtype)); }

// A linear layer's sizes: out (N,OC) = inp (N,IC) @ weight (OC,IC)^T, in the data dtype.
struct LinearDims {
  DType dt;
  int64_t N, IC, OC;
};
LinearDims linear_dims(const Tensor& inp, const Tensor& weight) {
  return {inp.dtype, mat_of(inp).rows, mat_of(inp).cols, mat_of(weight).rows};
}

}  // namespace

// ---- ops -----------------------------------------------------------------------------------------

void CudaOps::gemm_impl(Tensor c, Tensor a, Tensor b, bool trans_a, bool trans_b, float alpha, float beta) {
  // c (M,N), a (M,K) or (K,M) when trans_a, b (K,N) or (N,K) when trans_b; one data dtype
  const char* op = "gemm";
  const DType dt = c.dtype;
  const Mat mc = mat_of(c), ma = mat_of(a);
  const int64_t M = mc.rows, N = mc.cols, K = trans_a ? ma.rows : ma.cols;
  rowmajor_gemm(*this, op, trans_a, trans_b, M, N, K, a.ptr, b.ptr, c.ptr, dt, dt, nullptr, alpha, beta);
}

void CudaOps::linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias) {
  // out (N,OC) = inp (N,IC) @ weight (OC,IC)^T + bias (OC); all in the data dtype, bias optional
  const char* op = "linear_forward";
  const LinearDims d = linear_dims(inp, weight);
  rowmajor_gemm(*this, op, false, true, d.N, d.OC, d.IC, inp.ptr, weight.ptr, out.ptr, d.dt, d.dt,
                bias.defined() ? bias.ptr : nullptr, 1.0f, 0.0f);
}

void CudaOps::linear_residual_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias, Tensor residual) {
  // out (N,OC) = inp (N,IC) @ weight (OC,IC)^T + bias (OC) + residual (N,OC); all in the data dtype.
  // One cuBLASLt call reading the residual as C (beta 1), with the bias epilogue when it applies;
  // otherwise linear_forward and add.
  const char* op = "linear_residual_forward";
  const LinearDims d = linear_dims(inp, weight);
  if (d.N > 0 && d.OC > 0 && d.IC > 0) {
    LtMatmul mm = rowmajor_product(false, true, d.N, d.OC, d.IC, inp.ptr, weight.ptr, out.ptr, d.dt, d.dt, 1.0f,
                                   1.0f);
    mm.Cin = residual.ptr;
    mm.bias = epilogue_bias(bias.ptr);
    if ((mm.bias || !bias.defined()) && run_matmul(*this, mm, op)) return;
  }
  linear_forward(out, inp, weight, bias);
  add(out, out, residual);
}

void CudaOps::linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight) {
  // dinp (N,IC) = dout (N,OC) @ weight (OC,IC), overwritten, data dtype;
  // dweight (OC,IC) f32 += dout^T @ inp; dbias (OC) f32 += column sums of dout
  const char* op = "linear_backward";
  const DType dt = dout.dtype;
  const Mat mo = mat_of(dout);
  const int64_t N = mo.rows, OC = mo.cols;
  if (dinp.defined()) {
    rowmajor_gemm(*this, op, false, false, N, mat_of(weight).cols, OC, dout.ptr, weight.ptr, dinp.ptr, dt, dt,
                  nullptr, 1.0f, 0.0f);
  }
  const int64_t IC = dweight.defined() ? mat_of(inp).cols : 0;
  // The product and the column sums, each where its gradient is asked for. In bf16 the product reads
  // bf16 and writes f32 (with 32F compute one of cuBLASLt's supported type combinations), so dweight
  // accumulates in fp32 across micro-batches. cuBLASLt's bias-gradient epilogue (BGRADB) would sum
  // dbias inside the product, but on an H200 it was 0.4-10% slower than the product plus the
  // column-sum kernel at every GPT-2 124M and 1.3B shape.
  if (dweight.defined())
    rowmajor_gemm(*this, op, true, false, OC, IC, N, dout.ptr, inp.ptr, ptr<float>(dweight), dt, DType::F32, nullptr,
                  1.0f, 1.0f);
  if (dbias.defined()) column_sums_accumulate(*this, ptr<float>(dbias), dout, N, OC);
}

void CudaOps::linear_gelu_forward_impl(Tensor out, Tensor pre, Tensor inp, Tensor weight, Tensor bias) {
  // pre (N,OC) = inp (N,IC) @ weight (OC,IC)^T + bias (OC), out (N,OC) = gelu(pre); one data dtype.
  // bf16: one cuBLASLt call (GELU_AUX_BIAS epilogue); otherwise the product, then the GELU kernel.
  const char* op = "linear_gelu_forward";
  const LinearDims d = linear_dims(inp, weight);
  if (gelu_gemm(*this, op, Gelu::Forward, d.N, d.OC, d.IC, inp.ptr, weight.ptr, out.ptr, pre.ptr,
                bias.defined() ? bias.ptr : nullptr, d.dt))
    return;
  linear_forward(pre, inp, weight, bias);
  gelu_forward(out, pre);
}

void CudaOps::linear_backward_gelu_impl(Tensor dpre, Tensor dweight, Tensor dbias, Tensor dout, Tensor act,
                                        Tensor weight,
                                        Tensor pre) {
  // dpre (N,IC) = (dout (N,OC) @ weight (OC,IC)) * gelu'(pre (N,IC)), overwritten, data dtype (bf16:
  // one cuBLASLt call with the DGELU epilogue); dweight, dbias f32 accumulate as in linear_backward.
  const char* op = "linear_backward_gelu";
  const DType dt = dpre.dtype;
  const int64_t N = mat_of(dout).rows, OC = mat_of(dout).cols, IC = mat_of(weight).cols;
  if (!gelu_gemm(*this, op, Gelu::Backward, N, IC, OC, dout.ptr, weight.ptr, dpre.ptr, pre.ptr, nullptr, dt)) {
    linear_backward(dpre, Tensor(), Tensor(), dout, Tensor(), weight);
    gelu_backward(dpre, dpre, pre);
  }
  linear_backward(Tensor(), dweight, dbias, dout, act, Tensor());
}

void CudaOps::grouped_linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                          const int64_t* group_rows) {
  // out (M,OC), inp (M,IC), weight (G,OC,IC), bias (G,OC) optional, data dtype; group g is
  // group_rows[g] (host) consecutive rows through weight[g]
  const char* op = "grouped_linear_forward";
  const DType dt = out.dtype;
  const int64_t G = weight.size(0), OC = weight.size(1), IC = weight.size(2);
  // One cuBLASLt call per group; empty groups (experts that got no tokens) are skipped.
  const TunePause untuned(*this);
  for (int64_t g = 0, r = 0; g < G; r += group_rows[g], ++g) {
    if (group_rows[g] == 0) continue;
    rowmajor_gemm(*this, op, false, true, group_rows[g], OC, IC, at(inp, r * IC), at(weight, g * OC * IC),
                  at(out, r * OC), dt, dt, bias.defined() ? at(bias, g * OC) : nullptr, 1.0f, 0.0f);
  }
}

void CudaOps::grouped_linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                           Tensor weight, const int64_t* group_rows) {
  // dinp (M,IC) overwritten (optional), data dtype; dweight (G,OC,IC) and dbias (G,OC) f32 accumulate
  const char* op = "grouped_linear_backward";
  const DType dt = dout.dtype;
  const int64_t G = weight.size(0), OC = weight.size(1), IC = weight.size(2);
  const TunePause untuned(*this);
  for (int64_t g = 0, r = 0; g < G; r += group_rows[g], ++g) {
    const int64_t n = group_rows[g];
    if (n == 0) continue;  // dinp has no rows to write, the gradients nothing to add
    if (dinp.defined())
      rowmajor_gemm(*this, op, false, false, n, IC, OC, at(dout, r * OC), at(weight, g * OC * IC), at(dinp, r * IC),
                    dt, dt, nullptr, 1.0f, 0.0f);
    if (dweight.defined())
      rowmajor_gemm(*this, op, true, false, OC, IC, n, at(dout, r * OC), at(inp, r * IC), at(dweight, g * OC * IC),
                    dt, DType::F32, nullptr, 1.0f, 1.0f);
    if (dbias.defined())
      column_sums_accumulate(*this, static_cast<float*>(at(dbias, g * OC)),
                             Tensor(at(dout, r * OC), {n, OC}, dt, Device::CUDA), n, OC);
  }
}

}  // namespace mpigpt::cuda
