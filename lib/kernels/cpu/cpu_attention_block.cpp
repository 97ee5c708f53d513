// CPU backend: blockwise masked attention, its log-sum-exp merge (ring attention, packed documents), row/column moves.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The geometry and the mask inputs of one block call: queries from qkv (B,Tq,R), R = (NH+2*NKV)*HD;
// keys/values from kv (B,Tk,RK), RK = 2*NKV*HD; out (B,Tq,NH*HD) with row stride ldo; lse (B,NH,Tq).
struct BlockArgs {
  int64_t B, Tq, Tk, NH, NKV, HD, R, RK, ldo, G;
  const int32_t *qpos, *qseg, *kpos, *kseg;
};

BlockArgs block_args(const char* op, const char* out_name, const Tensor& out, const Tensor& lse, const Tensor& qkv,
                     const Tensor& kv, const Tensor& qpos, const Tensor& qseg, const Tensor& kpos, const Tensor& kseg,
                     int NH, int NKV, int HD) {
  const int32_t *qp = i32(qpos), *qs = i32(qseg);
  const int32_t *kp = i32(kpos), *ks = i32(kseg);
  const int64_t R = int64_t(NH + 2 * NKV) * HD, RK = int64_t(2 * NKV) * HD;
  const int64_t B = qkv.size(0), Tq = qkv.size(1);
  const int64_t Tk = kv.size(1), ldo = int64_t(NH) * HD;
  // The sgemm calls inside the threads must not fail (and throw) there.
  for (int64_t x : {R, RK, ldo, Tk}) blas_int(x, op);
  return {B, Tq, Tk, NH, NKV, HD, R, RK, ldo, NH / NKV, qp, qs, kp, ks};
}

// Threads split the tasks only when there are enough of them and enough multiply-adds to pay for
// a parallel region (the same rule as cpu_attention.cpp).
bool parallel_tasks(int64_t tasks, const BlockArgs& a) {
  return tasks > 1 && tasks >= omp_get_max_threads() && a.B * a.NH * a.Tq * a.Tk * a.HD >= (int64_t(1) << 20);
}

// Query rows per score block: bounds the per-thread scratch to kBlock * Tk floats.
constexpr int64_t kBlock = 64;

}  // namespace

void CpuOps::attention_block_forward_impl(Tensor out, Tensor lse, Tensor qkv, Tensor kv, Tensor qpos, Tensor qseg,
                                          Tensor kpos, Tensor kseg, int NH, int NKV, int HD) {
  // out (B,Tq,NH*HD), lse (B,NH,Tq), qkv (B,Tq,(NH+2*NKV)*HD), kv (B,Tk,2*NKV*HD), q*/k* (B,Tq)/(B,Tk) i32
  const char* op = "attention_block_forward";
  float* O = f32(out);
  float* L = f32(lse);
  const float* X = f32(qkv);
  const float* KV = f32(kv);
  const BlockArgs a = block_args(op, "out", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  const int64_t Tq = a.Tq, Tk = a.Tk, R = a.R, RK = a.RK, ldo = a.ldo;
  const float scale = float(1.0 / std::sqrt(double(HD)));
  const int64_t tasks = a.B * a.NH;
#pragma omp parallel for schedule(static) if (parallel_tasks(tasks, a))
  for (int64_t task = 0; task < tasks; ++task) {
    static thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(kBlock * Tk)) scratch.resize(size_t(kBlock * Tk));
    float* S = scratch.data();
    const int64_t b = task / a.NH, h = task % a.NH, kh = h / a.G;
    const float* Q = X + b * Tq * R + h * HD;
    const float* K = KV + b * Tk * RK + kh * HD;
    const float* V = KV + b * Tk * RK + (a.NKV + kh) * HD;
    const int32_t *qp = a.qpos + b * Tq, *qs = a.qseg + b * Tq, *kp = a.kpos + b * Tk, *ks = a.kseg + b * Tk;
    float* Ob = O + b * Tq * ldo + h * HD;
    float* Lb = L + task * Tq;  // task = b * NH + h: lse is (B,NH,Tq)
    for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
      const int64_t i1 = std::min(Tq, i0 + kBlock);
      sgemm(false, true, i1 - i0, Tk, HD, scale, Q + i0 * R, R, K, RK, 0.0f, S, Tk, op);  // S = scale Q K^T
      for (int64_t i = i0; i < i1; ++i) {
        float* p = S + (i - i0) * Tk;
        const int32_t qpi = qp[i], qsi = qs[i];
        float mx = kNegInf;
        for (int64_t j = 0; j < Tk; ++j) mx = (ks[j] == qsi && kp[j] <= qpi && p[j] > mx) ? p[j] : mx;
        if (mx == kNegInf) {  // no visible key: zero probabilities, so this row of out is 0
          std::fill(p, p + Tk, 0.0f);
          Lb[i] = kNegInf;
          continue;
        }
        double s = 0.0;
        for (int64_t j = 0; j < Tk; ++j) {
          const float e = vexp(p[j] - mx);  // computed for masked keys too, then discarded (a select)
          p[j] = (ks[j] == qsi && kp[j] <= qpi) ? e : 0.0f;
          s += double(p[j]);
        }
        const float inv = float(1.0 / s);
#pragma omp simd
        for (int64_t j = 0; j < Tk; ++j) p[j] *= inv;
        Lb[i] = float(double(mx) + std::log(s));
      }
      sgemm(false, false, i1 - i0, HD, Tk, 1.0f, S, Tk, V, RK, 0.0f, Ob + i0 * ldo, ldo, op);  // out = P V
      for (int64_t i = i0; i < i1; ++i)  // exactly 0 even if V holds non-finite values
        if (Lb[i] == kNegInf) std::fill(Ob + i * ldo, Ob + i * ldo + HD, 0.0f);
    }
  }
}

