// GPU tests (label gpu) of the CUDA backend's softmax cross-entropy against the CPU backend, f32 and
// bf16 logits: the fused op, and the three vocabulary-parallel steps over 1 to 4 shards joined by
// host-side "all-reduces".
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

const DType kDtypes[] = {DType::F32, DType::BF16};
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tolerances. Both sides see the same (bf16-rounded) logits; the GPU sums exponentials in fp32 with
// the hardware exp2 (a few 1e-7 relative per term, ~1e-6 on a sum of 50k terms spread over 512
// threads and a tree), the CPU in double. Losses (O(1)-O(10), log of that sum) are held to 2e-5
// absolute + 1e-5 relative; softmax values to 1e-5 relative, i.e. the gradient to 1e-5 * dloss
// absolute + 1e-5 relative in f32. bf16 gradients add their final rounding, u = 2^-8 (2u allowed).
double rtol_for(DType dt) { return dt == DType::BF16 ? 2 * kBf16U : 1e-5; }
std::vector<float> in_dtype(std::vector<float> v, DType dt) {
  return dt == DType::BF16 ? rounded_bf16(std::move(v)) : v;
}
void check_close(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
                 const char* what) {
  const auto r = allclose(got, want, atol, rtol);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}
// Nonzero gradient entries in ignored rows and in padded columns (both must be exactly 0).
size_t stray_nonzeros(const std::vector<float>& d, const std::vector<int32_t>& targets, int64_t V, int64_t Vp) {
  size_t bad = 0;
  for (size_t n = 0; n < targets.size(); ++n)
    for (int64_t c = 0; c < Vp; ++c) bad += (c >= V || targets[n] < 0) && d[n * size_t(Vp) + size_t(c)] != 0.0f;
  return bad;
}

// Logits (N,Vp) in dtype dt: normal with stddev `scale`, junk (50) in the padded columns.
std::vector<float> make_logits(int64_t N, int64_t V, int64_t Vp, float scale, uint64_t seed, DType dt) {
  auto x = random_normal(size_t(N * Vp), seed, 0, scale);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = V; c < Vp; ++c) x[size_t(n * Vp + c)] = 50.0f;
  return in_dtype(std::move(x), dt);
}

}  // namespace

TEST_CASE("cuda crossentropy_forward_backward matches the CPU (ignored rows, padding, in place)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  struct Sizes {
    int64_t N, V, Vp;
    float scale;
  };
  // 29 of 32: packs; 29 of 37: scalar; GPT-2: a 50k row over 512 threads, staged in shared memory;
  // a Llama-3-sized row (128256 columns, 250 or 500 KiB) is larger than shared memory and streams.
  for (Sizes s : {Sizes{16, 29, 32, 2.0f}, Sizes{16, 29, 37, 2.0f}, Sizes{4, 50257, 50304, 3.0f},
                  Sizes{3, 128000, 128256, 3.0f}}) {
    for (DType dt : kDtypes) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(s.V);
      CAPTURE(s.Vp);
      const int64_t N = s.N, V = s.V, Vp = s.Vp;
      std::vector<int32_t> targets(static_cast<size_t>(N));
      for (int64_t n = 0; n < N; ++n) targets[size_t(n)] = int32_t((n * 7919 + 3) % V);
      targets[1] = -1;  // ignored
      targets[size_t(N - 1)] = int32_t(V - 1);
      if (N > 11) targets[11] = -100;
      auto logits = make_logits(N, V, Vp, s.scale, 600 + uint64_t(V), dt);
      logits[size_t(targets[0])] = 1000.0f;  // exact in bf16; overflows exp without the max subtraction
      int kept = 0;
      for (int32_t t : targets) kept += t >= 0;
      const float dloss = 1.0f / float(kept);

      std::vector<float> want_l(static_cast<size_t>(N)), want_d(logits.size());
      auto logits_h = logits;
      auto targets_h = targets;
      cpu->crossentropy_forward_backward(as_tensor(want_l, {N}), as_tensor(want_d, {N, Vp}),
                                         as_tensor(logits_h, {N, Vp}), as_tensor(targets_h, {N}), V, dloss);

      auto g_logits = to_device(*ops, logits, {N, Vp}, dt), g_t = to_device(*ops, targets, {N});
      auto g_l = to_device(*ops, std::vector<float>(size_t(N), kNaN), {N});
      auto g_d = zeros(*ops, {N, Vp}, dt);
      ops->crossentropy_forward_backward(g_l.t, g_d.t, g_logits.t, g_t.t, V, dloss);
      const auto got_l = to_host(*ops, g_l.t), got_d = to_host(*ops, g_d.t);
      check_close(got_l, want_l, 2e-5, 1e-5, "losses");
      check_close(got_d, want_d, 1e-5 * dloss, rtol_for(dt), "dlogits");
      CHECK(got_l[1] == 0.0f);
      CHECK(stray_nonzeros(got_d, targets, V, Vp) == 0);

      // Either output alone, and dlogits over logits: the same bits.
      auto g_l2 = zeros(*ops, {N});
      ops->crossentropy_forward_backward(g_l2.t, Tensor(), g_logits.t, g_t.t, V, dloss);
      CHECK(to_host(*ops, g_l2.t) == got_l);
      auto g_d2 = zeros(*ops, {N, Vp}, dt);
      ops->crossentropy_forward_backward(Tensor(), g_d2.t, g_logits.t, g_t.t, V, dloss);
      CHECK(to_host(*ops, g_d2.t) == got_d);
      auto g_inplace = to_device(*ops, logits, {N, Vp}, dt), g_l3 = zeros(*ops, {N});
      ops->crossentropy_forward_backward(g_l3.t, g_inplace.t, g_inplace.t, g_t.t, V, dloss);
      CHECK(to_host(*ops, g_l3.t) == got_l);
      CHECK(to_host(*ops, g_inplace.t) == got_d);
    }
  }
}

