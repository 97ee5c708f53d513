// CPU backend: fused softmax + cross-entropy loss and its logits gradient, whole or as the three
// per-shard steps of the vocabulary-parallel version.
#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

void CpuOps::crossentropy_forward_backward_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor targets, int64_t V,
                                                float dloss) {
  // losses (N), dlogits (N,Vp) (may alias logits), logits (N,Vp), targets (N) i32; softmax over [0, V)
  const char* op = "crossentropy_forward_backward";
  float* L = f32(losses);
  float* dX = f32(dlogits);
  const float* X = f32(logits);
  const int32_t* tgt = i32(targets);
  const Mat mx = mat_of(logits);
  const int64_t N = mx.rows, Vp = mx.cols;
  for (int64_t n = 0; n < N; ++n)
    MPIGPT_CHECK(tgt[n] < V, "{}: targets[{}] = {} is not below V = {}", op, n, tgt[n], V);

#pragma omp parallel for schedule(static) if (N * V >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = X + n * Vp;
    float* dx = dX ? dX + n * Vp : nullptr;
    const int32_t t = tgt[n];
    if (t < 0) {  // ignored row
      if (L) L[n] = 0.0f;
      if (dx) std::fill(dx, dx + Vp, 0.0f);
      continue;
    }
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < V; ++c) m = x[c] > m ? x[c] : m;  // (std::max does not vectorise)
    const float xt = x[t];                                    // read before dx (possibly the same memory) is written
    double s = 0.0;
    if (dx) {
      // Keep the exponentials in dx so that the gradient pass needs no second exp.
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < V; ++c) {
        const float e = vexp(x[c] - m);
        dx[c] = e;
        s += double(e);
      }
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < V; ++c) s += double(vexp(x[c] - m));
    }
    if (L) L[n] = float(std::log(s) - (double(xt) - double(m)));
    if (dx) {
      const float f = float(double(dloss) / s);
#pragma omp simd
      for (int64_t c = 0; c < V; ++c) dx[c] *= f;
      dx[t] -= dloss;
      std::fill(dx + V, dx + Vp, 0.0f);
    }
  }
}

// ---- vocabulary-parallel cross-entropy ---------------------------------------------------------

namespace {

// One rank's slice of the vocabulary: logits (N,Vl) for global columns [vocab_start, vocab_start + Vl)
// of which the first `valid` are below V (the rest is padding).
struct Shard {
  int64_t N, Vl, valid;
};

Shard shard_of(const char* op, const Tensor& logits, int64_t vocab_start, int64_t V) {
  const Mat mx = mat_of(logits);
  return {mx.rows, mx.cols, std::clamp<int64_t>(V - vocab_start, 0, mx.cols)};
}

// A per-row (N) f32 argument; nullptr when undefined (only for the optional ones).
float* row_arg(const Tensor& t, const char* op, const char* what, const Shard& s, const Tensor& logits,
               bool required = true) {
  float* p = required ? f32(t) : f32(t);
  return p;
}

const int32_t* targets_arg(const Tensor& targets, const char* op, const Shard& s, const Tensor& logits, int64_t V) {
  const int32_t* tgt = i32(targets);
  for (int64_t n = 0; n < s.N; ++n)
    MPIGPT_CHECK(tgt[n] < V, "{}: targets[{}] = {} is not below V = {}", op, n, tgt[n], V);
  return tgt;
}

}  // namespace

void CpuOps::softmax_shard_max_impl(Tensor maxes, Tensor logits, int64_t vocab_start, int64_t V) {
  // maxes (N), logits (N,Vl)
  const char* op = "softmax_shard_max";
  const float* X = f32(logits);
  const Shard s = shard_of(op, logits, vocab_start, V);
  float* M = row_arg(maxes, op, "maxes", s, logits);
  const int64_t Vl = s.Vl, valid = s.valid;

#pragma omp parallel for schedule(static) if (s.N * valid >= kParallelMin)
  for (int64_t n = 0; n < s.N; ++n) {
    const float* x = X + n * Vl;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t c = 0; c < valid; ++c) m = x[c] > m ? x[c] : m;
    M[n] = m;
  }
}

