// GPU tests (label gpu) of the CUDA backend's mixture-of-experts ops against the CPU backend on random
// inputs: the router forward and backward and the weighted combine with its backward, f32 and bf16.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
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

std::vector<float> in_dtype(std::vector<float> v, DType dt) {
  return dt == DType::BF16 ? rounded_bf16(std::move(v)) : v;
}
void check_close(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
                 const char* what) {
  const auto r = allclose(got, want, atol, rtol);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}

// Router logits whose sorted values per row are about `gap` apart (a random permutation of
// gap * [-E/2, E/2) plus noise of 0.1 gap). The callers' gaps are at least twice the bf16 spacing
// of the largest logit, so even bf16-rounded logits stay distinct and no two probabilities are
// within rounding of each other: the CPU and the GPU must pick the same top-k. Row 0 gets an
// exact tie at the top (experts 5 and 6), which both must break towards the lower index.
std::vector<float> spread_logits(int64_t N, int64_t E, float gap, uint64_t seed, DType dt) {
  std::vector<float> x(static_cast<size_t>(N * E));
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t e = E - 1; e > 0; --e)
      std::swap(perm[size_t(e)], perm[bits_at(seed, uint64_t(n), uint64_t(e)) % uint64_t(e + 1)]);
    for (int64_t e = 0; e < E; ++e)
      x[size_t(n * E + e)] =
          gap * (float(perm[size_t(e)]) - float(E / 2)) + 0.1f * gap * normal_at(seed, 7, uint64_t(n * E + e));
  }
  x[5] = x[6] = gap * float(E);  // above every other logit of row 0
  return in_dtype(std::move(x), dt);
}

}  // namespace

TEST_CASE("cuda moe_router_forward matches the CPU (softmax/sigmoid, normalize, ties, up to 256 experts)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 37;
  for (DType dt : kDtypes) {
    for (int64_t E : {int64_t(8), int64_t(40), int64_t(256)}) {
      for (int64_t K : {int64_t(1), int64_t(2), int64_t(6)}) {
        for (bool sigmoid : {false, true}) {
          for (bool normalize : {false, true}) {
            const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
            CAPTURE(dtype);
            CAPTURE(E);
            CAPTURE(K);
            CAPTURE(sigmoid);
            CAPTURE(normalize);
            auto x = spread_logits(N, E, E > 40 ? 0.06f : 0.2f, 800 + uint64_t(E + K), dt);
            std::vector<float> probs(static_cast<size_t>(N * E)), gates(static_cast<size_t>(N * K)),
                lse(static_cast<size_t>(N));
            std::vector<int32_t> topk(static_cast<size_t>(N * K));
            cpu->moe_router_forward(as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), as_tensor(gates, {N, K}),
                                    as_tensor(lse, {N}), as_tensor(x, {N, E}), sigmoid, normalize);
            auto gx = to_device(*ops, x, {N, E}, dt);
            auto gp = zeros(*ops, {N, E}), gg = zeros(*ops, {N, K}), gl = zeros(*ops, {N});
            auto gi = zeros(*ops, {N, K}, DType::I32);
            ops->moe_router_forward(gp.t, gi.t, gg.t, gl.t, gx.t, sigmoid, normalize);
            CHECK(to_host_i32(*ops, gi.t) == topk);
            if (K >= 2) {  // row 0: the tie at the top, lower index first
              const auto got_i = to_host_i32(*ops, gi.t);
              CHECK(got_i[0] == 5);
              CHECK(got_i[1] == 6);
            }
            // fp32 with accurate expf and division against double rounded once: a few ulp.
            check_close(to_host(*ops, gp.t), probs, 1e-7, 2e-6, "probs");
            check_close(to_host(*ops, gg.t), gates, 1e-7, 2e-6, "gates");
            check_close(to_host(*ops, gl.t), lse, 2e-6, 1e-6, "lse");
            // lse is optional.
            auto gp2 = zeros(*ops, {N, E});
            ops->moe_router_forward(gp2.t, gi.t, gg.t, Tensor(), gx.t, sigmoid, normalize);
            CHECK(to_host(*ops, gp2.t) == to_host(*ops, gp.t));
          }
        }
      }
    }
  }
}

