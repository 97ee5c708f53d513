// Tests of the CPU backend's softmax cross-entropy, fused and vocabulary-parallel (ignored rows, padded
// columns, in place).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// ---- vocabulary-parallel cross-entropy ---------------------------------------------------------

namespace {

struct ShardedResult {
  std::vector<float> losses;   // (N), from rank 0's finish (every rank's are checked to be the same bits)
  std::vector<float> dlogits;  // (N,Vp), the ranks' dlogits put back side by side
};

// Splits logits (N,Vp) into `ranks` column shards of Vp / ranks and runs the three shard steps on each,
// combining between them as the model's all-reduces will: MAX over ranks, then SUM in rank order in
// fp32 (sumexp and target_logit as the two halves of one (2,N) buffer, as one all-reduce sends them).
// in_place: dlogits aliases each shard's logits; want_grad false: dlogits undefined.
ShardedResult sharded_crossentropy(Ops& ops, const std::vector<float>& logits, std::vector<int32_t> targets,
                                   int64_t N, int64_t V, int64_t Vp, int ranks, float dloss, bool in_place,
                                   bool want_grad) {
  const int64_t Vl = Vp / ranks;
  MPIGPT_CHECK(Vl * ranks == Vp, "test: Vp = {} does not split over {} ranks", Vp, ranks);
  std::vector<std::vector<float>> shard(size_t(ranks), std::vector<float>(size_t(N * Vl)));
  for (int r = 0; r < ranks; ++r)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < Vl; ++c) shard[size_t(r)][size_t(n * Vl + c)] = logits[size_t(n * Vp + r * Vl + c)];

  std::vector<float> maxes(size_t(N), -std::numeric_limits<float>::infinity());
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> m(size_t(N), kNaN);
    ops.softmax_shard_max(as_tensor(m, {N}), as_tensor(shard[size_t(r)], {N, Vl}), r * Vl, V);
    for (int64_t n = 0; n < N; ++n) maxes[size_t(n)] = std::max(maxes[size_t(n)], m[size_t(n)]);
  }
  std::vector<float> sums(size_t(2 * N), 0.0f);  // [sumexp | target_logit]
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> part(size_t(2 * N), kNaN);
    Tensor both = as_tensor(part, {2, N});
    ops.softmax_shard_sums(both.flat_slice(0, N), both.flat_slice(N, N), as_tensor(shard[size_t(r)], {N, Vl}),
                           as_tensor(maxes, {N}), as_tensor(targets, {N}), r * Vl, V);
    for (size_t i = 0; i < sums.size(); ++i) sums[i] += part[i];
  }
  Tensor both = as_tensor(sums, {2, N});

  ShardedResult out{std::vector<float>(size_t(N), kNaN), std::vector<float>(size_t(N * Vp), kNaN)};
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> losses(size_t(N), kNaN), d(size_t(N * Vl), kNaN);
    std::vector<float>& dst = in_place ? shard[size_t(r)] : d;
    ops.crossentropy_shard_finish(as_tensor(losses, {N}), want_grad ? as_tensor(dst, {N, Vl}) : Tensor(),
                                  as_tensor(shard[size_t(r)], {N, Vl}), as_tensor(maxes, {N}), both.flat_slice(0, N),
                                  both.flat_slice(N, N), as_tensor(targets, {N}), r * Vl, V, dloss);
    if (r == 0)
      out.losses = losses;
    else
      CHECK(losses == out.losses);
    if (want_grad)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < Vl; ++c) out.dlogits[size_t(n * Vp + r * Vl + c)] = dst[size_t(n * Vl + c)];
  }
  return out;
}

}  // namespace

