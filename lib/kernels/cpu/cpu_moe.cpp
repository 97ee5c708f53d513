// CPU backend: mixture-of-experts ops (router top-k and its backward, grouped linear layers over
// consecutive row groups, weighted combine of routed rows). Row-wise math runs in double: the
// router is small (E columns) and is the reference the CUDA kernels will be held to.
#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/kernels/cpu/cpu_ops.h"
#include "lib/kernels/op_checks.h"

namespace mpigpt::cpu {

namespace {

// Softmax of one row in double; returns its log-sum-exp.
double softmax_row(const float* x, int64_t E, double* p) {
  double m = -INFINITY;
  for (int64_t e = 0; e < E; ++e) m = std::max(m, double(x[e]));
  double s = 0.0;
  for (int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(double(x[e]) - m));
  for (int64_t e = 0; e < E; ++e) p[e] /= s;
  return m + std::log(s);
}

void check_router_shapes(const char* op, const Tensor& probs, const Tensor& topk, const Tensor& gates,
                         const Tensor& lse, const Tensor& logits) {
  const Mat ml = mat_of(logits), mp = mat_of(probs), mt = mat_of(topk), mg = mat_of(gates);
  MPIGPT_CHECK(mp.rows == ml.rows && mp.cols == ml.cols, "{}: probs {} must match logits {} (N,E)", op,
               probs.shape.str(), logits.shape.str());
  MPIGPT_CHECK(mt.rows == ml.rows && mg.rows == ml.rows && mt.cols == mg.cols && mt.cols >= 1 && mt.cols <= ml.cols,
               "{}: topk {} and gates {} must be (N,K) with 1 <= K <= E for logits {}", op, topk.shape.str(),
               gates.shape.str(), logits.shape.str());
  MPIGPT_CHECK(!lse.defined() || lse.numel() == ml.rows, "{}: lse {} must have N = {} elements", op, lse.shape.str(),
               ml.rows);
}

}  // namespace

void CpuOps::moe_router_forward(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                                bool normalize) {
  // probs (N,E), topk (N,K) i32, gates (N,K), lse (N) optional; logits (N,E)
  const char* op = "moe_router_forward";
  float* P = f32_arg(probs, op, "probs");
  int32_t* I = i32_arg(topk, op, "topk");
  float* G = f32_arg(gates, op, "gates");
  float* L = f32_opt(lse, op, "lse");
  const float* X = f32_arg(logits, op, "logits");
  check_router_shapes(op, probs, topk, gates, lse, logits);
  const int64_t N = mat_of(logits).rows, E = mat_of(logits).cols, K = mat_of(topk).cols;
#pragma omp parallel if (N * E >= kParallelMin)
  {
    std::vector<double> p(static_cast<size_t>(E), 0.0), sm(static_cast<size_t>(E), 0.0);
    std::vector<char> taken(static_cast<size_t>(E), 0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = X + n * E;
      const double l = softmax_row(x, E, sm.data());
      if (sigmoid)
        for (int64_t e = 0; e < E; ++e) p[e] = 1.0 / (1.0 + std::exp(-double(x[e])));
      else
        p = sm;
      if (L) L[n] = float(l);
      // The probs are stored first and the top-k chosen on the stored floats, so that a caller
      // comparing gates with probs sees the same values the choice was made on.
      for (int64_t e = 0; e < E; ++e) P[n * E + e] = float(p[e]), taken[e] = 0;
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e)
          if (!taken[e] && (best < 0 || P[n * E + e] > P[n * E + best])) best = e;  // strict: lower index wins ties
        taken[best] = 1;
        I[n * K + k] = int32_t(best);
        s += double(P[n * E + best]);
      }
      for (int64_t k = 0; k < K; ++k) {
        const double g = double(P[n * E + I[n * K + k]]);
        G[n * K + k] = float(normalize ? g / s : g);
      }
    }
  }
}

