// GPU tests (label gpu) of the CUDA backend's AdamW update against the CPU backend over several
// steps, and of sum / sum_squares against double loops (f32 and bf16 data) with their reproducibility.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// The device's param, m, v against the CPU's after the same AdamW steps. The same fp32 formula on
// both sides; nvcc fuses multiply-adds where GCC (no -march) does not, so results differ by an ulp
// or two per step: the CPU test's bounds against a double reference (1e-6 for O(1) params,
// absolute for m that can cancel, relative for v) hold.
void check_adam_state(Ops& ops, const Tensor& gp, const Tensor& gm, const Tensor& gv, const std::vector<float>& p,
                      const std::vector<float>& m, const std::vector<float>& v) {
  auto r = allclose(to_host(ops, gp), p, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, "param: ", r.str());
  r = allclose(to_host(ops, gm), m, 1e-7, 1e-6);
  CHECK_MESSAGE(r.ok, "m: ", r.str());
  r = allclose(to_host(ops, gv), v, 1e-14, 1e-5);
  CHECK_MESSAGE(r.ok, "v: ", r.str());
}

}  // namespace

TEST_CASE("cuda adamw matches the CPU over several steps (vector path, tail, misaligned range)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  // n = 37: nine float4 packs and a tail of one; 100003: many blocks; offset 1: the range starts
  // 4 bytes past a 16-byte boundary, so every pointer is misaligned and the scalar kernel runs.
  for (int64_t n : {int64_t(37), int64_t(100003)}) {
    for (int64_t offset : {int64_t(0), int64_t(1)}) {
      CAPTURE(n);
      CAPTURE(offset);
      const int64_t total = n + offset;
      std::vector<float> p = random_normal(static_cast<size_t>(total), 701, 0), m(static_cast<size_t>(total), 0.0f),
                         v = m;
      auto gp = to_device(*ops, p, {total}), gm = to_device(*ops, m, {total}), gv = to_device(*ops, v, {total});
      const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
      for (int64_t step = 1; step <= 4; ++step) {
        auto g = random_normal(static_cast<size_t>(total), 701, uint64_t(step), step == 3 ? 1e-6f : 1.0f);
        auto gg = to_device(*ops, g, {total});
        Tensor cp = as_tensor(p, {total}).flat_slice(offset, n), cm = as_tensor(m, {total}).flat_slice(offset, n),
               cv = as_tensor(v, {total}).flat_slice(offset, n), cg = as_tensor(g, {total}).flat_slice(offset, n);
        cpu->adamw(cp, cg, cm, cv, lr, b1, b2, eps, wd, step, gs);
        ops->adamw(gp.t.flat_slice(offset, n), gg.t.flat_slice(offset, n), gm.t.flat_slice(offset, n),
                   gv.t.flat_slice(offset, n), lr, b1, b2, eps, wd, step, gs);
      }
      check_adam_state(*ops, gp.t, gm.t, gv.t, p, m, v);
    }
  }
}

