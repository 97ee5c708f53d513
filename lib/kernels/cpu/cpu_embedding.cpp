// CPU backend: token (+ position) embedding lookup and its deterministic scatter-add backward.
#include <algorithm>
#include <cstring>

#include "lib/kernels/cpu/cpu_ops.h"

namespace mpigpt::cpu {

// Positions index wpe rows: an out-of-range one is a caller bug, reported before any thread starts.
static void check_positions(const int32_t* pos, int64_t N, int64_t rows, const char* op) {
  for (int64_t n = 0; n < N; ++n)
    MPIGPT_CHECK(pos[n] >= 0 && pos[n] < rows, "{}: positions[{}] = {} is outside wpe's {} rows", op, n, pos[n], rows);
}

void CpuOps::embedding_forward_impl(Tensor out, Tensor tokens, Tensor positions, Tensor wte, Tensor wpe,
                                    int64_t vocab_start) {
  // out (N,C), tokens (N), positions (N), wte (rows,C) = vocabulary rows [vocab_start, vocab_start+rows),
  // wpe (maxT,C) optional
  const char* op = "embedding_forward";
  float* O = f32(out);
  const int32_t* tok = i32(tokens);
  const float* E = f32(wte);
  const float* P = f32(wpe);
  const Mat mo = mat_of(out), me = mat_of(wte);
  const int64_t N = mo.rows, C = mo.cols, rows = me.rows;
  const int32_t* pos = nullptr;
  if (P) {
    pos = i32(positions);
    check_positions(pos, N, mat_of(wpe).rows, op);
  }
#pragma omp parallel for schedule(static) if (N * C >= kParallelMin)
  for (int64_t n = 0; n < N; ++n) {
    float* o = O + n * C;
    const int64_t r = int64_t(tok[n]) - vocab_start;
    if (r >= 0 && r < rows)
      std::memcpy(o, E + r * C, size_t(C) * sizeof(float));
    else
      std::memset(o, 0, size_t(C) * sizeof(float));
    if (P) {
      const float* p = P + int64_t(pos[n]) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += p[c];
    }
  }
}

void CpuOps::embedding_backward_impl(Tensor dwte, Tensor dwpe, Tensor dout, Tensor tokens, Tensor positions,
                                     int64_t vocab_start) {
  // dwte (rows,C) += scatter of dout (N,C) rows by token; dwpe (maxT,C) += scatter by position
  const char* op = "embedding_backward";
  float* dE = f32(dwte);
  float* dP = f32(dwpe);
  const float* dO = f32(dout);
  const Mat mo = mat_of(dout);
  const int64_t N = mo.rows, C = mo.cols;
  const int32_t* tok = nullptr;
  const int32_t* pos = nullptr;
  int64_t rows = 0;
  if (dE) {
    tok = i32(tokens);
    rows = mat_of(dwte).rows;
  }
  if (dP) {
    pos = i32(positions);
    check_positions(pos, N, mat_of(dwpe).rows, op);
  }
  if (!dE && !dP) return;
    // Each thread owns a slice of the channels and walks all rows in order: no two threads touch the
    // same element and every element sums its rows in the same order, so the result is bitwise
    // reproducible for any thread count (no atomics).
#pragma omp parallel if (N * C >= kParallelMin)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = ((C + nt - 1) / nt + 15) / 16 * 16;  // 64-byte multiples
    const int64_t c0 = std::min(C, t * per), c1 = std::min(C, c0 + per);
    for (int64_t n = 0; n < N && c0 < c1; ++n) {
      const float* g = dO + n * C;
      if (dE) {
        const int64_t r = int64_t(tok[n]) - vocab_start;
        if (r >= 0 && r < rows) {
          float* d = dE + r * C;
#pragma omp simd
          for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
        }
      }
      if (dP) {
        float* d = dP + int64_t(pos[n]) * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
      }
    }
  }
}

}  // namespace mpigpt::cpu