void CpuOps::softmax_shard_sums_impl(Tensor sumexp, Tensor target_logit, Tensor logits, Tensor maxes, Tensor targets,
                                     int64_t vocab_start, int64_t V) {
  // sumexp (N), target_logit (N), logits (N,Vl), maxes (N) global, targets (N) i32 global ids
  const char* op = "softmax_shard_sums";
  const float* X = f32(logits);
  const Shard s = shard_of(op, logits, vocab_start, V);
  float* S = row_arg(sumexp, op, "sumexp", s, logits);
  float* TL = row_arg(target_logit, op, "target_logit", s, logits);
  const float* M = row_arg(maxes, op, "maxes", s, logits);
  const int32_t* tgt = targets_arg(targets, op, s, logits, V);
  const int64_t Vl = s.Vl, valid = s.valid;

#pragma omp parallel for schedule(static) if (s.N * valid >= kParallelMin)
  for (int64_t n = 0; n < s.N; ++n) {
    const float* x = X + n * Vl;
    const int32_t t = tgt[n];
    if (t < 0) {  // ignored row
      S[n] = 0.0f;
      TL[n] = 0.0f;
      continue;
    }
    const float m = M[n];
    double sum = 0.0;  // in double as in the fused op; rounded to f32 once, for the all-reduce
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < valid; ++c) sum += double(vexp(x[c] - m));
    S[n] = float(sum);
    const int64_t lt = int64_t(t) - vocab_start;  // t < V, so lt < valid whenever lt < Vl
    TL[n] = lt >= 0 && lt < valid ? x[lt] : 0.0f;
  }
}

void CpuOps::crossentropy_shard_finish_impl(Tensor losses, Tensor dlogits, Tensor logits, Tensor maxes, Tensor sumexp,
                                            Tensor target_logit, Tensor targets, int64_t vocab_start, int64_t V,
                                            float dloss) {
  // losses (N), dlogits (N,Vl) (may alias logits), logits (N,Vl), maxes, sumexp, target_logit (N) global,
  // targets (N) i32 global ids
  const char* op = "crossentropy_shard_finish";
  const float* X = f32(logits);
  const Shard s = shard_of(op, logits, vocab_start, V);
  float* L = row_arg(losses, op, "losses", s, logits, false);
  float* dX = f32(dlogits);
  const float* M = row_arg(maxes, op, "maxes", s, logits);
  const float* S = row_arg(sumexp, op, "sumexp", s, logits);
  const float* TL = row_arg(target_logit, op, "target_logit", s, logits);
  const int32_t* tgt = targets_arg(targets, op, s, logits, V);
  const int64_t Vl = s.Vl, valid = s.valid;

#pragma omp parallel for schedule(static) if (dX && s.N * valid >= kParallelMin)
  for (int64_t n = 0; n < s.N; ++n) {
    float* dx = dX ? dX + n * Vl : nullptr;
    const int32_t t = tgt[n];
    if (t < 0) {  // ignored row
      if (L) L[n] = 0.0f;
      if (dx) std::fill(dx, dx + Vl, 0.0f);
      continue;
    }
    if (L) L[n] = float(std::log(double(S[n])) - (double(TL[n]) - double(M[n])));
    if (dx) {
      // logits are read only here, element by element before dx[c] is written: aliasing is safe.
      const float* x = X + n * Vl;
      const float m = M[n], f = float(double(dloss) / double(S[n]));
#pragma omp simd
      for (int64_t c = 0; c < valid; ++c) dx[c] = vexp(x[c] - m) * f;
      const int64_t lt = int64_t(t) - vocab_start;
      if (lt >= 0 && lt < valid) dx[lt] -= dloss;
      std::fill(dx + valid, dx + Vl, 0.0f);
    }
  }
}

}  // namespace mpigpt::cpu
