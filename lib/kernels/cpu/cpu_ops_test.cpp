// Tests of the CPU backend's memory and element-wise ops, reductions, AdamW and vector math.
#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "lib/kernels/cpu/cpu_math.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("cpu allocate: zero-filled, 64-byte aligned, even when the block is reused") {
  auto ops = make_cpu_ops();
  CHECK(ops->device() == Device::CPU);
  for (size_t bytes : {size_t(0), size_t(1), size_t(63), size_t(1000), size_t(3) << 20}) {
    CAPTURE(bytes);
    for (int round = 0; round < 2; ++round) {  // the second allocation likely reuses the first block
      auto* p = static_cast<unsigned char*>(ops->allocate(bytes));
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0);
      size_t nonzero = 0;
      for (size_t i = 0; i < bytes; ++i) nonzero += p[i] != 0;
      CHECK(nonzero == 0);
      std::memset(p, 0xAB, bytes);
      ops->release(p);
    }
  }
  ops->release(nullptr);  // like free
}

TEST_CASE("cpu copy, fill, scale, add") {
  auto ops = make_cpu_ops();
  for (int64_t n : {int64_t(7), int64_t(300001)}) {  // serial and threaded paths
    CAPTURE(n);
    std::vector<float> a = random_normal(static_cast<size_t>(n), 1, 1), b = random_normal(static_cast<size_t>(n), 1, 2),
                       c(a.size(), 0.0f);
    Tensor ta = as_tensor(a, {n}), tb = as_tensor(b, {n}), tc = as_tensor(c, {n});
    ops->copy(tc, ta);
    CHECK(std::memcmp(c.data(), a.data(), a.size() * 4) == 0);

    ops->add(tc, ta, tb);
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) ok &= c[size_t(i)] == a[size_t(i)] + b[size_t(i)];
    CHECK(ok);
    ops->add(ta, ta, tb);  // out aliasing an input
    CHECK(std::memcmp(c.data(), a.data(), a.size() * 4) == 0);

    ops->scale(tc, -0.5f);
    ok = true;
    for (int64_t i = 0; i < n; ++i) ok &= c[size_t(i)] == -0.5f * a[size_t(i)];
    CHECK(ok);

    ops->fill(tc, 2.5f);
    ok = true;
    for (float x : c) ok &= x == 2.5f;
    CHECK(ok);
    ops->fill(tc, 0.0f);
    ok = true;
    for (float x : c) ok &= x == 0.0f;
    CHECK(ok);

    std::vector<int32_t> ia(static_cast<size_t>(n)), ib(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) ia[size_t(i)] = int32_t(i * 7 - 3);
    ops->copy(as_tensor(ib, {n}), as_tensor(ia, {n}));
    CHECK(ia == ib);
    ops->fill(as_tensor(ib, {n}), -1.0f);
    CHECK(std::all_of(ib.begin(), ib.end(), [](int32_t x) { return x == -1; }));
  }
  std::vector<float> x(6), y(5);
  std::vector<int32_t> z(6);
  CHECK_THROWS_WITH_AS(ops->copy(as_tensor(x, {6}), as_tensor(y, {5})), doctest::Contains("copy"), Error);
  CHECK_THROWS_WITH_AS(ops->copy(as_tensor(x, {6}), as_tensor(z, {6})), doctest::Contains("copy"), Error);
  CHECK_THROWS_WITH_AS(ops->add(as_tensor(x, {6}), as_tensor(x, {6}), as_tensor(y, {5})), doctest::Contains("add"),
                       Error);
}

TEST_CASE("cpu sum and sum_squares: double accumulation, independent of the thread count") {
  auto ops = make_cpu_ops();
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(200003)}) {
    CAPTURE(n);
    auto x = random_normal(size_t(n), 3, 0, 2.0f, 0.25f);
    double s = 0, s2 = 0;
    for (float v : x) {
      s += v;
      s2 += double(v) * v;
    }
    Tensor t = as_tensor(x, {n});
    const double got_s = ops->sum(t), got_s2 = ops->sum_squares(t);
    // Both are sums of doubles in another order: relative 1e-12 is far above double rounding.
    CHECK(std::abs(got_s - s) <= 1e-12 * s2);  // s can cancel; bound by the sum of magnitudes
    CHECK(std::abs(got_s2 - s2) <= 1e-12 * s2);
    const int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    const double one_s = ops->sum(t), one_s2 = ops->sum_squares(t);
    omp_set_num_threads(threads);
    CHECK(one_s == got_s);  // bitwise
    CHECK(one_s2 == got_s2);
  }
  // Values whose squares lose everything in a float accumulator.
  std::vector<float> big(1 << 17, 4096.0f);
  big[5] = 1.0f;
  const double want = double(big.size() - 1) * 4096.0 * 4096.0 + 1.0;
  CHECK(ops->sum_squares(as_tensor(big, {int64_t(big.size())})) == want);
}

