// Tests of the CPU backend's fused ops (linear + GELU, its backward, linear + residual, the residual norms). On the
// reference backend they are the separate ops in turn, bit for bit (so the model gives the same
// numbers through either), and they are checked against double formulas written out here.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const double kS = std::sqrt(2.0 / M_PI), kCubic = 0.044715;

double gelu_ref(double x) { return x / (1.0 + std::exp(-2.0 * kS * (x + kCubic * x * x * x))); }
double gelu_grad_ref(double x) {
  const double t = std::tanh(kS * (x + kCubic * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kS * (1.0 + 3.0 * kCubic * x * x);
}
}  // namespace

TEST_CASE("cpu linear_gelu_forward is linear_forward then gelu_forward, and GELU(x W^T + b) in double") {
  auto ops = make_cpu_ops();
  const int64_t N = 13, IC = 11, OC = 17;
  auto x = random_normal(size_t(N * IC), 7, 0), w = random_normal(size_t(OC * IC), 7, 1, 0.3f);
  auto b = random_normal(size_t(OC), 7, 2);
  std::vector<float> out(size_t(N * OC), kNaN), pre(out.size(), kNaN);
  ops->linear_gelu_forward(as_tensor(out, {N, OC}), as_tensor(pre, {N, OC}), as_tensor(x, {N, IC}),
                           as_tensor(w, {OC, IC}), as_tensor(b, {OC}));
  std::vector<float> pre2(out.size(), kNaN), out2(out.size(), kNaN);
  ops->linear_forward(as_tensor(pre2, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), as_tensor(b, {OC}));
  ops->gelu_forward(as_tensor(out2, {N, OC}), as_tensor(pre2, {N, OC}));
  CHECK(pre == pre2);
  CHECK(out == out2);
  std::vector<double> pre_d(out.size()), out_d(out.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = b[size_t(o)];
      for (int64_t i = 0; i < IC; ++i) s += double(x[size_t(n * IC + i)]) * w[size_t(o * IC + i)];
      pre_d[size_t(n * OC + o)] = s;
      out_d[size_t(n * OC + o)] = gelu_ref(s);
    }
  auto r = allclose(pre, pre_d, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "pre: ", r.str());
  r = allclose(out, out_d, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "out: ", r.str());
}

TEST_CASE("cpu linear_residual_forward is linear_forward then add, and x W^T + b + r in double") {
  auto ops = make_cpu_ops();
  const int64_t N = 10, IC = 9, OC = 14;
  auto x = random_normal(size_t(N * IC), 9, 0), w = random_normal(size_t(OC * IC), 9, 1, 0.3f);
  auto b = random_normal(size_t(OC), 9, 2), r = random_normal(size_t(N * OC), 9, 3);
  for (bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    const Tensor bias = with_bias ? as_tensor(b, {OC}) : Tensor();
    std::vector<float> out(size_t(N * OC), kNaN), out2(out.size(), kNaN);
    ops->linear_residual_forward(as_tensor(out, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), bias,
                                 as_tensor(r, {N, OC}));
    ops->linear_forward(as_tensor(out2, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), bias);
    ops->add(as_tensor(out2, {N, OC}), as_tensor(out2, {N, OC}), as_tensor(r, {N, OC}));
    CHECK(out == out2);
    std::vector<double> want(out.size());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < OC; ++o) {
        double s = (with_bias ? b[size_t(o)] : 0.0) + r[size_t(n * OC + o)];
        for (int64_t i = 0; i < IC; ++i) s += double(x[size_t(n * IC + i)]) * w[size_t(o * IC + i)];
        want[size_t(n * OC + o)] = s;
      }
    const auto res = allclose(out, want, 1e-5, 1e-5);
    CHECK_MESSAGE(res.ok, "out: ", res.str());
  }
  std::vector<float> o(size_t(N * OC));
  CHECK_THROWS_WITH_AS(ops->linear_residual_forward(as_tensor(o, {N, OC}), as_tensor(x, {N, IC}),
                                                    as_tensor(w, {OC, IC}), Tensor(), as_tensor(o, {N, OC})),
                       doctest::Contains("not be out"), Error);
}

