// CPU backend: mixture-of-experts ops (router top-k and its backward, grouped linear layers over
// consecutive row groups, weighted combine of routed rows). Row-wise math runs in double: the
// router is small (E columns) and is the reference the CUDA kernels will be held to.
#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/kernels/cpu/cpu_ops.h"

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

}  // namespace

void CpuOps::moe_router_forward_impl(Tensor probs, Tensor topk, Tensor gates, Tensor lse, Tensor logits, bool sigmoid,
                                     bool normalize) {
  // probs (N,E), topk (N,K) i32, gates (N,K), lse (N) optional; logits (N,E)
  float* P = f32(probs);
  int32_t* I = i32(topk);
  float* G = f32(gates);
  float* L = f32(lse);
  const float* X = f32(logits);
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

void CpuOps::moe_router_backward_impl(Tensor dlogits, Tensor dgates, Tensor dprobs, Tensor dlse, Tensor logits,
                                      Tensor probs,
                                      Tensor topk, bool sigmoid, bool normalize) {
  // dlogits (N,E) overwritten; dgates (N,K); dprobs (N,E) optional; dlse (N) optional
  float* dL = f32(dlogits);
  const float* dG = f32(dgates);
  const float* dP = f32(dprobs);
  const float* dZ = f32(dlse);
  const float* X = f32(logits);
  const float* P = f32(probs);
  const int32_t* I = i32(topk);
  const int64_t N = mat_of(logits).rows, E = mat_of(logits).cols, K = mat_of(topk).cols;
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

void CpuOps::grouped_linear_forward_impl(Tensor out, Tensor inp, Tensor weight, Tensor bias,
                                         const int64_t* group_rows) {
  // out (M,OC), inp (M,IC), weight (G,OC,IC), bias (G,OC); group g = group_rows[g] consecutive rows
  const Mat mo = mat_of(out), mi = mat_of(inp);
  // One BLAS call per group (the CPU has no grouped GEMM); a fused kernel takes the same layout.
  for (int64_t g = 0, r = 0; g < weight.size(0); r += group_rows[g], ++g)
    linear_forward(rows_of(out, r, group_rows[g], mo.cols), rows_of(inp, r, group_rows[g], mi.cols),
                   group_of(weight, g), group_of(bias, g));
}

void CpuOps::grouped_linear_backward_impl(Tensor dinp, Tensor dweight, Tensor dbias, Tensor dout, Tensor inp,
                                          Tensor weight,
                                          const int64_t* group_rows) {
  // dinp (M,IC) overwritten; dweight (G,OC,IC), dbias (G,OC) accumulate
  const Mat mo = mat_of(dout);
  const int64_t IC = weight.size(2);
  for (int64_t g = 0, r = 0; g < weight.size(0); r += group_rows[g], ++g) {
    const int64_t n = group_rows[g];
    linear_backward(dinp.defined() ? rows_of(dinp, r, n, IC) : Tensor(), group_of(dweight, g), group_of(dbias, g),
                    rows_of(dout, r, n, mo.cols), dweight.defined() ? rows_of(inp, r, n, IC) : Tensor(),
                    group_of(weight, g));
  }
}

namespace {
// Slots index gates: an out-of-range one is a caller bug, reported before any thread starts.
void check_slots(const char* op, const int32_t* slot, int64_t M, int64_t NK) {
  for (int64_t i = 0; i < M; ++i)
    MPIGPT_CHECK(slot[i] >= 0 && slot[i] < NK, "{}: slot[{}] = {} is outside [0, {})", op, i, slot[i], NK);
}
}  // namespace

void CpuOps::moe_combine_impl(Tensor out, Tensor rows, Tensor slot, Tensor gates) {
  // out (N,C)[slot/K] += gates[slot] * rows (M,C)[i]
  const char* op = "moe_combine";
  float* O = f32(out);
  const float* R = f32(rows);
  const int32_t* S = i32(slot);
  const float* G = f32(gates);
  check_slots(op, S, slot.numel(), gates.numel());
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

void CpuOps::moe_combine_backward_impl(Tensor drows, Tensor dgates, Tensor dout, Tensor rows, Tensor slot,
                                       Tensor gates) {
  // drows (M,C) = gates[slot] * dout[slot/K]; dgates[slot] = dout[slot/K] . rows[i]
  const char* op = "moe_combine_backward";
  float* dR = f32(drows);
  float* dG = f32(dgates);
  const float* dO = f32(dout);
  const float* R = f32(rows);
  const int32_t* S = i32(slot);
  const float* G = f32(gates);
  check_slots(op, S, slot.numel(), gates.numel());
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
