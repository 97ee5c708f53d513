// Tests of the CPU backend's gemm and linear layer against naive double loops and finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// c (M,N) = alpha op(a) op(b) + beta c in double.
std::vector<double> gemm_reference(const std::vector<float>& c, const std::vector<float>& a,
                                   const std::vector<float>& b, int64_t M, int64_t N, int64_t K, bool ta, bool tb,
                                   double alpha, double beta) {
  std::vector<double> out(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double x = ta ? a[size_t(k * M + i)] : a[size_t(i * K + k)];
        const double y = tb ? b[size_t(j * K + k)] : b[size_t(k * N + j)];
        s += x * y;
      }
      out[size_t(i * N + j)] = alpha * s + (beta == 0 ? 0.0 : beta * c[size_t(i * N + j)]);
    }
  return out;
}
}  // namespace

TEST_CASE("cpu gemm: every transpose combination, alpha/beta, and beta = 0 overwrites NaN") {
  auto ops = make_cpu_ops();
  struct Dims {
    int64_t M, N, K;
  };
  for (Dims d : {Dims{5, 7, 3}, Dims{33, 65, 129}, Dims{1, 1, 1}}) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      CAPTURE(d.M);
      CAPTURE(d.N);
      CAPTURE(d.K);
      CAPTURE(ta);
      CAPTURE(tb);
      auto a = random_normal(size_t(d.M * d.K), 11, uint64_t(t));
      auto b = random_normal(size_t(d.K * d.N), 12, uint64_t(t));
      auto c = random_normal(size_t(d.M * d.N), 13, uint64_t(t));
      Shape sa = ta ? Shape{d.K, d.M} : Shape{d.M, d.K}, sb = tb ? Shape{d.N, d.K} : Shape{d.K, d.N};
      auto want = gemm_reference(c, a, b, d.M, d.N, d.K, ta, tb, 0.7, 0.3);
      ops->gemm(as_tensor(c, {d.M, d.N}), as_tensor(a, sa), as_tensor(b, sb), ta, tb, 0.7f, 0.3f);
      // fp32 dot products of K unit normals: error ~ sqrt(K) ulp of the partial sums; 1e-5 abs is
      // ~10x that for K = 129, while any indexing mistake gives O(1) errors.
      auto r = allclose(c, want, 1e-5, 1e-5);
      CHECK_MESSAGE(r.ok, r.str());
      std::fill(c.begin(), c.end(), kNaN);
      want = gemm_reference(c, a, b, d.M, d.N, d.K, ta, tb, 1.0, 0.0);
      ops->gemm(as_tensor(c, {d.M, d.N}), as_tensor(a, sa), as_tensor(b, sb), ta, tb, 1.0f, 0.0f);
      r = allclose(c, want, 1e-5, 1e-5);
      CHECK_MESSAGE(r.ok, r.str());
    }
  }
  std::vector<float> a(6), b(6), c(4);
  CHECK_THROWS_WITH_AS(ops->gemm(as_tensor(c, {2, 2}), as_tensor(a, {2, 3}), as_tensor(b, {2, 3}), false, false, 1, 0),
                       doctest::Contains("gemm"), Error);
}

TEST_CASE("cpu linear forward matches the naive product, with and without bias") {
  auto ops = make_cpu_ops();
  const int64_t B = 3, T = 5, IC = 7, OC = 9, N = B * T;
  auto x = random_normal(size_t(N * IC), 21, 0), w = random_normal(size_t(OC * IC), 21, 1, 0.5f);
  auto bias = random_normal(size_t(OC), 21, 2);
  for (bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    std::vector<float> out(static_cast<size_t>(N * OC), kNaN);
    ops->linear_forward(as_tensor(out, {B, T, OC}), as_tensor(x, {B, T, IC}), as_tensor(w, {OC, IC}),
                        with_bias ? as_tensor(bias, {OC}) : Tensor());
    std::vector<double> want(out.size());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = with_bias ? bias[size_t(o)] : 0.0;
        for (int64_t i = 0; i < IC; ++i) s += double(x[size_t(n * IC + i)]) * w[size_t(o * IC + i)];
        want[size_t(n * OC + o)] = s;
      }
    auto r = allclose(out, want, 2e-6, 2e-6);  // K = 7 products of O(1) values: a few ulp
    CHECK_MESSAGE(r.ok, r.str());
  }
  std::vector<float> out(static_cast<size_t>(N * OC));
  CHECK_THROWS_WITH_AS(
      ops->linear_forward(as_tensor(out, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {IC, OC}), Tensor()),
      doctest::Contains("linear_forward"), Error);
}

