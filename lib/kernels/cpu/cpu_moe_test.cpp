// Tests of the CPU backend's mixture-of-experts ops: router top-k against a naive sort, router
// backward against finite differences, grouped linear against per-group linear, combine against loops.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Logits whose sorted values per row are >= 0.2 apart (a permutation of 0.2 * [0, E) plus small
// noise): a finite-difference step of 1e-3 never changes the top-k choice.
std::vector<float> spread_logits(int64_t N, int64_t E, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t e = E - 1; e > 0; --e) std::swap(perm[e], perm[bits_at(seed, n, e) % uint64_t(e + 1)]);
    for (int64_t e = 0; e < E; ++e) x[n * E + e] = 0.2f * float(perm[e]) - 0.6f + 0.02f * normal_at(seed, 7, n * E + e);
  }
  return x;
}
}  // namespace

TEST_CASE("cpu moe_router_forward: probs, top-k order, gates and lse against a naive reference") {
  auto ops = make_cpu_ops();
  const int64_t N = 37, E = 8;
  for (int K : {1, 2, 3}) {
    for (bool sigmoid : {false, true}) {
      for (bool normalize : {false, true}) {
        CAPTURE(K);
        CAPTURE(sigmoid);
        CAPTURE(normalize);
        auto x = random_normal(static_cast<size_t>(N * E), 3, uint64_t(K), 1.5f);
        x[5] = x[6];  // a tie: the lower expert index comes first
        std::vector<float> probs(static_cast<size_t>(N * E)), gates(static_cast<size_t>(N * K)),
            lse(static_cast<size_t>(N));
        std::vector<int32_t> topk(static_cast<size_t>(N * K));
        ops->moe_router_forward(as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), as_tensor(gates, {N, K}),
                                as_tensor(lse, {N}), as_tensor(x, {N, E}), sigmoid, normalize);
        std::vector<double> wp(static_cast<size_t>(N * E)), wg(static_cast<size_t>(N * K)), wl(static_cast<size_t>(N));
        std::vector<int32_t> wi(static_cast<size_t>(N * K));
        for (int64_t n = 0; n < N; ++n) {
          double m = -INFINITY, s = 0.0;
          for (int64_t e = 0; e < E; ++e) m = std::max(m, double(x[n * E + e]));
          for (int64_t e = 0; e < E; ++e) s += std::exp(double(x[n * E + e]) - m);
          wl[n] = m + std::log(s);
          for (int64_t e = 0; e < E; ++e)
            wp[n * E + e] = sigmoid ? 1.0 / (1.0 + std::exp(-double(x[n * E + e]))) : std::exp(x[n * E + e] - wl[n]);
          std::vector<int32_t> order(static_cast<size_t>(E));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](int a, int b) { return probs[n * E + a] > probs[n * E + b]; });
          double sum = 0.0;
          for (int k = 0; k < K; ++k) wi[n * K + k] = order[k], sum += wp[n * E + order[k]];
          for (int k = 0; k < K; ++k) wg[n * K + k] = wp[n * E + order[k]] / (normalize ? sum : 1.0);
        }
        CHECK(topk == wi);
        auto r = allclose(probs, wp, 1e-7, 1e-6);
        CHECK_MESSAGE(r.ok, "probs: ", r.str());
        r = allclose(gates, wg, 1e-7, 1e-6);
        CHECK_MESSAGE(r.ok, "gates: ", r.str());
        r = allclose(lse, wl, 1e-6, 1e-6);
        CHECK_MESSAGE(r.ok, "lse: ", r.str());
      }
    }
  }
  // The tie in row 0 (experts 5 and 6 equal): 5 is never ranked after 6.
  std::vector<float> x(static_cast<size_t>(E), 0.0f), probs(static_cast<size_t>(E)), gates(2);
  std::vector<int32_t> topk(2);
  x[5] = x[6] = 3.0f;
  ops->moe_router_forward(as_tensor(probs, {1, E}), as_tensor(topk, {1, 2}), as_tensor(gates, {1, 2}), Tensor(),
                          as_tensor(x, {1, E}), false, false);
  CHECK(topk == std::vector<int32_t>{5, 6});
}