TEST_CASE("cuda moe_router_backward matches the CPU (gates, probs and lse paths)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 19;
  for (DType dt : kDtypes) {
    for (int64_t E : {int64_t(8), int64_t(40), int64_t(256)}) {
      for (int64_t K : {int64_t(1), int64_t(2), int64_t(6)}) {
        for (bool sigmoid : {false, true}) {
          for (bool normalize : {false, true}) {
            for (bool extras : {true, false}) {  // with dprobs and dlse, or the gates path alone
              const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
              CAPTURE(dtype);
              CAPTURE(E);
              CAPTURE(K);
              CAPTURE(sigmoid);
              CAPTURE(normalize);
              CAPTURE(extras);
              auto x = spread_logits(N, E, E > 40 ? 0.06f : 0.2f, 900 + uint64_t(E + K), dt);
              std::vector<float> probs(static_cast<size_t>(N * E)), gates(static_cast<size_t>(N * K));
              std::vector<int32_t> topk(static_cast<size_t>(N * K));
              cpu->moe_router_forward(as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), as_tensor(gates, {N, K}),
                                      Tensor(), as_tensor(x, {N, E}), sigmoid, normalize);
              auto dg = random_normal(size_t(N * K), 901, 0), dp = random_normal(size_t(N * E), 901, 1),
                   dz = random_normal(size_t(N), 901, 2);
              std::vector<float> want(static_cast<size_t>(N * E));
              cpu->moe_router_backward(as_tensor(want, {N, E}), as_tensor(dg, {N, K}),
                                       extras ? as_tensor(dp, {N, E}) : Tensor(),
                                       extras ? as_tensor(dz, {N}) : Tensor(), as_tensor(x, {N, E}),
                                       as_tensor(probs, {N, E}), as_tensor(topk, {N, K}), sigmoid, normalize);
              // The forward's outputs as the CPU made them, so that only the backward is compared.
              auto gx = to_device(*ops, x, {N, E}, dt), gp = to_device(*ops, probs, {N, E});
              auto gi = to_device(*ops, topk, {N, K});
              auto gdg = to_device(*ops, dg, {N, K}), gdp = to_device(*ops, dp, {N, E}), gdz = to_device(*ops, dz, {N});
              auto gdl = to_device(*ops, std::vector<float>(size_t(N * E), kNaN), {N, E}, dt);  // overwritten
              ops->moe_router_backward(gdl.t, gdg.t, extras ? gdp.t : Tensor(), extras ? gdz.t : Tensor(), gx.t, gp.t,
                                       gi.t, sigmoid, normalize);
              // fp32 sums of at most 256 O(1) products against double: ~1e-7 of O(1) terms; bf16
              // dlogits add their final rounding (2u).
              check_close(to_host(*ops, gdl.t), want, 1e-6, dt == DType::BF16 ? 2 * kBf16U : 1e-5, "dlogits");
            }
          }
        }
      }
    }
  }
}

TEST_CASE("cuda moe_combine and its backward match the CPU") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 7, K = 3;
  // 15 of the 21 slots in scrambled order: token 4 (slots 12..14) gets no row, others 1 to 3.
  const std::vector<int32_t> slot = {9, 0, 3, 20, 1, 6, 15, 2, 18, 10, 7, 16, 5, 19, 11};
  const int64_t M = int64_t(slot.size());
  for (DType dt : kDtypes) {
    for (int64_t C : {int64_t(16), int64_t(5)}) {  // packs, scalar
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(C);
      const auto rows = in_dtype(random_normal(size_t(M * C), 950, 0), dt);
      const auto gates = random_normal(size_t(N * K), 950, 1);
      const auto out0 = in_dtype(random_normal(size_t(N * C), 950, 2), dt);
      const auto dout = in_dtype(random_normal(size_t(N * C), 950, 3), dt);
      auto want = out0, rows_h = rows, gates_h = gates;
      auto slot_h = slot;
      cpu->moe_combine(as_tensor(want, {N, C}), as_tensor(rows_h, {M, C}), as_tensor(slot_h, {M}),
                       as_tensor(gates_h, {N, K}));
      auto g_out = to_device(*ops, out0, {N, C}, dt), g_rows = to_device(*ops, rows, {M, C}, dt);
      auto g_slot = to_device(*ops, slot, {M});
      auto g_gates = to_device(*ops, gates, {N, K});
      ops->moe_combine(g_out.t, g_rows.t, g_slot.t, g_gates.t);
      // Up to 3 products added in another order (k rather than i): a few fp32 roundings; bf16
      // rounds the sum once (2u).
      const auto got = to_host(*ops, g_out.t);
      check_close(got, want, 1e-6, dt == DType::BF16 ? 2 * kBf16U : 1e-6, "out");
      bool untouched = true;  // token 4 received nothing: bitwise its old row
      for (int64_t c = 0; c < C; ++c) untouched &= got[size_t(4 * C + c)] == out0[size_t(4 * C + c)];
      CHECK(untouched);

      // Backward: drows overwritten (NaN before), dgates written at the 15 slots only (7 before).
      std::vector<float> drows(static_cast<size_t>(M * C), kNaN), dgates(static_cast<size_t>(N * K), 7.0f);
      auto dout_h = dout;
      cpu->moe_combine_backward(as_tensor(drows, {M, C}), as_tensor(dgates, {N, K}), as_tensor(dout_h, {N, C}),
                                as_tensor(rows_h, {M, C}), as_tensor(slot_h, {M}), as_tensor(gates_h, {N, K}));
      auto g_dout = to_device(*ops, dout, {N, C}, dt);
      for (int which = 0; which < 3; ++which) {  // both outputs, drows alone (no rows), dgates alone
        CAPTURE(which);
        const bool want_drows = which != 2, want_dgates = which != 1;
        auto g_drows = to_device(*ops, std::vector<float>(size_t(M * C), kNaN), {M, C}, dt);
        auto g_dgates = to_device(*ops, std::vector<float>(size_t(N * K), 7.0f), {N, K});
        ops->moe_combine_backward(want_drows ? g_drows.t : Tensor(), want_dgates ? g_dgates.t : Tensor(), g_dout.t,
                                  want_dgates ? g_rows.t : Tensor(), g_slot.t, g_gates.t);
        if (want_drows)  // one fp32 product: bitwise in f32, one rounding in bf16
          check_close(to_host(*ops, g_drows.t), drows, 0.0, dt == DType::BF16 ? 2 * kBf16U : 0.0, "drows");
        if (want_dgates)  // fp32 dot of C <= 16 O(1) products against double
          check_close(to_host(*ops, g_dgates.t), dgates, 1e-5, 1e-5, "dgates");
        else
          CHECK(to_host(*ops, g_dgates.t) == std::vector<float>(size_t(N * K), 7.0f));
      }
    }
  }
}