TEST_CASE("cpu linear backward: finite differences, accumulate vs overwrite, determinism") {
  auto ops = make_cpu_ops();
  const int64_t N = 6, IC = 5, OC = 7;
  auto x = random_normal(size_t(N * IC), 31, 0), w = random_normal(size_t(OC * IC), 31, 1);
  auto bias = random_normal(size_t(OC), 31, 2), wout = random_normal(size_t(N * OC), 31, 3);
  std::vector<float> out(static_cast<size_t>(N * OC));
  auto loss = [&] {
    ops->linear_forward(as_tensor(out, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), as_tensor(bias, {OC}));
    return dot(out, wout);
  };
  // The loss is linear in each of x, w, bias, so the central difference has no truncation error and
  // a large step (0.5) shrinks the fp32 rounding noise of the loss to ~1e-6 of the gradient: 1e-5
  // is ~5x the observed error.
  const auto nx = numerical_gradient(loss, x, 0.5), nw = numerical_gradient(loss, w, 0.5),
             nb = numerical_gradient(loss, bias, 0.5);

  // dweight and dbias accumulate onto what they hold; dinp is overwritten (NaN must vanish).
  std::vector<float> dx(x.size(), kNaN), dw0 = random_normal(w.size(), 32, 0), db0 = random_normal(bias.size(), 32, 1);
  std::vector<float> dw = dw0, db = db0;
  auto backward = [&] {
    ops->linear_backward(as_tensor(dx, {N, IC}), as_tensor(dw, {OC, IC}), as_tensor(db, {OC}), as_tensor(wout, {N, OC}),
                         as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}));
  };
  backward();
  auto minus = [](const std::vector<float>& a, const std::vector<float>& b, double k) {
    std::vector<double> d(a.size());
    for (size_t i = 0; i < a.size(); ++i) d[i] = (double(a[i]) - b[i]) / k;
    return d;
  };
  auto rx = allclose(dx, nx, 1e-5, 1e-5);
  CHECK_MESSAGE(rx.ok, "dinp: ", rx.str());
  auto rw = allclose(minus(dw, dw0, 1), nw, 1e-5, 1e-5);
  CHECK_MESSAGE(rw.ok, "dweight: ", rw.str());
  auto rb = allclose(minus(db, db0, 1), nb, 1e-5, 1e-5);
  CHECK_MESSAGE(rb.ok, "dbias: ", rb.str());

  const auto dx1 = dx, dw1 = dw, db1 = db;
  backward();  // a second micro-batch: weights accumulate twice the gradient, dinp stays
  CHECK(std::memcmp(dx.data(), dx1.data(), dx.size() * 4) == 0);
  rw = allclose(minus(dw, dw0, 2), nw, 1e-5, 1e-5);
  CHECK_MESSAGE(rw.ok, "dweight twice: ", rw.str());
  rb = allclose(minus(db, db0, 2), nb, 1e-5, 1e-5);
  CHECK_MESSAGE(rb.ok, "dbias twice: ", rb.str());

  // Bitwise reproducible from the same starting state; undefined gradients are skipped.
  dw = dw0;
  db = db0;
  backward();
  CHECK(std::memcmp(dw.data(), dw1.data(), dw.size() * 4) == 0);
  CHECK(std::memcmp(db.data(), db1.data(), db.size() * 4) == 0);
  std::vector<float> dw_only(w.size(), 0.0f);
  ops->linear_backward(Tensor(), as_tensor(dw_only, {OC, IC}), Tensor(), as_tensor(wout, {N, OC}),
                       as_tensor(x, {N, IC}), Tensor());
  auto r = allclose(dw_only, nw, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "dweight only: ", r.str());
}

TEST_CASE("cpu linear backward on a threaded size is bitwise reproducible") {
  auto ops = make_cpu_ops();
  const int64_t N = 256, IC = 96, OC = 200;
  auto x = random_normal(size_t(N * IC), 41, 0), w = random_normal(size_t(OC * IC), 41, 1);
  auto g = random_normal(size_t(N * OC), 41, 2);
  std::vector<float> dx[2], dw[2], db[2];
  for (int k = 0; k < 2; ++k) {
    dx[k].assign(x.size(), 0.0f);
    dw[k].assign(w.size(), 0.0f);
    db[k].assign(size_t(OC), 0.0f);
    ops->linear_backward(as_tensor(dx[k], {N, IC}), as_tensor(dw[k], {OC, IC}), as_tensor(db[k], {OC}),
                         as_tensor(g, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}));
  }
  CHECK(dx[0] == dx[1]);
  CHECK(dw[0] == dw[1]);
  CHECK(db[0] == db[1]);
  std::vector<double> want(static_cast<size_t>(OC), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) want[size_t(o)] += g[size_t(n * OC + o)];
  auto r = allclose(db[0], want, 1e-5, 1e-6);  // double accumulation, one final rounding
  CHECK_MESSAGE(r.ok, r.str());
}