TEST_CASE("cpu moe_router_backward against finite differences (gates, probs and lse paths)") {
  auto ops = make_cpu_ops();
  const int64_t N = 6, E = 6;
  for (int K : {1, 2}) {
    for (bool sigmoid : {false, true}) {
      for (bool normalize : {false, true}) {
        CAPTURE(K);
        CAPTURE(sigmoid);
        CAPTURE(normalize);
        auto x = spread_logits(N, E, 11 + uint64_t(K));
        auto wg = random_normal(static_cast<size_t>(N * K), 12, 1),
             wp = random_normal(static_cast<size_t>(N * E), 12, 2), wz = random_normal(static_cast<size_t>(N), 12, 3);
        std::vector<float> probs(static_cast<size_t>(N * E)), gates(static_cast<size_t>(N * K)),
            lse(static_cast<size_t>(N));
        std::vector<int32_t> topk(static_cast<size_t>(N * K));
        auto fwd = [&] {
          ops->moe_router_forward(as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), as_tensor(gates, {N, K}),
                                  as_tensor(lse, {N}), as_tensor(x, {N, E}), sigmoid, normalize);
          return dot(gates, wg) + dot(probs, wp) + dot(lse, wz);
        };
        const auto num = numerical_gradient(fwd, x, 1e-3);
        fwd();
        std::vector<float> dx(static_cast<size_t>(N * E), kNaN);
        ops->moe_router_backward(as_tensor(dx, {N, E}), as_tensor(wg, {N, K}), as_tensor(wp, {N, E}),
                                 as_tensor(wz, {N}), as_tensor(x, {N, E}), as_tensor(probs, {N, E}),
                                 as_tensor(topk, {N, K}), sigmoid, normalize);
        // fp32 forward values (~1) rounded at 6e-8, divided by the 2e-3 step: ~1e-4 of noise.
        auto r = allclose(dx, num, 3e-4, 1e-3);
        CHECK_MESSAGE(r.ok, r.str());
        // Without dprobs and dlse only the gate path remains.
        std::vector<float> dx2(static_cast<size_t>(N * E), kNaN);
        ops->moe_router_backward(as_tensor(dx2, {N, E}), as_tensor(wg, {N, K}), Tensor(), Tensor(),
                                 as_tensor(x, {N, E}), as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), sigmoid,
                                 normalize);
        std::fill(wp.begin(), wp.end(), 0.0f);
        std::fill(wz.begin(), wz.end(), 0.0f);
        const auto num2 = numerical_gradient(fwd, x, 1e-3);
        r = allclose(dx2, num2, 3e-4, 1e-3);
        CHECK_MESSAGE(r.ok, "gates only: ", r.str());
      }
    }
  }
}