void CpuOps::moe_router_backward(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits, Tensor probs,
                                 Tensor topk, bool sigmoid, bool normalize) {
  // dlogits (N,E) overwritten; dgates (N,K); dprobs (N,E) optional; dlse (N) optional
  const char* op = "moe_router_backward";
  float* dL = f32_arg(dlogits, op, "dlogits");
  const float* dG = f32_arg(dgates, op, "dgates");
  const float* dP = f32_opt(dprobs, op, "dprobs");
  const float* dZ = f32_opt(dlse, op, "dlse");
  const float* X = f32_arg(logits, op, "logits");
  const float* P = f32_arg(probs, op, "probs");
  const int32_t* I = i32_arg(topk, op, "topk");
  check_router_shapes(op, probs, topk, dgates, dlse, logits);
  const int64_t N = mat_of(logits).rows, E = mat_of(logits).cols, K = mat_of(topk).cols;
  MPIGPT_CHECK(mat_of(dlogits).rows == N && mat_of(dlogits).cols == E, "{}: dlogits {} must match logits {}", op,
               dlogits.shape.str(), logits.shape.str());
  MPIGPT_CHECK(!dP || dprobs.numel() == N * E, "{}: dprobs {} must match logits {}", op, dprobs.shape.str(),
               logits.shape.str());
#pragma omp parallel if (N * E >= kParallelMin)
  {
    std::vector<double> dp(static_cast<size_t>(E), 0.0), sm(static_cast<size_t>(E), 0.0);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* p = P + n * E;
      for (int64_t e = 0; e < E; ++e) dp[e] = dP ? double(dP[n * E + e]) : 0.0;
      const int32_t* idx = I + n * K;
      const float* dg = dG + n * K;
      if (normalize) {
        // g_k = p_k / S, S = sum_j p_j: dL/dp_k = (dg_k - sum_j dg_j g_j) / S
        double S = 0.0, dot = 0.0;
        for (int64_t k = 0; k < K; ++k) S += double(p[idx[k]]);
        for (int64_t k = 0; k < K; ++k) dot += double(dg[k]) * double(p[idx[k]]) / S;
        for (int64_t k = 0; k < K; ++k) dp[idx[k]] += (double(dg[k]) - dot) / S;
      } else {
        for (int64_t k = 0; k < K; ++k) dp[idx[k]] += double(dg[k]);
      }
      float* dl = dL + n * E;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) dl[e] = float(dp[e] * double(p[e]) * (1.0 - double(p[e])));
      } else {
        double s = 0.0;
        for (int64_t e = 0; e < E; ++e) s += double(p[e]) * dp[e];
        for (int64_t e = 0; e < E; ++e) dl[e] = float(double(p[e]) * (dp[e] - s));
      }
      if (dZ) {
        softmax_row(X + n * E, E, sm.data());
        for (int64_t e = 0; e < E; ++e) dl[e] = float(double(dl[e]) + double(dZ[n]) * sm[e]);
      }
    }
  }
}

namespace {
// The rows of group g of a (M, cols) matrix and the g-th (rows, cols) matrix of a (G, rows, cols) stack.
Tensor rows_of(const Tensor& t, int64_t first, int64_t count, int64_t cols) {
  return Tensor(static_cast<float*>(t.ptr) + first * cols, {count, cols}, t.dtype, t.device);
}
Tensor group_of(const Tensor& t, int64_t g) {
  if (!t.defined()) return Tensor();
  const int64_t per = t.numel() / t.size(0);
  Shape s;
  s.ndim = t.ndim() - 1;
  for (int i = 1; i < t.ndim(); ++i) s.d[i - 1] = t.size(i);
  return Tensor(static_cast<float*>(t.ptr) + g * per, s, t.dtype, t.device);
}
}  // namespace

void CpuOps::grouped_linear_forward(Tensor out, Tensor inp, Tensor weight, Tensor bias, const int64_t* group_rows) {
  // out (M,OC), inp (M,IC), weight (G,OC,IC), bias (G,OC); group g = group_rows[g] consecutive rows
  const char* op = "grouped_linear_forward";
  f32_arg(out, op, "out");
  f32_arg(inp, op, "inp");
  f32_arg(weight, op, "weight");
  const Mat mo = mat_of(out), mi = mat_of(inp);
  check_grouped_linear(op, weight, bias, mi.rows, group_rows);
  MPIGPT_CHECK(mo.rows == mi.rows && mo.cols == weight.size(1) && mi.cols == weight.size(2),
               "{}: out {} = inp {} @ weight {}^T per group has mismatched shapes", op, out.shape.str(),
               inp.shape.str(), weight.shape.str());
  // One BLAS call per group (the CPU has no grouped GEMM); a fused kernel takes the same layout.
  for (int64_t g = 0, r = 0; g < weight.size(0); r += group_rows[g], ++g)
    linear_forward(rows_of(out, r, group_rows[g], mo.cols), rows_of(inp, r, group_rows[g], mi.cols),
                   group_of(weight, g), group_of(bias, g));
}