// AdamW exactly as written in ops.h, in double.
static void adamw_reference(std::vector<double>& p, const std::vector<float>& g, std::vector<double>& m,
                            std::vector<double>& v, double lr, double b1, double b2, double eps, double wd,
                            int64_t step, double gs) {
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = double(g[i]) * gs;
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    const double mhat = m[i] / (1 - std::pow(b1, double(step)));
    const double vhat = v[i] / (1 - std::pow(b2, double(step)));
    p[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * p[i]);
  }
}

TEST_CASE("cpu adamw matches the formula over several steps") {
  auto ops = make_cpu_ops();
  for (int64_t n : {int64_t(37), int64_t(100003)}) {
    CAPTURE(n);
    std::vector<float> p = random_normal(static_cast<size_t>(n), 5, 0), m(static_cast<size_t>(n)), v = m;
    std::vector<double> rp(p.begin(), p.end()), rm(static_cast<size_t>(n)), rv(static_cast<size_t>(n));
    const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
    for (int64_t step = 1; step <= 4; ++step) {
      auto g = random_normal(size_t(n), 5, uint64_t(step), step == 3 ? 1e-6f : 1.0f);  // one tiny-grad step
      ops->adamw(as_tensor(p, {n}), as_tensor(g, {n}), as_tensor(m, {n}), as_tensor(v, {n}), lr, b1, b2, eps, wd, step,
                 gs);
      adamw_reference(rp, g, rm, rv, lr, b1, b2, eps, wd, step, gs);
    }
    // fp32 arithmetic on O(1) values for four steps: a few ulp of 1 (1.2e-7) in params. m is a
    // signed sum that can cancel to ~0, so its error is a few ulp of its O(0.1) terms (absolute);
    // v sums positive terms, so a relative bound holds.
    auto rp_ = allclose(p, rp, 1e-6, 1e-6);
    CHECK_MESSAGE(rp_.ok, "param: ", rp_.str());
    auto rm_ = allclose(m, rm, 1e-7, 1e-6);
    CHECK_MESSAGE(rm_.ok, "m: ", rm_.str());
    auto rv_ = allclose(v, rv, 1e-14, 1e-5);
    CHECK_MESSAGE(rv_.ok, "v: ", rv_.str());
  }
  std::vector<float> a(4), b(3);
  CHECK_THROWS_WITH_AS(ops->adamw(as_tensor(a, {4}), as_tensor(b, {3}), as_tensor(a, {4}), as_tensor(a, {4}), 1, 0.9f,
                                  0.95f, 1e-8f, 0, 1, 1),
                       doctest::Contains("adamw"), Error);
  CHECK_THROWS_WITH_AS(ops->adamw(as_tensor(a, {4}), as_tensor(a, {4}), as_tensor(a, {4}), as_tensor(a, {4}), 1, 0.9f,
                                  0.95f, 1e-8f, 0, 0, 1),
                       doctest::Contains("step"), Error);
}