TEST_CASE("cpu grouped_linear forward/backward equal linear_forward/backward per group (empty groups too)") {
  auto ops = make_cpu_ops();
  const int64_t IC = 5, OC = 7;
  const std::vector<int64_t> rows = {3, 0, 4, 1};
  const int64_t G = int64_t(rows.size()), M = std::accumulate(rows.begin(), rows.end(), int64_t(0));
  for (bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    auto x = random_normal(static_cast<size_t>(M * IC), 21, 0),
         w = random_normal(static_cast<size_t>(G * OC * IC), 21, 1),
         b = random_normal(static_cast<size_t>(G * OC), 21, 2), dy = random_normal(static_cast<size_t>(M * OC), 21, 3);
    auto dw = random_normal(static_cast<size_t>(G * OC * IC), 21, 4),
         db = random_normal(static_cast<size_t>(G * OC), 21, 5);  // accumulate
    auto dw_ref = dw, db_ref = db;
    std::vector<float> y(static_cast<size_t>(M * OC), kNaN), y_ref(y.size()), dx(static_cast<size_t>(M * IC), kNaN),
        dx_ref(dx.size());
    Tensor bias = with_bias ? as_tensor(b, {G, OC}) : Tensor(), dbias = with_bias ? as_tensor(db, {G, OC}) : Tensor();
    ops->grouped_linear_forward(as_tensor(y, {M, OC}), as_tensor(x, {M, IC}), as_tensor(w, {G, OC, IC}), bias,
                                rows.data());
    ops->grouped_linear_backward(as_tensor(dx, {M, IC}), as_tensor(dw, {G, OC, IC}), dbias, as_tensor(dy, {M, OC}),
                                 as_tensor(x, {M, IC}), as_tensor(w, {G, OC, IC}), rows.data());
    for (int64_t g = 0, r = 0; g < G; r += rows[g], ++g) {
      if (rows[g] == 0) continue;
      Tensor xg(x.data() + r * IC, {rows[g], IC}), wg(w.data() + g * OC * IC, {OC, IC});
      Tensor bg = with_bias ? Tensor(b.data() + g * OC, {OC}) : Tensor();
      Tensor dbg = with_bias ? Tensor(db_ref.data() + g * OC, {OC}) : Tensor();
      ops->linear_forward(Tensor(y_ref.data() + r * OC, {rows[g], OC}), xg, wg, bg);
      ops->linear_backward(Tensor(dx_ref.data() + r * IC, {rows[g], IC}), Tensor(dw_ref.data() + g * OC * IC, {OC, IC}),
                           dbg, Tensor(dy.data() + r * OC, {rows[g], OC}), xg, wg);
    }
    // The same BLAS calls on the same operands: bitwise equal.
    CHECK(max_abs_diff(y, y_ref) == 0.0);
    CHECK(max_abs_diff(dx, dx_ref) == 0.0);
    CHECK(max_abs_diff(dw, dw_ref) == 0.0);
    CHECK(max_abs_diff(db, db_ref) == 0.0);
  }
}

TEST_CASE("cpu moe_combine and its backward against loops") {
  auto ops = make_cpu_ops();
  const int64_t N = 5, K = 2, C = 3;
  std::vector<int32_t> slot = {9, 0, 3, 4, 1, 6};  // token 0 twice, token 2 once (slot 5 dropped) ...
  const int64_t M = int64_t(slot.size());
  auto rows = random_normal(static_cast<size_t>(M * C), 31, 0),
       gates = random_normal(static_cast<size_t>(N * K), 31, 1), out = random_normal(static_cast<size_t>(N * C), 31, 2),
       dout = random_normal(static_cast<size_t>(N * C), 31, 3);
  auto want = out;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t c = 0; c < C; ++c) want[(slot[i] / K) * C + c] += gates[slot[i]] * rows[i * C + c];
  ops->moe_combine(as_tensor(out, {N, C}), as_tensor(rows, {M, C}), as_tensor(slot, {M}), as_tensor(gates, {N, K}));
  auto r = allclose(out, want, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());

  std::vector<float> drows(static_cast<size_t>(M * C), kNaN), dgates(static_cast<size_t>(N * K), 7.0f);
  ops->moe_combine_backward(as_tensor(drows, {M, C}), as_tensor(dgates, {N, K}), as_tensor(dout, {N, C}),
                            as_tensor(rows, {M, C}), as_tensor(slot, {M}), as_tensor(gates, {N, K}));
  std::vector<double> wdr(drows.size()), wdg(dgates.size(), 7.0);
  for (int64_t i = 0; i < M; ++i) {
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      wdr[i * C + c] = double(gates[slot[i]]) * dout[(slot[i] / K) * C + c];
      s += double(dout[(slot[i] / K) * C + c]) * rows[i * C + c];
    }
    wdg[slot[i]] = s;
  }
  r = allclose(drows, wdr, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
  r = allclose(dgates, wdg, 1e-6, 1e-6);  // slots 2, 5, 7, 8 keep their 7
  CHECK_MESSAGE(r.ok, r.str());
}