void CpuOps::attention_merge_impl(Tensor out, Tensor lse, Tensor blk_out, Tensor blk_lse) {
  // out, blk_out (B,Tq,NH*HD); lse, blk_lse (B,NH,Tq)
  float* O = f32(out);
  float* L = f32(lse);
  const float* BO = f32(blk_out);
  const float* BL = f32(blk_lse);
  const int64_t B = lse.size(0), NH = lse.size(1), Tq = lse.size(2);
  const Mat mo = mat_of(out);
  const int64_t C = mo.cols, HD = C / NH, rows = B * Tq;
  // A side whose lse is -inf has weight 0 and its out is never read (0 * NaN would poison the sum),
  // so a running result may start as lse = -inf over any out.
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = r / Tq, i = r % Tq;
    for (int64_t h = 0; h < NH; ++h) {
      float* o = O + r * C + h * HD;
      const float* bo = BO + r * C + h * HD;
      float& l = L[(b * NH + h) * Tq + i];
      const float bl = BL[(b * NH + h) * Tq + i];
      if (bl == kNegInf) {  // the block adds nothing
        if (l == kNegInf) std::fill(o, o + HD, 0.0f);
        continue;
      }
      if (l == kNegInf) {  // the first contribution
        std::copy(bo, bo + HD, o);
        l = bl;
        continue;
      }
      const double x = l, y = bl, hi = std::max(x, y);
      const double m = hi + std::log1p(std::exp(std::min(x, y) - hi));
      const double wa = std::exp(x - m), wb = std::exp(y - m);
      for (int64_t d = 0; d < HD; ++d) o[d] = float(wa * double(o[d]) + wb * double(bo[d]));
      l = float(m);
    }
  }
}

void CpuOps::attention_block_backward_impl(Tensor dqkv, Tensor dkv, Tensor dout, Tensor qkv, Tensor kv, Tensor out,
                                      Tensor lse, Tensor qpos, Tensor qseg, Tensor kpos, Tensor kseg, int NH, int NKV,
                                           int HD) {
  // dqkv (B,Tq,(NH+2*NKV)*HD) query columns accumulate; dkv (B,Tk,2*NKV*HD) accumulates;
  // dout, out (B,Tq,NH*HD) and lse (B,NH,Tq) are the FINAL (merged) ones.
  const char* op = "attention_block_backward";
  float* dX = f32(dqkv);
  float* dKV = f32(dkv);
  const float* dO = f32(dout);
  const float* X = f32(qkv);
  const float* KV = f32(kv);
  const float* O = f32(out);
  const float* L = f32(lse);
  const BlockArgs a = block_args(op, "out", out, lse, qkv, kv, qpos, qseg, kpos, kseg, NH, NKV, HD);
  const int64_t Tq = a.Tq, Tk = a.Tk, R = a.R, RK = a.RK, ldo = a.ldo, G = a.G;
  const float scale = float(1.0 / std::sqrt(double(HD)));
  // One (batch, kv head) per task: the G query heads sharing a kv head add into its dK/dV in a
  // fixed order, so no two threads write the same memory and the result is deterministic.
  const int64_t tasks = a.B * a.NKV;
#pragma omp parallel for schedule(static) if (parallel_tasks(tasks, a))
  for (int64_t task = 0; task < tasks; ++task) {
    static thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(2 * kBlock * Tk)) scratch.resize(size_t(2 * kBlock * Tk));
    float* P = scratch.data();    // scores, then probabilities
    float* dS = P + kBlock * Tk;  // dO V^T, then dS
    const int64_t b = task / a.NKV, kh = task % a.NKV;
    const float* K = KV + b * Tk * RK + kh * HD;
    const float* V = KV + b * Tk * RK + (a.NKV + kh) * HD;
    float* dK = dKV + b * Tk * RK + kh * HD;
    float* dV = dKV + b * Tk * RK + (a.NKV + kh) * HD;
    const int32_t *qp = a.qpos + b * Tq, *qs = a.qseg + b * Tq, *kp = a.kpos + b * Tk, *ks = a.kseg + b * Tk;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kh * G + g;
      const float* Q = X + b * Tq * R + h * HD;
      float* dQ = dX + b * Tq * R + h * HD;
      const float* dOb = dO + b * Tq * ldo + h * HD;
      const float* Ob = O + b * Tq * ldo + h * HD;
      const float* Lb = L + (b * a.NH + h) * Tq;
      for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
        const int64_t i1 = std::min(Tq, i0 + kBlock), ib = i1 - i0;
        sgemm(false, true, ib, Tk, HD, scale, Q + i0 * R, R, K, RK, 0.0f, P, Tk, op);        // S = scale Q K^T
        sgemm(false, true, ib, Tk, HD, 1.0f, dOb + i0 * ldo, ldo, V, RK, 0.0f, dS, Tk, op);  // dP = dO V^T
        for (int64_t i = i0; i < i1; ++i) {
          float* p = P + (i - i0) * Tk;
          float* ds = dS + (i - i0) * Tk;
          const float l = Lb[i];
          if (l == kNegInf) {  // no visible key in any block: no gradient through this query
            std::fill(p, p + Tk, 0.0f);
            std::fill(ds, ds + Tk, 0.0f);
            continue;
          }
          double Dd = 0.0;  // D = rowsum(dout * out) of the final output
          for (int64_t d = 0; d < HD; ++d) Dd += double(dOb[i * ldo + d]) * double(Ob[i * ldo + d]);
          const float D = float(Dd);
          const int32_t qpi = qp[i], qsi = qs[i];
          for (int64_t j = 0; j < Tk; ++j) {
            const float e = vexp(p[j] - l);
            const float pj = (ks[j] == qsi && kp[j] <= qpi) ? e : 0.0f;
            p[j] = pj;
            ds[j] = pj * (ds[j] - D);
          }
        }
        sgemm(false, false, ib, HD, Tk, scale, dS, Tk, K, RK, 1.0f, dQ + i0 * R, R, op);     // dQ += scale dS K
        sgemm(true, false, Tk, HD, ib, scale, dS, Tk, Q + i0 * R, R, 1.0f, dK, RK, op);      // dK += scale dS^T Q
        sgemm(true, false, Tk, HD, ib, 1.0f, P, Tk, dOb + i0 * ldo, ldo, 1.0f, dV, RK, op);  // dV += P^T dO
      }
    }
  }
}