TEST_CASE("cpu adamw_runs: each run as adamw with its decay, elements outside every run untouched; bad runs") {
  auto ops = make_cpu_ops();
  const int64_t n = 40, ns = 30;
  // Runs in a different order than their offsets, state packed differently, a gap at [10, 14) and
  // at the end of the parameters, an empty run.
  const std::vector<AdamWRun> runs = {{20, 12, 0, 0.1f}, {0, 10, 12, 0.0f}, {14, 6, 22, 0.3f}, {5, 0, 0, 0.2f}};
  const std::vector<float> p0 = random_normal(size_t(n), 9, 0);
  std::vector<float> g = random_normal(size_t(n), 9, 1);
  std::vector<float> p = p0, m(size_t(ns), 0.01f), v(size_t(ns), 0.02f);
  std::vector<float> wp = p, wm = m, wv = v;
  for (int64_t step = 1; step <= 2; ++step) {
    ops->adamw_runs(as_tensor(p, {n}), as_tensor(g, {n}), as_tensor(m, {ns}), as_tensor(v, {ns}), runs, 1e-2f, 0.9f,
                    0.95f, 1e-8f, step, 0.5f);
    for (const AdamWRun& r : runs)
      ops->adamw(as_tensor(wp, {n}).flat_slice(r.begin, r.count), as_tensor(g, {n}).flat_slice(r.begin, r.count),
                 as_tensor(wm, {ns}).flat_slice(r.state, r.count), as_tensor(wv, {ns}).flat_slice(r.state, r.count),
                 1e-2f, 0.9f, 0.95f, 1e-8f, r.weight_decay, step, 0.5f);
  }
  CHECK(p == wp);
  CHECK(m == wm);
  CHECK(v == wv);
  for (int64_t i : {10, 13, 32, 39}) CHECK(p[size_t(i)] == p0[size_t(i)]);
  CHECK(p[0] != p0[0]);

  std::vector<float> a(8);
  auto bad = [&](const std::vector<AdamWRun>& rs) {
    ops->adamw_runs(as_tensor(a, {8}), as_tensor(a, {8}), as_tensor(a, {8}), as_tensor(a, {8}), rs, 1, 0.9f, 0.95f,
                    1e-8f, 1, 1);
  };
  CHECK_THROWS_WITH_AS(bad({{6, 4, 0, 0.0f}}), doctest::Contains("lies outside param"), Error);
  CHECK_THROWS_WITH_AS(bad({{0, 4, 0, 0.0f}, {3, 2, 4, 0.0f}}), doctest::Contains("runs overlap at [0, 4) and [3, 5) of param"),
                       Error);
  CHECK_THROWS_WITH_AS(bad({{0, 4, 0, 0.0f}, {4, 2, 2, 0.0f}}), doctest::Contains("of m"), Error);
}

TEST_CASE("vectorised exp and sigmoid are within a few ulp of libm") {
  double worst_exp = 0, worst_sigmoid = 0;
  for (double x = -87.0; x <= 88.0; x += 0.00123) {
    const float xf = float(x);
    const double want = std::exp(double(xf));
    worst_exp = std::max(worst_exp, std::abs(double(cpu::vexp(xf)) - want) / want);
  }
  for (double x = -80.0; x <= 80.0; x += 0.000537) {
    const float xf = float(x);
    const double want = 1.0 / (1.0 + std::exp(-double(xf)));
    worst_sigmoid = std::max(worst_sigmoid, std::abs(double(cpu::vsigmoid(xf)) - want) / want);
  }
  CAPTURE(worst_exp);
  CAPTURE(worst_sigmoid);
  CHECK(worst_exp < 2.5e-7);    // about 2 ulp
  CHECK(worst_sigmoid < 4e-7);  // relative, also deep in the tail
  CHECK(cpu::vexp(0.0f) == 1.0f);
  CHECK(cpu::vexp(-1000.0f) == 0.0f);  // underflow and overflow as in libm
  CHECK(cpu::vexp(-95.0f) > 0.0f);     // gradual underflow (subnormal)
  CHECK(std::abs(cpu::vexp(88.5f) / std::exp(88.5) - 1.0) < 2.5e-7);
  CHECK(cpu::vexp(1000.0f) == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(cpu::vexp(std::numeric_limits<float>::quiet_NaN())));
  // sqrt_inplace is the correctly rounded sqrt, bitwise, on every path (vector body and tail).
  std::vector<float> q = random_normal(37, 9, 0, 100.0f);
  for (float& x : q) x = std::abs(x);
  q[3] = 0.0f;
  auto qs = q;
  cpu::sqrt_inplace(qs.data(), int64_t(qs.size()));
  bool exact = true;
  for (size_t i = 0; i < q.size(); ++i) exact &= qs[i] == std::sqrt(q[i]);
  CHECK(exact);
  CHECK(cpu::vsigmoid(100.0f) == 1.0f);
  CHECK(cpu::vsigmoid(-100.0f) == 0.0f);
  CHECK(std::abs(cpu::vsigmoid(-80.0f) / std::exp(-80.0) - 1.0) < 4e-7);
}
