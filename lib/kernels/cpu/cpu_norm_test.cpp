// Tests of the CPU backend's LayerNorm and RMSNorm against double references and finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// (a - b) / k element-wise in double: the gradient an accumulating op added k times.
std::vector<double> added(const std::vector<float>& a, const std::vector<float>& b, double k = 1.0) {
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = (double(a[i]) - double(b[i])) / k;
  return d;
}

// Tolerance of the norm gradient checks. Inputs have std 2 (rstd ~0.5), so a step of 1e-2 leaves a
// truncation error ~eps^2 |f'''| / 6 < 1e-5, and the fp32 rounding of the C outputs one element
// moves (~1e-7 relative each, loss ~ sqrt(C)) divided by 2 eps is ~1e-5 as well; 2e-4 abs + 1e-3 rel
// is ~10x the larger. A wrong term in the backward (e.g. a missing mean) is off by O(0.1-1).
constexpr double kEps = 1e-2, kAtol = 2e-4, kRtol = 1e-3;

}  // namespace

TEST_CASE("cpu layernorm forward matches double loops; backward matches finite differences") {
  auto ops = make_cpu_ops();
  const int64_t B = 2, T = 3, N = B * T, C = 13;
  const float eps = 1e-5f;
  auto x = random_normal(size_t(N * C), 71, 0, 2.0f, 3.0f);  // mean 3: the centring matters
  auto w = random_normal(size_t(C), 71, 1, 0.5f, 1.0f), b = random_normal(size_t(C), 71, 2);
  auto wout = random_normal(size_t(N * C), 71, 3);
  std::vector<float> out(static_cast<size_t>(N * C)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  auto forward = [&] {
    ops->layernorm_forward(as_tensor(out, {B, T, C}), as_tensor(mean, {B, T}), as_tensor(rstd, {B, T}),
                           as_tensor(x, {B, T, C}), as_tensor(w, {C}), as_tensor(b, {C}), eps);
  };
  forward();
  std::vector<double> want(out.size()), want_mean(static_cast<size_t>(N)), want_rstd(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[size_t(n * C + c)];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[size_t(n * C + c)] - m) * (x[size_t(n * C + c)] - m);
    const double rs = 1.0 / std::sqrt(v / C + eps);
    want_mean[size_t(n)] = m;
    want_rstd[size_t(n)] = rs;
    for (int64_t c = 0; c < C; ++c)
      want[size_t(n * C + c)] = (x[size_t(n * C + c)] - m) * rs * w[size_t(c)] + b[size_t(c)];
  }
  // A handful of fp32 operations per element on O(1) values.
  auto r = allclose(out, want, 2e-6, 2e-6);
  CHECK_MESSAGE(r.ok, "out: ", r.str());
  r = allclose(mean, want_mean, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, "mean: ", r.str());
  r = allclose(rstd, want_rstd, 1e-7, 1e-6);
  CHECK_MESSAGE(r.ok, "rstd: ", r.str());

  auto loss = [&] {
    forward();
    return dot(out, wout);
  };
  const auto nx = numerical_gradient(loss, x, kEps), nw = numerical_gradient(loss, w, kEps),
             nb = numerical_gradient(loss, b, kEps);
  forward();  // restore the saved statistics of the unperturbed inputs
  // All three gradients accumulate (dinp into the residual stream's gradient).
  const auto dx0 = random_normal(x.size(), 72, 0), dw0 = random_normal(w.size(), 72, 1),
             db0 = random_normal(b.size(), 72, 2);
  auto dx = dx0, dw = dw0, db = db0;
  auto backward = [&] {
    ops->layernorm_backward(as_tensor(dx, {N, C}), as_tensor(dw, {C}), as_tensor(db, {C}), as_tensor(wout, {N, C}),
                            as_tensor(x, {N, C}), as_tensor(mean, {N}), as_tensor(rstd, {N}), as_tensor(w, {C}));
  };
  for (int times = 1; times <= 2; ++times) {
    CAPTURE(times);
    backward();
    r = allclose(added(dx, dx0, times), nx, kAtol, kRtol);
    CHECK_MESSAGE(r.ok, "dinp: ", r.str());
    r = allclose(added(dw, dw0, times), nw, kAtol, kRtol);
    CHECK_MESSAGE(r.ok, "dweight: ", r.str());
    r = allclose(added(db, db0, times), nb, kAtol, kRtol);
    CHECK_MESSAGE(r.ok, "dbias: ", r.str());
  }
  // Deterministic: the same start gives the same bits.
  const auto dx2 = dx, dw2 = dw;
  dx = dx0, dw = dw0, db = db0;
  backward();
  backward();
  CHECK(dx == dx2);
  CHECK(dw == dw2);

  std::vector<float> w_bad(static_cast<size_t>(C + 1));
  CHECK_THROWS_WITH_AS(ops->layernorm_forward(as_tensor(out, {N, C}), as_tensor(mean, {N}), as_tensor(rstd, {N}),
                                              as_tensor(x, {N, C}), as_tensor(w_bad, {C + 1}), as_tensor(b, {C}), eps),
                       doctest::Contains("layernorm_forward"), Error);
}

