// Tests of the CPU backend's GELU and SwiGLU against double formulas and finite differences.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const double kS = std::sqrt(2.0 / M_PI);

// GPT-2's definition, and the same function written so that double keeps its tail (1 + tanh(a)
// cancels to 0 for a < -19 even in double): 0.5 (1 + tanh(a)) = 1 / (1 + e^{-2a}).
double gelu_tanh_form(double x) { return 0.5 * x * (1.0 + std::tanh(kS * (x + 0.044715 * x * x * x))); }
double gelu_ref(double x) { return x / (1.0 + std::exp(-2.0 * kS * (x + 0.044715 * x * x * x))); }
double silu_ref(double x) { return x / (1.0 + std::exp(-x)); }
}  // namespace

TEST_CASE("cpu gelu (tanh approximation): forward, backward against the derivative and finite differences") {
  auto ops = make_cpu_ops();
  const int64_t n = 1001;
  auto x = random_normal(size_t(n), 101, 0, 3.0f);
  x[0] = 0.0f, x[1] = 12.0f, x[2] = -12.0f, x[3] = 1e-4f, x[4] = -30.0f;
  auto wout = random_normal(size_t(n), 101, 1);
  std::vector<float> out(static_cast<size_t>(n));
  ops->gelu_forward(as_tensor(out, {n}), as_tensor(x, {n}));
  std::vector<double> want(out.size()), want_tanh(out.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = gelu_ref(x[i]), want_tanh[i] = gelu_tanh_form(x[i]);
  CHECK(max_abs_diff(want, want_tanh) < 1e-14);  // the two references are one function
  // Relative precision down to the far negative tail, where gelu(x) ~ x e^{2a}: the fp32 argument
  // 2a carries a few ulp of relative error, i.e. |2a| * 2.4e-7 absolute, which e^{2a} turns into
  // that much relative error. Bound per element: 1e-6 (1 + |2a|) relative, and 1e-37 absolute for
  // values below the normal float range (flushed to 0).
  size_t bad = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double two_a = 2.0 * kS * (x[i] + 0.044715 * double(x[i]) * x[i] * x[i]);
    bad += !(std::abs(out[i] - want[i]) <= 1e-6 * (1.0 + std::abs(two_a)) * std::abs(want[i]) + 1e-37);
  }
  CHECK(bad == 0);
  auto r = allclose(out, want, 1e-6, 1e-6);  // and the usual absolute view
  CHECK_MESSAGE(r.ok, r.str());

  // Element-wise: each input moves one output. With eps = 1e-2 the fp32 rounding of an output of
  // size |x| <= 12 (~1e-6) divided by 2 eps is <= 5e-5, and the truncation eps^2 |f'''| / 6 < 3e-5.
  auto loss = [&] {
    ops->gelu_forward(as_tensor(out, {n}), as_tensor(x, {n}));
    return dot(out, wout);
  };
  const auto nx = numerical_gradient(loss, x, 1e-2);
  std::vector<float> dx(static_cast<size_t>(n), kNaN);  // overwritten
  ops->gelu_backward(as_tensor(dx, {n}), as_tensor(wout, {n}), as_tensor(x, {n}));
  r = allclose(dx, nx, 2e-4, 1e-3);
  CHECK_MESSAGE(r.ok, "vs finite differences: ", r.str());
  std::vector<double> exact(static_cast<size_t>(n));
  for (size_t i = 0; i < x.size(); ++i) {  // analytic derivative in double, central difference h = 1e-6
    const double h = 1e-6;
    exact[i] = (gelu_ref(x[i] + h) - gelu_ref(x[i] - h)) / (2 * h) * wout[i];
  }
  r = allclose(dx, exact, 1e-9, 2e-5);  // relative, down to the tail (the h = 1e-6 quotient: ~1e-9 abs)
  CHECK_MESSAGE(r.ok, "vs double derivative: ", r.str());
  // dinp may alias dout.
  auto inplace = wout;
  ops->gelu_backward(as_tensor(inplace, {n}), as_tensor(inplace, {n}), as_tensor(x, {n}));
  CHECK(inplace == dx);
}

TEST_CASE("cpu swiglu: forward, backward against finite differences") {
  auto ops = make_cpu_ops();
  const int64_t N = 4, F = 9;
  auto x = random_normal(size_t(N * 2 * F), 111, 0, 2.0f), wout = random_normal(size_t(N * F), 111, 1);
  std::vector<float> out(static_cast<size_t>(N * F));
  ops->swiglu_forward(as_tensor(out, {N, F}), as_tensor(x, {N, 2 * F}));
  std::vector<double> want(out.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f)
      want[size_t(n * F + f)] = silu_ref(x[size_t(n * 2 * F + f)]) * x[size_t(n * 2 * F + F + f)];
  auto r = allclose(out, want, 1e-6, 2e-6);
  CHECK_MESSAGE(r.ok, r.str());

  auto loss = [&] {
    ops->swiglu_forward(as_tensor(out, {N, F}), as_tensor(x, {N, 2 * F}));
    return dot(out, wout);
  };
  // Each input moves one output (smooth, |f'''| = O(1)): the same reasoning as GELU.
  const auto nx = numerical_gradient(loss, x, 1e-2);
  std::vector<float> dx(x.size(), kNaN);
  ops->swiglu_backward(as_tensor(dx, {N, 2 * F}), as_tensor(wout, {N, F}), as_tensor(x, {N, 2 * F}));
  r = allclose(dx, nx, 2e-4, 1e-3);
  CHECK_MESSAGE(r.ok, r.str());

  std::vector<float> bad(static_cast<size_t>(N * F));
  CHECK_THROWS_WITH_AS(ops->swiglu_forward(as_tensor(out, {N, F}), as_tensor(bad, {N, F})),
                       doctest::Contains("swiglu_forward"), Error);
}