TEST_CASE("cpu linear_backward_gelu is linear_backward then gelu_backward in place, and matches double formulas") {
  auto ops = make_cpu_ops();
  const int64_t N = 9, IC = 12, OC = 7;
  auto pre = random_normal(size_t(N * IC), 8, 0, 2.0f), act = random_normal(pre.size(), 8, 1);
  auto w = random_normal(size_t(OC * IC), 8, 2), g = random_normal(size_t(N * OC), 8, 3);
  auto dw0 = random_normal(w.size(), 8, 4), db0 = random_normal(size_t(OC), 8, 5);
  std::vector<float> dpre(pre.size(), kNaN), dw = dw0, db = db0;
  ops->linear_backward_gelu(as_tensor(dpre, {N, IC}), as_tensor(dw, {OC, IC}), as_tensor(db, {OC}),
                            as_tensor(g, {N, OC}), as_tensor(act, {N, IC}), as_tensor(w, {OC, IC}),
                            as_tensor(pre, {N, IC}));
  std::vector<float> dact(pre.size(), kNaN), dpre2(pre.size(), kNaN), dw2 = dw0, db2 = db0;
  ops->linear_backward(as_tensor(dact, {N, IC}), as_tensor(dw2, {OC, IC}), as_tensor(db2, {OC}), as_tensor(g, {N, OC}),
                       as_tensor(act, {N, IC}), as_tensor(w, {OC, IC}));
  ops->gelu_backward(as_tensor(dpre2, {N, IC}), as_tensor(dact, {N, IC}), as_tensor(pre, {N, IC}));
  CHECK(dpre == dpre2);
  CHECK(dw == dw2);
  CHECK(db == db2);
  std::vector<double> dpre_d(pre.size()), dw_d(w.size()), db_d(db0.begin(), db0.end());
  for (size_t i = 0; i < w.size(); ++i) dw_d[i] = dw0[i];
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < IC; ++i) {
      double s = 0.0;
      for (int64_t o = 0; o < OC; ++o) s += double(g[size_t(n * OC + o)]) * w[size_t(o * IC + i)];
      dpre_d[size_t(n * IC + i)] = s * gelu_grad_ref(pre[size_t(n * IC + i)]);
    }
    for (int64_t o = 0; o < OC; ++o) {
      db_d[size_t(o)] += g[size_t(n * OC + o)];
      for (int64_t i = 0; i < IC; ++i) dw_d[size_t(o * IC + i)] += double(g[size_t(n * OC + o)]) * act[size_t(n * IC + i)];
    }
  }
  auto r = allclose(dpre, dpre_d, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "dpre: ", r.str());
  r = allclose(dw, dw_d, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "dweight: ", r.str());
  r = allclose(db, db_d, 1e-5, 1e-5);
  CHECK_MESSAGE(r.ok, "dbias: ", r.str());
  CHECK_THROWS_WITH_AS(ops->linear_backward_gelu(Tensor(), as_tensor(dw, {OC, IC}), Tensor(), as_tensor(g, {N, OC}),
                                                 as_tensor(act, {N, IC}), as_tensor(w, {OC, IC}),
                                                 as_tensor(pre, {N, IC})),
                       doctest::Contains("dpre is required"), Error);
}

TEST_CASE("cpu residual norms are add then the norm, with sum aliasing a or b") {
  auto ops = make_cpu_ops();
  const int64_t N = 6, C = 10;
  const float eps = 1e-5f;
  auto a = random_normal(size_t(N * C), 9, 0, 2.0f, 3.0f), b = random_normal(a.size(), 9, 1);
  auto w = random_normal(size_t(C), 9, 2, 0.5f, 1.0f), bias = random_normal(size_t(C), 9, 3);
  for (bool layer : {true, false}) {
    std::vector<float> sum_r(a.size()), out_r(a.size()), mean_r(static_cast<size_t>(N)), rstd_r(static_cast<size_t>(N));
    ops->add(as_tensor(sum_r, {N, C}), as_tensor(a, {N, C}), as_tensor(b, {N, C}));
    if (layer)
      ops->layernorm_forward(as_tensor(out_r, {N, C}), as_tensor(mean_r, {N}), as_tensor(rstd_r, {N}),
                             as_tensor(sum_r, {N, C}), as_tensor(w, {C}), as_tensor(bias, {C}), eps);
    else
      ops->rmsnorm_forward(as_tensor(out_r, {N, C}), as_tensor(rstd_r, {N}), as_tensor(sum_r, {N, C}),
                           as_tensor(w, {C}), eps);
    for (int alias = 0; alias < 3; ++alias) {  // sum separate, sum == a, sum == b
      CAPTURE(layer);
      CAPTURE(alias);
      auto a2 = a, b2 = b;
      std::vector<float> sum(a.size(), kNaN), out(a.size(), kNaN), mean(size_t(N), kNaN), rstd(size_t(N), kNaN);
      std::vector<float>& s = alias == 0 ? sum : alias == 1 ? a2 : b2;
      if (layer)
        ops->residual_layernorm_forward(as_tensor(s, {N, C}), as_tensor(out, {N, C}), as_tensor(mean, {N}),
                                        as_tensor(rstd, {N}), as_tensor(a2, {N, C}), as_tensor(b2, {N, C}),
                                        as_tensor(w, {C}), as_tensor(bias, {C}), eps);
      else
        ops->residual_rmsnorm_forward(as_tensor(s, {N, C}), as_tensor(out, {N, C}), as_tensor(rstd, {N}),
                                      as_tensor(a2, {N, C}), as_tensor(b2, {N, C}), as_tensor(w, {C}), eps);
      CHECK(s == sum_r);
      CHECK(out == out_r);
      CHECK(rstd == rstd_r);
      if (layer) CHECK(mean == mean_r);
    }
  }
}