TEST_CASE("cpu rmsnorm forward matches double loops; backward matches finite differences") {
  auto ops = make_cpu_ops();
  const int64_t N = 5, C = 11;
  const float eps = 1e-6f;
  auto x = random_normal(size_t(N * C), 81, 0, 2.0f, 0.5f);
  auto w = random_normal(size_t(C), 81, 1, 0.5f, 1.0f), wout = random_normal(size_t(N * C), 81, 2);
  std::vector<float> out(static_cast<size_t>(N * C)), rstd(static_cast<size_t>(N));
  auto forward = [&] {
    ops->rmsnorm_forward(as_tensor(out, {N, C}), as_tensor(rstd, {N}), as_tensor(x, {N, C}), as_tensor(w, {C}), eps);
  };
  forward();
  std::vector<double> want(out.size()), want_rstd(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += double(x[size_t(n * C + c)]) * x[size_t(n * C + c)];
    const double rs = 1.0 / std::sqrt(s / C + eps);
    want_rstd[size_t(n)] = rs;
    for (int64_t c = 0; c < C; ++c) want[size_t(n * C + c)] = x[size_t(n * C + c)] * rs * w[size_t(c)];
  }
  auto r = allclose(out, want, 2e-6, 2e-6);
  CHECK_MESSAGE(r.ok, "out: ", r.str());
  r = allclose(rstd, want_rstd, 1e-7, 1e-6);
  CHECK_MESSAGE(r.ok, "rstd: ", r.str());

  auto loss = [&] {
    forward();
    return dot(out, wout);
  };
  const auto nx = numerical_gradient(loss, x, kEps), nw = numerical_gradient(loss, w, kEps);
  forward();
  const auto dx0 = random_normal(x.size(), 82, 0), dw0 = random_normal(w.size(), 82, 1);
  auto dx = dx0, dw = dw0;
  for (int times = 1; times <= 2; ++times) {
    CAPTURE(times);
    ops->rmsnorm_backward(as_tensor(dx, {N, C}), as_tensor(dw, {C}), as_tensor(wout, {N, C}), as_tensor(x, {N, C}),
                          as_tensor(rstd, {N}), as_tensor(w, {C}));
    r = allclose(added(dx, dx0, times), nx, kAtol, kRtol);
    CHECK_MESSAGE(r.ok, "dinp: ", r.str());
    r = allclose(added(dw, dw0, times), nw, kAtol, kRtol);
    CHECK_MESSAGE(r.ok, "dweight: ", r.str());
  }
}

TEST_CASE("cpu norms on a threaded size: weight gradients bitwise reproducible") {
  auto ops = make_cpu_ops();
  const int64_t N = 256, C = 300;
  auto x = random_normal(size_t(N * C), 91, 0), w = random_normal(size_t(C), 91, 1),
       g = random_normal(size_t(N * C), 91, 2);
  std::vector<float> out(x.size()), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  ops->layernorm_forward(as_tensor(out, {N, C}), as_tensor(mean, {N}), as_tensor(rstd, {N}), as_tensor(x, {N, C}),
                         as_tensor(w, {C}), Tensor(), 1e-5f);
  std::vector<float> dx[2], dw[2], db[2];
  for (int k = 0; k < 2; ++k) {
    dx[k].assign(x.size(), 0.0f);
    dw[k].assign(size_t(C), 0.0f);
    db[k].assign(size_t(C), 0.0f);
    ops->layernorm_backward(as_tensor(dx[k], {N, C}), as_tensor(dw[k], {C}), as_tensor(db[k], {C}),
                            as_tensor(g, {N, C}), as_tensor(x, {N, C}), as_tensor(mean, {N}), as_tensor(rstd, {N}),
                            as_tensor(w, {C}));
  }
  CHECK(dx[0] == dx[1]);
  CHECK(dw[0] == dw[1]);
  CHECK(db[0] == db[1]);
}