TEST_CASE("cpu vocab-parallel crossentropy: 1 to 4 shards match the fused op") {
  auto ops = make_cpu_ops();
  // Vp = 36 splits over 1, 2, 3 and 4 ranks. V = 36: no padding; V = 29: the last shard is part
  // padding; V = 20: with 3 or 4 ranks the last shard is all padding (maxes -inf, sums 0).
  const int64_t N = 16, Vp = 36;
  for (int64_t V : {int64_t(36), int64_t(29), int64_t(20)}) {
    std::vector<int32_t> targets(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) targets[size_t(n)] = int32_t((n * 7 + 3) % V);
    targets[5] = -1;  // ignored rows
    targets[11] = -100;
    targets[15] = int32_t(V - 1);  // the last valid column
    auto logits = random_normal(size_t(N * Vp), 171, uint64_t(V), 2.0f);
    for (int64_t n = 0; n < N; ++n)  // padded columns hold junk that must not enter the softmax
      for (int64_t c = V; c < Vp; ++c) logits[size_t(n * Vp + c)] = 50.0f;
    logits[size_t(0 * Vp + targets[0])] = 1000.0f;  // overflows exp without the max subtraction
    const float dloss = 1.0f / 14;                  // mean over the 14 kept rows

    std::vector<float> want_losses(size_t(N), kNaN), want_d(logits.size(), kNaN);
    ops->crossentropy_forward_backward(as_tensor(want_losses, {N}), as_tensor(want_d, {N, Vp}),
                                       as_tensor(logits, {N, Vp}), as_tensor(targets, {N}), V, dloss);

    for (int ranks : {1, 2, 3, 4}) {
      CAPTURE(V);
      CAPTURE(ranks);
      const int64_t Vl = Vp / ranks;
      // Every shard that holds valid columns holds some row's target.
      for (int r = 0; r < ranks; ++r) {
        if (r * Vl >= V) continue;
        bool hit = false;
        for (int32_t t : targets) hit |= t >= r * Vl && t < (r + 1) * Vl;
        CHECK_MESSAGE(hit, "no target in shard " << r);
      }
      const auto got = sharded_crossentropy(*ops, logits, targets, N, V, Vp, ranks, dloss, false, true);
      // The shard steps differ from the fused op only in rounding: sumexp is rounded to fp32 once per
      // shard and summed in fp32 (~1e-7 relative each), so losses (O(1), or 0 where the target holds all
      // the mass) agree to 1e-6 relative + 1e-6 absolute, and the gradient to 1e-6 relative + 1e-6 * dloss.
      auto r = allclose(got.losses, want_losses, 1e-6, 1e-6);
      CHECK_MESSAGE(r.ok, r.str());
      r = allclose(got.dlogits, want_d, 1e-6 * dloss, 1e-6);
      CHECK_MESSAGE(r.ok, r.str());
      CHECK(got.losses[5] == 0.0f);
      CHECK(got.losses[11] == 0.0f);
      size_t nonzero_padding = 0, nonzero_ignored = 0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < Vp; ++c) {
          const float d = got.dlogits[size_t(n * Vp + c)];
          if (c >= V) nonzero_padding += d != 0.0f;
          if (targets[size_t(n)] < 0) nonzero_ignored += d != 0.0f;
        }
      CHECK(nonzero_padding == 0);
      CHECK(nonzero_ignored == 0);

      // dlogits aliasing logits gives the same bits; without dlogits the same losses.
      const auto inplace = sharded_crossentropy(*ops, logits, targets, N, V, Vp, ranks, dloss, true, true);
      CHECK(inplace.dlogits == got.dlogits);
      CHECK(inplace.losses == got.losses);
      const auto fwd = sharded_crossentropy(*ops, logits, targets, N, V, Vp, ranks, dloss, false, false);
      CHECK(fwd.losses == got.losses);
    }
  }
}