TEST_CASE("cuda crossentropy: a target >= V gives a NaN loss for its row only") {
  // The CPU rejects such a target up front; the GPU cannot without a host sync, so it poisons the
  // row instead (the training loop's loss check then reports it).
  auto ops = cuda_ops_or_skip();
  const int64_t N = 3, V = 10, Vp = 16;
  auto logits = make_logits(N, V, Vp, 1.0f, 610, DType::F32);
  auto g_logits = to_device(*ops, logits, {N, Vp}), g_t = to_device(*ops, std::vector<int32_t>{2, int32_t(V), 9}, {N});
  auto g_l = zeros(*ops, {N});
  ops->crossentropy_forward_backward(g_l.t, Tensor(), g_logits.t, g_t.t, V, 1.0f);
  const auto l = to_host(*ops, g_l.t);
  CHECK(std::isfinite(l[0]));
  CHECK(std::isnan(l[1]));
  CHECK(std::isfinite(l[2]));
}

TEST_CASE("cuda vocab-parallel crossentropy: 1 to 4 shards match the CPU's fused op") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  // Vp = 48 over 1..4 ranks (Vl = 48, 24, 16, 12: packs for both dtypes except bf16 at 12).
  // V = 48: no padding; V = 37: the last shard partly padding; V = 20: with 3 or 4 ranks the last
  // shards are all padding (maxes -inf, sums 0, gradient 0).
  const int64_t N = 16, Vp = 48;
  for (DType dt : kDtypes) {
    for (int64_t V : {int64_t(48), int64_t(37), int64_t(20)}) {
      std::vector<int32_t> targets(static_cast<size_t>(N));
      for (int64_t n = 0; n < N; ++n) targets[size_t(n)] = int32_t((n * 7 + 3) % V);
      targets[5] = -1;
      targets[11] = -100;
      targets[15] = int32_t(V - 1);
      auto logits = make_logits(N, V, Vp, 2.0f, 620 + uint64_t(V), dt);
      logits[size_t(targets[0])] = 1000.0f;
      const float dloss = 1.0f / 14;  // mean over the 14 kept rows
      std::vector<float> want_l(static_cast<size_t>(N)), want_d(logits.size());
      auto logits_h = logits;
      auto targets_h = targets;
      cpu->crossentropy_forward_backward(as_tensor(want_l, {N}), as_tensor(want_d, {N, Vp}),
                                         as_tensor(logits_h, {N, Vp}), as_tensor(targets_h, {N}), V, dloss);
      auto g_t = to_device(*ops, targets, {N});

      for (int ranks : {1, 2, 3, 4}) {
        const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
        CAPTURE(dtype);
        CAPTURE(V);
        CAPTURE(ranks);
        const int64_t Vl = Vp / ranks;
        std::vector<DeviceTensor> shard;  // each rank's (N, Vl) columns
        for (int r = 0; r < ranks; ++r) {
          std::vector<float> part(static_cast<size_t>(N * Vl));
          for (int64_t n = 0; n < N; ++n)
            for (int64_t c = 0; c < Vl; ++c) part[size_t(n * Vl + c)] = logits[size_t(n * Vp + r * Vl + c)];
          shard.push_back(to_device(*ops, part, {N, Vl}, dt));
        }
        // Step 1 and the MAX all-reduce.
        std::vector<float> gmax(static_cast<size_t>(N), -std::numeric_limits<float>::infinity());
        for (int r = 0; r < ranks; ++r) {
          auto m = to_device(*ops, std::vector<float>(size_t(N), kNaN), {N});
          ops->softmax_shard_max(m.t, shard[size_t(r)].t, r * Vl, V);
          const auto mh = to_host(*ops, m.t);
          for (int64_t n = 0; n < N; ++n) {
            if (r * Vl >= V) CHECK(mh[size_t(n)] == -std::numeric_limits<float>::infinity());
            gmax[size_t(n)] = std::max(gmax[size_t(n)], mh[size_t(n)]);
          }
        }
        // Step 2 (sumexp and target_logit as the two halves of one (2,N) buffer) and the SUM.
        auto g_max = to_device(*ops, gmax, {N});
        std::vector<float> gsum(static_cast<size_t>(2 * N), 0.0f);
        for (int r = 0; r < ranks; ++r) {
          auto both = to_device(*ops, std::vector<float>(size_t(2 * N), kNaN), {2, N});
          const Tensor se = both.t.flat_slice(0, N), tl = both.t.flat_slice(N, N);
          ops->softmax_shard_sums(se, tl, shard[size_t(r)].t, g_max.t, g_t.t, r * Vl, V);
          const auto bh = to_host(*ops, both.t);
          for (int64_t i = 0; i < 2 * N; ++i) {
            if (r * Vl >= V) CHECK(bh[size_t(i)] == 0.0f);
            gsum[size_t(i)] += bh[size_t(i)];
          }
        }
        CHECK(gsum[5] == 0.0f);  // ignored rows: 0 sums
        auto g_sum = to_device(*ops, gsum, {2, N});
        const Tensor g_se = g_sum.t.flat_slice(0, N), g_tl = g_sum.t.flat_slice(N, N);
        // Step 3 on every rank; each gets the full losses.
        std::vector<float> got_d(static_cast<size_t>(N * Vp), kNaN), got_l;
        for (int r = 0; r < ranks; ++r) {
          auto l = zeros(*ops, {N});
          auto d = zeros(*ops, {N, Vl}, dt);
          ops->crossentropy_shard_finish(l.t, d.t, shard[size_t(r)].t, g_max.t, g_se, g_tl, g_t.t, r * Vl, V, dloss);
          const auto lh = to_host(*ops, l.t), dh = to_host(*ops, d.t);
          if (r == 0) got_l = lh;
          CHECK(lh == got_l);
          for (int64_t n = 0; n < N; ++n)
            for (int64_t c = 0; c < Vl; ++c) got_d[size_t(n * Vp + r * Vl + c)] = dh[size_t(n * Vl + c)];
          // Losses alone, and the gradient over this shard's logits: the same bits.
          auto l2 = zeros(*ops, {N});
          ops->crossentropy_shard_finish(l2.t, Tensor(), shard[size_t(r)].t, g_max.t, g_se, g_tl, g_t.t, r * Vl, V,
                                         dloss);
          CHECK(to_host(*ops, l2.t) == lh);
          auto inplace = to_device(*ops, to_host(*ops, shard[size_t(r)].t), {N, Vl}, dt);
          ops->crossentropy_shard_finish(Tensor(), inplace.t, inplace.t, g_max.t, g_se, g_tl, g_t.t, r * Vl, V, dloss);
          CHECK(to_host(*ops, inplace.t) == dh);
        }
        // The shard steps round sumexp to fp32 per shard and sum the shards in fp32: within the
        // fused tolerances.
        check_close(got_l, want_l, 2e-5, 1e-5, "losses");
        check_close(got_d, want_d, 1e-5 * dloss, rtol_for(dt), "dlogits");
        CHECK(got_l[5] == 0.0f);
        CHECK(got_l[11] == 0.0f);
        CHECK(stray_nonzeros(got_d, targets, V, Vp) == 0);
      }
    }
  }
}