TEST_CASE("cuda adamw_runs: one launch over many runs equals adamw run by run, and the CPU") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t n = 70000, ns = 75000;
  // Runs of several 16384-element chunks, one starting 3 elements past alignment (scalar), one
  // whose parameters are aligned but its state is not; aligned runs with and without decay; gaps
  // in the parameters ([0, 3), [35004, 35008), [39009, 39012), [39912, 40000), [69990, 70000):
  // never touched); runs out of offset order; an empty run.
  const std::vector<AdamWRun> runs = {{40000, 29990, 7, 0.1f},
                                      {3, 35001, 29997, 0.0f},
                                      {35008, 4001, 65001, 0.0f},
                                      {39012, 900, 69004, 0.2f},
                                      {69998, 0, 0, 0.3f}};
  // A second list over the same buffers: another table, and back to the first (cached).
  const std::vector<AdamWRun> other = {{41000, 20000, 10000, 0.05f}};
  const std::vector<float> p0 = random_normal(size_t(n), 711, 0);
  std::vector<float> p = p0, m(size_t(ns), 0.0f), v = m;
  auto gp = to_device(*ops, p, {n}), gm = to_device(*ops, m, {ns}), gv = to_device(*ops, v, {ns});
  auto rp = to_device(*ops, p, {n}), rm = to_device(*ops, m, {ns}), rv = to_device(*ops, v, {ns});
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, gs = 0.5f;
  for (int64_t step = 1; step <= 4; ++step) {
    const std::vector<AdamWRun>& rs = step == 2 ? other : runs;
    auto g = random_normal(size_t(n), 711, uint64_t(step), step == 3 ? 1e-6f : 1.0f);
    auto gg = to_device(*ops, g, {n});
    cpu->adamw_runs(as_tensor(p, {n}), as_tensor(g, {n}), as_tensor(m, {ns}), as_tensor(v, {ns}), rs, lr, b1, b2, eps,
                    step, gs);
    ops->adamw_runs(gp.t, gg.t, gm.t, gv.t, rs, lr, b1, b2, eps, step, gs);
    for (const AdamWRun& r : rs)
      ops->adamw(rp.t.flat_slice(r.begin, r.count), gg.t.flat_slice(r.begin, r.count), rm.t.flat_slice(r.state, r.count),
                 rv.t.flat_slice(r.state, r.count), lr, b1, b2, eps, r.weight_decay, step, gs);
  }
  // The same device arithmetic as adamw, element for element: the same bits.
  CHECK(to_host(*ops, gp.t) == to_host(*ops, rp.t));
  CHECK(to_host(*ops, gm.t) == to_host(*ops, rm.t));
  CHECK(to_host(*ops, gv.t) == to_host(*ops, rv.t));
  check_adam_state(*ops, gp.t, gm.t, gv.t, p, m, v);
  const std::vector<float> hp = to_host(*ops, gp.t);
  for (int64_t i : {0, 2, 35004, 35007, 39010, 39950, 69990, 69999}) CHECK(hp[size_t(i)] == p0[size_t(i)]);

  // Many different run lists (past the table cache's bound) still update correctly.
  for (int k = 0; k < 20; ++k) {
    const std::vector<AdamWRun> one = {{k, 100, 2 * k, 0.1f}};
    std::vector<float> cp = to_host(*ops, gp.t), cm = to_host(*ops, gm.t), cv = to_host(*ops, gv.t);
    auto g = random_normal(size_t(n), 712, uint64_t(k));
    auto gg = to_device(*ops, g, {n});
    cpu->adamw_runs(as_tensor(cp, {n}), as_tensor(g, {n}), as_tensor(cm, {ns}), as_tensor(cv, {ns}), one, lr, b1, b2,
                    eps, 5, gs);
    ops->adamw_runs(gp.t, gg.t, gm.t, gv.t, one, lr, b1, b2, eps, 5, gs);
    const auto r = allclose(to_host(*ops, gp.t), cp, 1e-6, 1e-6);
    CHECK_MESSAGE(r.ok, "param after run list ", k, ": ", r.str());
  }
  CHECK_THROWS_WITH_AS(ops->adamw_runs(gp.t, gp.t, gm.t, gv.t, {{n - 1, 2, 0, 0.0f}}, lr, b1, b2, eps, 1, gs),
                       doctest::Contains("lies outside param"), Error);
}

TEST_CASE("cuda sum and sum_squares: double accumulation, bitwise reproducible") {
  auto ops = cuda_ops_or_skip();
  for (DType dt : {DType::F32, DType::BF16}) {
    for (int64_t n : {int64_t(1), int64_t(1000), int64_t(200003), int64_t(3000001)}) {
      for (int64_t offset : {int64_t(0), int64_t(1)}) {  // aligned (packs + tail) and misaligned (scalar)
        const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
        CAPTURE(dtype);
        CAPTURE(n);
        CAPTURE(offset);
        auto x = random_normal(static_cast<size_t>(n + offset), 711, 0, 2.0f, 0.25f);
        if (dt == DType::BF16) x = rounded_bf16(std::move(x));
        double s = 0, s2 = 0;
        for (int64_t i = offset; i < n + offset; ++i) {
          s += x[size_t(i)];
          s2 += double(x[size_t(i)]) * x[size_t(i)];
        }
        auto g = to_device(*ops, x, {n + offset}, dt);
        const Tensor t = g.t.flat_slice(offset, n);
        const double got_s = ops->sum(t), got_s2 = ops->sum_squares(t);
        // Double sums of the same values (squares exact in double) in another order: the difference is
        // a few double roundings of partial sums, far below 1e-12 of the sum of squares (the CPU
        // test's bound; s can cancel, so it is bounded by the squares too).
        CHECK(std::abs(got_s - s) <= 1e-12 * s2 + 1e-12);
        CHECK(std::abs(got_s2 - s2) <= 1e-12 * s2);
        CHECK(ops->sum(t) == got_s);  // fixed partition and combining order: bitwise
        CHECK(ops->sum_squares(t) == got_s2);
      }
    }
  }
  // Values whose squares lose everything in a float accumulator; exact in double.
  std::vector<float> big(1 << 17, 4096.0f);
  big[5] = 1.0f;
  const double want = double(big.size() - 1) * 4096.0 * 4096.0 + 1.0;
  auto g = to_device(*ops, big, {int64_t(big.size())});
  CHECK(ops->sum_squares(g.t) == want);
  // An empty range sums to 0 without a launch.
  CHECK(ops->sum(g.t.flat_slice(0, 0)) == 0.0);
}
