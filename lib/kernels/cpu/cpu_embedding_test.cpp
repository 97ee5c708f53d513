// Tests of the CPU backend's embedding lookup (vocabulary slices) and its deterministic backward.
#include <doctest/doctest.h>
#include <omp.h>

#include <cstring>

#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("cpu embedding forward/backward with a vocabulary slice (vocab_start)") {
  auto ops = make_cpu_ops();
  // This rank holds vocabulary rows [3, 8); tokens 0, 2, 8, 11 belong to other ranks.
  const int64_t B = 2, T = 5, N = B * T, C = 7, rows = 5, vocab_start = 3, maxT = 6;
  std::vector<int32_t> tokens = {3, 0, 7, 5, 5, 8, 2, 3, 11, 6};
  std::vector<int32_t> pos = {0, 1, 2, 3, 4, 5, 0, 2, 2, 1};  // repeated rows exercise the scatter-add
  auto wte = random_normal(size_t(rows * C), 51, 0), wpe = random_normal(size_t(maxT * C), 51, 1);
  auto wout = random_normal(size_t(N * C), 51, 2);
  std::vector<float> out(static_cast<size_t>(N * C), -1.0f);
  auto forward = [&](bool with_wpe) {
    ops->embedding_forward(as_tensor(out, {B, T, C}), as_tensor(tokens, {B, T}), as_tensor(pos, {B, T}),
                           as_tensor(wte, {rows, C}), with_wpe ? as_tensor(wpe, {maxT, C}) : Tensor(), vocab_start);
  };
  for (bool with_wpe : {true, false}) {
    CAPTURE(with_wpe);
    forward(with_wpe);
    bool ok = true;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t r = tokens[size_t(n)] - vocab_start;
        float want = (r >= 0 && r < rows) ? wte[size_t(r * C + c)] : 0.0f;
        if (with_wpe) want += wpe[size_t(pos[size_t(n)] * C + c)];
        ok &= out[size_t(n * C + c)] == want;  // one float add: exact
      }
    CHECK(ok);
  }

  // The loss is linear in wte and wpe: central differences are exact up to rounding for any step.
  auto loss = [&] {
    forward(true);
    return dot(out, wout);
  };
  const auto nte = numerical_gradient(loss, wte, 0.5), npe = numerical_gradient(loss, wpe, 0.5);
  auto dte0 = random_normal(wte.size(), 52, 0), dpe0 = random_normal(wpe.size(), 52, 1);
  auto dte = dte0, dpe = dpe0;
  auto backward = [&] {
    ops->embedding_backward(as_tensor(dte, {rows, C}), as_tensor(dpe, {maxT, C}), as_tensor(wout, {N, C}),
                            as_tensor(tokens, {N}), as_tensor(pos, {N}), vocab_start);
  };
  for (int times = 1; times <= 2; ++times) {  // both gradients accumulate
    CAPTURE(times);
    backward();
    std::vector<double> gte(wte.size()), gpe(wpe.size());
    for (size_t i = 0; i < gte.size(); ++i) gte[i] = (double(dte[i]) - dte0[i]) / times;
    for (size_t i = 0; i < gpe.size(); ++i) gpe[i] = (double(dpe[i]) - dpe0[i]) / times;
    // Sums of at most 3 unit normals per element; the finite difference carries the rounding of
    // the loss (~1e-7) over the step of 1: 2e-6 is ~10x the observed error.
    auto r = allclose(gte, nte, 2e-6, 2e-6);
    CHECK_MESSAGE(r.ok, "dwte: ", r.str());
    r = allclose(gpe, npe, 2e-6, 2e-6);
    CHECK_MESSAGE(r.ok, "dwpe: ", r.str());
  }
  // Row 1 of the slice (token 4) appears in no position: untouched.
  dte = dte0;
  backward();
  CHECK(std::memcmp(dte.data() + C, dte0.data() + C, size_t(C) * 4) == 0);

  std::vector<int32_t> bad_pos = pos;
  bad_pos[4] = int32_t(maxT);
  CHECK_THROWS_WITH_AS(ops->embedding_forward(as_tensor(out, {N, C}), as_tensor(tokens, {N}), as_tensor(bad_pos, {N}),
                                              as_tensor(wte, {rows, C}), as_tensor(wpe, {maxT, C}), vocab_start),
                       doctest::Contains("positions[4]"), Error);
}

TEST_CASE("cpu embedding backward is bitwise reproducible and independent of the thread count") {
  auto ops = make_cpu_ops();
  const int64_t N = 256, C = 200, rows = 50, maxT = 64;
  std::vector<int32_t> tokens(static_cast<size_t>(N)), pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    tokens[size_t(n)] = int32_t(bits_at(61, 0, uint64_t(n)) % 60);  // some outside [0, 50)
    pos[size_t(n)] = int32_t(n % maxT);
  }
  auto g = random_normal(size_t(N * C), 61, 1);
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> dte(static_cast<size_t>(rows * C), 0.0f), dpe(static_cast<size_t>(maxT * C), 0.0f);
    ops->embedding_backward(as_tensor(dte, {rows, C}), as_tensor(dpe, {maxT, C}), as_tensor(g, {N, C}),
                            as_tensor(tokens, {N}), as_tensor(pos, {N}), 0);
    omp_set_num_threads(saved);
    dte.insert(dte.end(), dpe.begin(), dpe.end());
    return dte;
  };
  const auto a = run(2), b = run(2), c = run(1);
  CHECK(a == b);
  CHECK(a == c);
}