void CpuOps::copy_cols_impl(Tensor dst, int64_t dst_col, Tensor src, int64_t src_col, int64_t ncols) {
  // dst (N,Dd)[:, dst_col : dst_col+ncols] = src (N,Ds)[:, src_col : src_col+ncols]
  float* D = f32(dst);
  const float* S = f32(src);
  const Mat md = mat_of(dst), ms = mat_of(src);
  const int64_t N = md.rows;
  if (ncols == 0) return;
#pragma omp parallel for schedule(static) if (N * ncols >= kParallelMin)
  for (int64_t n = 0; n < N; ++n)  // memmove: dst and src may be the same matrix
    std::memmove(D + n * md.cols + dst_col, S + n * ms.cols + src_col, size_t(ncols) * sizeof(float));
}

namespace {
// Indices are checked before any row moves (one pass over M ints, small next to the M*C copy):
// an out-of-range index would otherwise read or write outside the tensor.
void check_index(const char* op, const int32_t* idx, int64_t M, int64_t N) {
  for (int64_t i = 0; i < M; ++i)
    MPIGPT_CHECK(idx[i] >= 0 && idx[i] < N, "{}: index[{}] = {} is outside [0, {})", op, i, idx[i], N);
}
}  // namespace

void CpuOps::gather_rows_impl(Tensor out, Tensor inp, Tensor index) {
  // out (M,C)[i] = inp (N,C)[index[i]], index (M) i32
  const char* op = "gather_rows";
  float* O = f32(out);
  const float* I = f32(inp);
  const int32_t* idx = i32(index);
  const Mat mo = mat_of(out), mi = mat_of(inp);
  const int64_t M = mo.rows, C = mo.cols;
  check_index(op, idx, M, mi.rows);
#pragma omp parallel for schedule(static) if (M * C >= kParallelMin)
  for (int64_t i = 0; i < M; ++i) std::memcpy(O + i * C, I + int64_t(idx[i]) * C, size_t(C) * sizeof(float));
}

void CpuOps::scatter_add_rows_impl(Tensor dinp, Tensor dout, Tensor index) {
  // dinp (N,C)[index[i]] += dout (M,C)[i], index (M) i32 (may repeat)
  const char* op = "scatter_add_rows";
  float* dI = f32(dinp);
  const float* dO = f32(dout);
  const int32_t* idx = i32(index);
  const Mat mi = mat_of(dinp), mo = mat_of(dout);
  const int64_t M = mo.rows, C = mo.cols;
  check_index(op, idx, M, mi.rows);
  // Threads split the columns, each walking all rows in order: repeated indices never race and every
  // element sums its contributions in row order whatever the thread count (deterministic).
#pragma omp parallel if (M * C >= kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t c0 = C * t / nt, c1 = C * (t + 1) / nt;
    for (int64_t i = 0; i < M; ++i) {
      float* d = dI + int64_t(idx[i]) * C;
      const float* s = dO + i * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) d[c] += s[c];
    }
  }
}

}  // namespace mpigpt::cpu