TEST_CASE("cpu vocab-parallel crossentropy: a GPT-2-sized vocabulary over 4 ranks matches the fused op") {
  auto ops = make_cpu_ops();
  const int64_t N = 4, V = 50257, Vp = 50304;  // 4 shards of 12576; the last holds the 47 padded columns
  auto logits = random_normal(size_t(N * Vp), 181, 0, 3.0f);
  std::vector<int32_t> targets = {7, 50256, 20000, 37800};  // in shards 0, 3, 1, 3
  std::vector<float> want_losses(static_cast<size_t>(N)), want_d(logits.size(), kNaN);
  ops->crossentropy_forward_backward(as_tensor(want_losses, {N}), as_tensor(want_d, {N, Vp}),
                                     as_tensor(logits, {N, Vp}), as_tensor(targets, {N}), V, 1.0f);
  const auto got = sharded_crossentropy(*ops, logits, targets, N, V, Vp, 4, 1.0f, false, true);
  // Tolerances as in the small case: the per-shard fp32 rounding of sumexp is ~1e-7 relative
  // however many terms each shard sums (they are summed in double first).
  auto r = allclose(got.losses, want_losses, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
  r = allclose(got.dlogits, want_d, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
}

TEST_CASE("cpu vocab-parallel crossentropy: an all-padding shard, argument errors") {
  auto ops = make_cpu_ops();
  const int64_t N = 3, Vl = 4, V = 10;
  auto logits = random_normal(size_t(N * Vl), 191);
  std::vector<int32_t> targets = {9, -1, 0};
  std::vector<float> maxes(size_t(N), kNaN), sumexp(size_t(N), kNaN), tl(size_t(N), kNaN);

  // Columns [12, 16) of V = 10: nothing valid.
  ops->softmax_shard_max(as_tensor(maxes, {N}), as_tensor(logits, {N, Vl}), 12, V);
  for (float m : maxes) CHECK(m == -std::numeric_limits<float>::infinity());
  std::vector<float> global_max = {1.0f, 2.0f, 3.0f};
  ops->softmax_shard_sums(as_tensor(sumexp, {N}), as_tensor(tl, {N}), as_tensor(logits, {N, Vl}),
                          as_tensor(global_max, {N}), as_tensor(targets, {N}), 12, V);
  CHECK(sumexp == std::vector<float>(size_t(N), 0.0f));
  CHECK(tl == std::vector<float>(size_t(N), 0.0f));
  // Global sums as other ranks would supply them: this rank's gradient is all zeros.
  std::vector<float> gs = {2.0f, 0.0f, 3.0f}, gtl = {0.5f, 0.0f, 1.0f}, losses(size_t(N), kNaN),
                     d(logits.size(), kNaN);
  ops->crossentropy_shard_finish(as_tensor(losses, {N}), as_tensor(d, {N, Vl}), as_tensor(logits, {N, Vl}),
                                 as_tensor(global_max, {N}), as_tensor(gs, {N}), as_tensor(gtl, {N}),
                                 as_tensor(targets, {N}), 12, V, 1.0f);
  CHECK(d == std::vector<float>(logits.size(), 0.0f));
  CHECK(losses[0] == doctest::Approx(std::log(2.0) + 1.0 - 0.5));
  CHECK(losses[1] == 0.0f);
  CHECK(losses[2] == doctest::Approx(std::log(3.0) + 3.0 - 1.0));

  auto bad = targets;
  bad[2] = int32_t(V);  // a padded column is not a valid target
  CHECK_THROWS_WITH_AS(ops->softmax_shard_sums(as_tensor(sumexp, {N}), as_tensor(tl, {N}), as_tensor(logits, {N, Vl}),
                                               as_tensor(global_max, {N}), as_tensor(bad, {N}), 8, V),
                       doctest::Contains("targets[2] = 10"), Error);
  CHECK_THROWS_WITH_AS(ops->crossentropy_shard_finish(as_tensor(losses, {N}), Tensor(), as_tensor(logits, {N, Vl}),
                                                      as_tensor(global_max, {N}), as_tensor(gs, {N}),
                                                      as_tensor(gtl, {N}), as_tensor(bad, {N}), 8, V, 1.0f),
                       doctest::Contains("targets[2] = 10"), Error);
  std::vector<float> short_max(size_t(N - 1));
  CHECK_THROWS_WITH_AS(ops->softmax_shard_max(as_tensor(short_max, {N - 1}), as_tensor(logits, {N, Vl}), 0, V),
                       doctest::Contains("maxes"), Error);
  CHECK_THROWS_WITH_AS(ops->softmax_shard_max(as_tensor(maxes, {N}), as_tensor(logits, {N, Vl}), -4, V),
                       doctest::Contains("vocab_start = -4"), Error);
}