void CpuOps::grouped_linear_backward(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp, Tensor weight,
                                     const int64_t* group_rows) {
  // dinp (M,IC) overwritten; dweight (G,OC,IC), dbias (G,OC) accumulate
  const char* op = "grouped_linear_backward";
  f32_arg(dout, op, "dout");
  f32_arg(weight, op, "weight");
  const Mat mo = mat_of(dout);
  check_grouped_linear(op, weight, dbias, mo.rows, group_rows);
  MPIGPT_CHECK(mo.cols == weight.size(1), "{}: dout {} must have OC = {} columns", op, dout.shape.str(),
               weight.size(1));
  const int64_t IC = weight.size(2);
  MPIGPT_CHECK(!dinp.defined() || (mat_of(dinp).rows == mo.rows && mat_of(dinp).cols == IC),
               "{}: dinp {} must be (M,IC) = ({}, {})", op, dinp.shape.str(), mo.rows, IC);
  MPIGPT_CHECK(!dweight.defined() || dweight.shape == weight.shape, "{}: dweight {} must match weight {}", op,
               dweight.shape.str(), weight.shape.str());
  MPIGPT_CHECK(!dweight.defined() || (mat_of(inp).rows == mo.rows && mat_of(inp).cols == IC),
               "{}: inp {} must be (M,IC) = ({}, {})", op, inp.shape.str(), mo.rows, IC);
  for (int64_t g = 0, r = 0; g < weight.size(0); r += group_rows[g], ++g) {
    const int64_t n = group_rows[g];
    linear_backward(dinp.defined() ? rows_of(dinp, r, n, IC) : Tensor(), group_of(dweight, g), group_of(dbias, g),
                    rows_of(dout, r, n, mo.cols), dweight.defined() ? rows_of(inp, r, n, IC) : Tensor(),
                    group_of(weight, g));
  }
}

namespace {
void check_combine(const char* op, const Tensor& out, const Tensor& rows, const int32_t* slot, const Tensor& slot_t,
                   const Tensor& gates) {
  const Mat mo = mat_of(out), mr = mat_of(rows), mg = mat_of(gates);
  MPIGPT_CHECK(mo.cols == mr.cols && slot_t.numel() == mr.rows && mg.rows == mo.rows,
               "{}: out {} (N,C), rows {} (M,C), slot {} (M), gates {} (N,K) do not fit", op, out.shape.str(),
               rows.shape.str(), slot_t.shape.str(), gates.shape.str());
  const int64_t NK = gates.numel();
  for (int64_t i = 0; i < mr.rows; ++i)
    MPIGPT_CHECK(slot[i] >= 0 && slot[i] < NK, "{}: slot[{}] = {} is outside [0, {})", op, i, slot[i], NK);
}
}  // namespace

void CpuOps::moe_combine(Tensor out, Tensor rows, Tensor slot, Tensor gates) {
  // out (N,C)[slot/K] += gates[slot] * rows (M,C)[i]
  const char* op = "moe_combine";
  float* O = f32_arg(out, op, "out");
  const float* R = f32_arg(rows, op, "rows");
  const int32_t* S = i32_arg(slot, op, "slot");
  const float* G = f32_arg(gates, op, "gates");
  check_combine(op, out, rows, S, slot, gates);
  const int64_t M = mat_of(rows).rows, C = mat_of(rows).cols, K = mat_of(gates).cols;
  // As scatter_add_rows: threads split the columns and walk the rows in order (no races, the
  // same sums for any thread count).
#pragma omp parallel if (M * C >= kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t c0 = C * t / nt, c1 = C * (t + 1) / nt;
    for (int64_t i = 0; i < M; ++i) {
      float* o = O + int64_t(S[i] / K) * C;
      const float* r = R + i * C;
      const float g = G[S[i]];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) o[c] += g * r[c];
    }
  }
}

void CpuOps::moe_combine_backward(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot, Tensor gates) {
  // drows (M,C) = gates[slot] * dout[slot/K]; dgates[slot] = dout[slot/K] . rows[i]
  const char* op = "moe_combine_backward";
  float* dR = f32_opt(drows, op, "drows");
  float* dG = f32_opt(dgates, op, "dgates");
  const float* dO = f32_arg(dout, op, "dout");
  const float* R = f32_opt(rows, op, "rows");
  const int32_t* S = i32_arg(slot, op, "slot");
  const float* G = f32_arg(gates, op, "gates");
  check_combine(op, dout, dR ? drows : rows, S, slot, gates);
  MPIGPT_CHECK(!dG || (R && dgates.numel() == gates.numel() && rows.numel() == slot.numel() * mat_of(dout).cols),
               "{}: dgates {} needs rows (M,C) and the shape of gates {}", op, dgates.shape.str(), gates.shape.str());
  const int64_t M = slot.numel(), C = mat_of(dout).cols, K = mat_of(gates).cols;
#pragma omp parallel for schedule(static) if (M * C >= kParallelMin)
  for (int64_t i = 0; i < M; ++i) {
    const float* d = dO + int64_t(S[i] / K) * C;
    if (dR) {
      const float g = G[S[i]];
      for (int64_t c = 0; c < C; ++c) dR[i * C + c] = g * d[c];
    }
    if (dG) {
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += double(d[c]) * double(R[i * C + c]);
      dG[S[i]] = float(s);
    }
  }
}

}  // namespace mpigpt::cpu
