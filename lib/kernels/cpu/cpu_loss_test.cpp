// Tests of the CPU backend's fused softmax cross-entropy (ignored rows, padded columns, in place).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// -log softmax(row[0:V])[target] in double (0 for ignored rows).
std::vector<double> ce_reference(const std::vector<float>& logits, const std::vector<int32_t>& targets, int64_t V,
                                 int64_t Vp) {
  std::vector<double> loss(targets.size(), 0.0);
  for (size_t n = 0; n < targets.size(); ++n) {
    if (targets[n] < 0) continue;
    double mx = -1e300, s = 0;
    for (int64_t c = 0; c < V; ++c) mx = std::max(mx, double(logits[n * size_t(Vp) + size_t(c)]));
    for (int64_t c = 0; c < V; ++c) s += std::exp(double(logits[n * size_t(Vp) + size_t(c)]) - mx);
    loss[n] = std::log(s) + mx - double(logits[n * size_t(Vp) + size_t(targets[n])]);
  }
  return loss;
}
}  // namespace

TEST_CASE("cpu crossentropy: losses, gradient, ignored rows and padded columns") {
  auto ops = make_cpu_ops();
  const int64_t B = 2, T = 3, N = B * T, V = 11, Vp = 16;
  std::vector<int32_t> targets = {3, -1, 10, 0, -100, 7};  // rows 1 and 4 ignored
  auto logits = random_normal(size_t(N * Vp), 151, 0, 2.0f);
  for (int64_t n = 0; n < N; ++n)  // padded columns hold junk that must not enter the softmax
    for (int64_t c = V; c < Vp; ++c) logits[size_t(n * Vp + c)] = 50.0f;
  const float dloss = 1.0f / 4;  // mean over the 4 kept rows
  std::vector<float> losses(size_t(N), kNaN), dlogits(logits.size(), kNaN);
  ops->crossentropy_forward_backward(as_tensor(losses, {B, T}), as_tensor(dlogits, {B, T, Vp}),
                                     as_tensor(logits, {B, T, Vp}), as_tensor(targets, {B, T}), V, dloss);
  const auto want = ce_reference(logits, targets, V, Vp);
  // O(1) losses from fp32 logits: the log-sum-exp is accumulated in double, 1e-6 is ~10 ulp.
  auto r = allclose(losses, want, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
  CHECK(losses[1] == 0.0f);
  CHECK(losses[4] == 0.0f);

  // Gradient: exactly zero on ignored rows and padded columns; elsewhere the finite difference of
  // dloss * sum(losses). The loss moves only through one row's softmax (11 terms), so eps = 1e-2
  // gives rounding noise ~1e-7 / 2e-2 and truncation ~eps^2/6 * |f'''| (<= 1e-5 here).
  size_t nonzero_padding = 0, nonzero_ignored = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < Vp; ++c) {
      const float d = dlogits[size_t(n * Vp + c)];
      if (c >= V) nonzero_padding += d != 0.0f;
      if (targets[size_t(n)] < 0) nonzero_ignored += d != 0.0f;
    }
  CHECK(nonzero_padding == 0);
  CHECK(nonzero_ignored == 0);
  auto loss = [&] {
    std::vector<float> l(static_cast<size_t>(N));
    ops->crossentropy_forward_backward(as_tensor(l, {N}), Tensor(), as_tensor(logits, {N, Vp}), as_tensor(targets, {N}),
                                       V, dloss);
    double s = 0;
    for (float x : l) s += x;
    return s * dloss;
  };
  const auto num = numerical_gradient(loss, logits, 1e-2);
  r = allclose(dlogits, num, 1e-5, 1e-3);
  CHECK_MESSAGE(r.ok, r.str());

  // In place: dlogits aliasing logits gives the same bits.
  auto inplace = logits;
  std::vector<float> losses2(static_cast<size_t>(N));
  ops->crossentropy_forward_backward(as_tensor(losses2, {N}), as_tensor(inplace, {N, Vp}), as_tensor(inplace, {N, Vp}),
                                     as_tensor(targets, {N}), V, dloss);
  CHECK(inplace == dlogits);
  CHECK(losses2 == losses);

  auto bad = targets;
  bad[2] = int32_t(V);  // a padded column is not a valid target
  CHECK_THROWS_WITH_AS(ops->crossentropy_forward_backward(as_tensor(losses, {N}), Tensor(), as_tensor(logits, {N, Vp}),
                                                          as_tensor(bad, {N}), V, 1.0f),
                       doctest::Contains("targets[2] = 11"), Error);
}

TEST_CASE("cpu crossentropy: large logits stay finite; a GPT-2-sized vocabulary row matches") {
  auto ops = make_cpu_ops();
  const int64_t N = 4, V = 50257, Vp = 50304;
  auto logits = random_normal(size_t(N * Vp), 161, 0, 3.0f);
  logits[7] = 1000.0f;  // row 0: one huge logit (overflows exp without the max subtraction)
  std::vector<int32_t> targets = {7, 50256, 123, 0};
  std::vector<float> losses(static_cast<size_t>(N)), dlogits(logits.size(), kNaN);
  ops->crossentropy_forward_backward(as_tensor(losses, {N}), as_tensor(dlogits, {N, Vp}), as_tensor(logits, {N, Vp}),
                                     as_tensor(targets, {N}), V, 1.0f);
  const auto want = ce_reference(logits, targets, V, Vp);
  // log of a 50257-term sum: the double accumulator keeps it to a few fp32 ulp of the loss (~10).
  auto r = allclose(losses, want, 1e-5, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
  CHECK(losses[0] == 0.0f);  // the target holds all the mass
  // Each kept row's gradient sums to 0 (softmax sums to 1, minus the one-hot).
  for (int64_t n = 0; n < N; ++n) {
    double s = 0, s_abs = 0;
    for (int64_t c = 0; c < Vp; ++c) s += dlogits[size_t(n * Vp + c)], s_abs += std::abs(dlogits[size_t(n * Vp + c)]);
    CAPTURE(n);
    CHECK(std::abs(s) < 1e-6);
    CHECK(s_abs <= 2.0 + 1e-6);
  }
}
