// Measure the GEMM peak of a backend.
#include "lib/train/peak.h"

#include <algorithm>
#include <chrono>

#include "lib/kernels/buffer.h"

namespace mpigpt {

double measured_peak_flops(Ops& ops) {
  const int64_t n = 1024;
  Buffer a(ops, n * n * 4), b(ops, n * n * 4), c(ops, n * n * 4);
  Tensor ta = a.tensor({n, n}), tb = b.tensor({n, n}), tc = c.tensor({n, n});
  ops.fill(ta, 0.5f);
  ops.fill(tb, 0.25f);
  ops.gemm(tc, ta, tb, false, true, 1.0f, 0.0f);  // warm-up: thread pool start, page faults
  double best = 1e30;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    ops.gemm(tc, ta, tb, false, true, 1.0f, 0.0f);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * n * n * n / best;
}

}  // namespace mpigpt
