// GPU tests (label gpu) of the CUDA backend's element-wise and row ops against the CPU backend on
// random inputs, f32 and bf16 data, on shapes that take the 16-byte-pack path and shapes that take
// the scalar path.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/kernels/ops.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// Tolerances. F32: the GPU evaluates the CPU's fp32 formulas, but with the hardware exp (~2 ulp,
// plus the rounding of the scaled argument: ~1e-6 relative for the arguments used here) and fused
// multiply-adds, so 1e-5 relative is ~10x the expected difference. BF16: both sides see the same
// bf16-rounded inputs, so the extra error is the GPU's final rounding of its fp32 result to bf16,
// at most u = 2^-8 relative; 2u leaves room for the fp32 differences underneath.
constexpr double kF32Rtol = 1e-5;
const DType kDtypes[] = {DType::F32, DType::BF16};

double rtol_for(DType dt) { return dt == DType::BF16 ? 2 * kBf16U : kF32Rtol; }
// What the GPU holds after uploading v as dt (the CPU reference is fed the same values).
std::vector<float> in_dtype(std::vector<float> v, DType dt) {
  return dt == DType::BF16 ? rounded_bf16(std::move(v)) : v;
}
void check_close(const std::vector<float>& got, const std::vector<float>& want, double atol, double rtol,
                 const char* what) {
  const auto r = allclose(got, want, atol, rtol);
  CHECK_MESSAGE(r.ok, what, ": ", r.str());
}

}  // namespace

TEST_CASE("cuda embedding forward/backward match the CPU (vocabulary slice, tokens outside it)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  // This rank holds vocabulary rows [5, 15): tokens 0..4 and 15..18 belong to other ranks.
  const int64_t N = 24, rows = 10, maxT = 7, vocab_start = 5;
  std::vector<int32_t> tokens(static_cast<size_t>(N)), pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    tokens[size_t(n)] = int32_t((n * 7) % 19);  // repeats: the backward must add them up
    pos[size_t(n)] = int32_t((n * 3) % maxT);
  }
  for (DType dt : kDtypes) {
    for (int64_t C : {int64_t(16), int64_t(13)}) {  // packs, scalar
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(C);
      const auto wte = in_dtype(random_normal(size_t(rows * C), 301, 0), dt);
      const auto wpe = in_dtype(random_normal(size_t(maxT * C), 301, 1), dt);
      auto g_tok = to_device(*ops, tokens, {N});
      auto g_pos = to_device(*ops, pos, {N});
      auto g_wte = to_device(*ops, wte, {rows, C}, dt);
      auto g_wpe = to_device(*ops, wpe, {maxT, C}, dt);
      auto wte_h = wte, wpe_h = wpe;
      for (bool with_wpe : {true, false}) {
        CAPTURE(with_wpe);
        std::vector<float> want(static_cast<size_t>(N * C));
        cpu->embedding_forward(as_tensor(want, {N, C}), as_tensor(tokens, {N}), as_tensor(pos, {N}),
                               as_tensor(wte_h, {rows, C}), with_wpe ? as_tensor(wpe_h, {maxT, C}) : Tensor(),
                               vocab_start);
        auto out = zeros(*ops, {N, C}, dt);
        ops->embedding_forward(out.t, g_tok.t, g_pos.t, g_wte.t, with_wpe ? g_wpe.t : Tensor(), vocab_start);
        // One fp32 addition on both sides: bitwise in f32; bf16 adds the final rounding (<= u).
        check_close(to_host(*ops, out.t), want, 0.0, dt == DType::BF16 ? 2 * kBf16U : 0.0, "out");
      }

      // Backward: the F32 gradients accumulate onto what they hold. Each element sums at most a
      // few O(1) rows, in n order on both sides, but grouped otherwise: a few fp32 roundings.
      const auto dout = in_dtype(random_normal(size_t(N * C), 301, 2), dt);
      const auto dte0 = random_normal(size_t(rows * C), 301, 3), dpe0 = random_normal(size_t(maxT * C), 301, 4);
      auto g_dout = to_device(*ops, dout, {N, C}, dt);
      for (bool both : {true, false}) {
        CAPTURE(both);
        auto dte = dte0, dpe = dpe0, dout_h = dout;
        cpu->embedding_backward(as_tensor(dte, {rows, C}), both ? as_tensor(dpe, {maxT, C}) : Tensor(),
                                as_tensor(dout_h, {N, C}), as_tensor(tokens, {N}), as_tensor(pos, {N}), vocab_start);
        auto g_dte = to_device(*ops, dte0, {rows, C});
        auto g_dpe = to_device(*ops, dpe0, {maxT, C});
        ops->embedding_backward(g_dte.t, both ? g_dpe.t : Tensor(), g_dout.t, g_tok.t, g_pos.t, vocab_start);
        check_close(to_host(*ops, g_dte.t), dte, 1e-6, 1e-6, "dwte");
        check_close(to_host(*ops, g_dpe.t), both ? dpe : dpe0, 1e-6, 1e-6, "dwpe");
      }
      // dwpe alone (no token gradient wanted).
      auto dpe = dpe0, dout_h = dout;
      cpu->embedding_backward(Tensor(), as_tensor(dpe, {maxT, C}), as_tensor(dout_h, {N, C}), as_tensor(tokens, {N}),
                              as_tensor(pos, {N}), vocab_start);
      auto g_dpe = to_device(*ops, dpe0, {maxT, C});
      ops->embedding_backward(Tensor(), g_dpe.t, g_dout.t, g_tok.t, g_pos.t, vocab_start);
      check_close(to_host(*ops, g_dpe.t), dpe, 1e-6, 1e-6, "dwpe alone");
    }
  }
}

TEST_CASE("cuda embedding backward: long runs of one token, the same bits on every run") {
  auto ops = cuda_ops_or_skip();
  // 1000 tokens, 60% of them token 3 (a run over many 32-place chunks), the rest spread over 40
  // rows; positions n % 50. Both scalar and packed columns.
  const int64_t N = 1000, rows = 40, maxT = 50;
  std::vector<int32_t> tokens(static_cast<size_t>(N)), pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    tokens[size_t(n)] = n % 5 < 3 ? 3 : int32_t((n * 7) % rows);
    pos[size_t(n)] = int32_t(n % maxT);
  }
  for (int64_t C : {int64_t(64), int64_t(13)}) {
    CAPTURE(C);
    const auto dout = random_normal(size_t(N * C), 302, 0);
    auto g_tok = to_device(*ops, tokens, {N});
    auto g_pos = to_device(*ops, pos, {N});
    auto g_dout = to_device(*ops, dout, {N, C});
    // A double reference, and the bound of any order of fp32 additions: count * 2^-24 * sum |x|.
    std::vector<double> want(static_cast<size_t>(rows * C)), bound(static_cast<size_t>(rows * C));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        const size_t i = size_t(tokens[size_t(n)] * C + c);
        want[i] += dout[size_t(n * C + c)];
        bound[i] += std::fabs(dout[size_t(n * C + c)]) * double(N) * std::ldexp(1.0, -24);
      }
    std::vector<float> first;
    for (int run = 0; run < 3; ++run) {
      auto g_dte = zeros(*ops, {rows, C});
      auto g_dpe = zeros(*ops, {maxT, C});
      ops->embedding_backward(g_dte.t, g_dpe.t, g_dout.t, g_tok.t, g_pos.t, 0);
      const auto got = to_host(*ops, g_dte.t);
      if (run == 0) {
        first = got;
        size_t bad = 0;
        for (size_t i = 0; i < got.size(); ++i) bad += !(std::fabs(got[i] - want[i]) <= bound[i]);
        CHECK_MESSAGE(bad == 0, bad, " of ", got.size(), " dwte elements outside the fp32 summation bound");
      }
      CHECK_MESSAGE(got == first, "run ", run, " gave other bits than run 0");
    }
  }
}

TEST_CASE("cuda gelu forward/backward match the CPU; dinp may alias dout") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  for (DType dt : kDtypes) {
    for (int64_t n : {int64_t(4096), int64_t(1001)}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(n);
      auto x = in_dtype(random_normal(size_t(n), 311, 0, 3.0f), dt);  // reaches both tails
      auto g = in_dtype(random_normal(size_t(n), 311, 1), dt);
      std::vector<float> want(static_cast<size_t>(n)), dwant(static_cast<size_t>(n));
      cpu->gelu_forward(as_tensor(want, {n}), as_tensor(x, {n}));
      cpu->gelu_backward(as_tensor(dwant, {n}), as_tensor(g, {n}), as_tensor(x, {n}));
      auto gx = to_device(*ops, x, {n}, dt), gg = to_device(*ops, g, {n}, dt);
      auto out = zeros(*ops, {n}, dt), dinp = zeros(*ops, {n}, dt);
      ops->gelu_forward(out.t, gx.t);
      ops->gelu_backward(dinp.t, gg.t, gx.t);
      // The far negative tail is ~1e-30: an absolute floor of 1e-6 covers its relative exp error.
      check_close(to_host(*ops, out.t), want, 1e-6, rtol_for(dt), "out");
      const auto d = to_host(*ops, dinp.t);
      check_close(d, dwant, 1e-6, rtol_for(dt), "dinp");
      ops->gelu_backward(gg.t, gg.t, gx.t);  // in place over dout: the same values
      CHECK(to_host(*ops, gg.t) == d);
    }
  }
}

TEST_CASE("cuda swiglu forward/backward match the CPU; dinp may alias inp") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 6;
  for (DType dt : kDtypes) {
    for (int64_t F : {int64_t(24), int64_t(7)}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(F);
      auto x = in_dtype(random_normal(size_t(N * 2 * F), 321, 0, 2.0f), dt);
      auto g = in_dtype(random_normal(size_t(N * F), 321, 1), dt);
      std::vector<float> want(static_cast<size_t>(N * F)), dwant(static_cast<size_t>(N * 2 * F));
      cpu->swiglu_forward(as_tensor(want, {N, F}), as_tensor(x, {N, 2 * F}));
      cpu->swiglu_backward(as_tensor(dwant, {N, 2 * F}), as_tensor(g, {N, F}), as_tensor(x, {N, 2 * F}));
      auto gx = to_device(*ops, x, {N, 2 * F}, dt), gg = to_device(*ops, g, {N, F}, dt);
      auto out = zeros(*ops, {N, F}, dt), dinp = zeros(*ops, {N, 2 * F}, dt);
      ops->swiglu_forward(out.t, gx.t);
      ops->swiglu_backward(dinp.t, gg.t, gx.t);
      check_close(to_host(*ops, out.t), want, 1e-6, rtol_for(dt), "out");
      const auto d = to_host(*ops, dinp.t);
      check_close(d, dwant, 1e-6, rtol_for(dt), "dinp");
      ops->swiglu_backward(gx.t, gg.t, gx.t);  // in place over inp: the same values
      CHECK(to_host(*ops, gx.t) == d);
    }
  }
}

TEST_CASE("cuda rope forward/backward match the CPU at large positions; value heads untouched") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int NH = 4, NKV = 2;
  const int64_t N = 18;
  const float theta = 10000.0f;
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) pos[size_t(n)] = int32_t((n * 997) % 5003);  // angles up to ~5000 rad
  for (DType dt : kDtypes) {
    for (int HD : {16, 6}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(HD);
      const int64_t R = int64_t(NH + 2 * NKV) * HD;
      const auto x0 = in_dtype(random_normal(size_t(N * R), 331, 0), dt);
      auto want = x0;
      cpu->rope_forward(as_tensor(want, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
      auto g_pos = to_device(*ops, pos, {N});
      auto gx = to_device(*ops, x0, {N, R}, dt);
      ops->rope_forward(gx.t, g_pos.t, NH, NKV, HD, theta);
      // The GPU reduces the angle modulo 2 pi in double and takes sincosf of the remainder: cos/sin
      // within ~3e-7 of the CPU's, times O(1) inputs.
      const auto got = to_host(*ops, gx.t);
      check_close(got, want, 1e-5, rtol_for(dt), "forward");
      bool v_untouched = true;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = int64_t(NH + NKV) * HD; c < R; ++c)
          v_untouched &= got[size_t(n * R + c)] == x0[size_t(n * R + c)];
      CHECK(v_untouched);

      const auto d0 = in_dtype(random_normal(size_t(N * R), 331, 1), dt);
      auto dwant = d0;
      cpu->rope_backward(as_tensor(dwant, {N, R}), as_tensor(pos, {N}), NH, NKV, HD, theta);
      auto gd = to_device(*ops, d0, {N, R}, dt);
      ops->rope_backward(gd.t, g_pos.t, NH, NKV, HD, theta);
      check_close(to_host(*ops, gd.t), dwant, 1e-5, rtol_for(dt), "backward");
    }
  }
}

TEST_CASE("cuda copy_cols matches the CPU, also within one matrix (overlapping and disjoint columns)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 5, Ds = 24, Dd = 16;
  struct Cols {
    int64_t dst_col, src_col, ncols;
  };
  for (DType dt : kDtypes) {
    for (Cols k : {Cols{8, 16, 8}, Cols{1, 3, 5}}) {  // packs, scalar
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(k.src_col);
      const auto src = in_dtype(random_normal(size_t(N * Ds), 341, 0), dt);
      const auto dst0 = in_dtype(random_normal(size_t(N * Dd), 341, 1), dt);
      auto want = dst0, src_h = src;
      cpu->copy_cols(as_tensor(want, {N, Dd}), k.dst_col, as_tensor(src_h, {N, Ds}), k.src_col, k.ncols);
      auto gs = to_device(*ops, src, {N, Ds}, dt), gd = to_device(*ops, dst0, {N, Dd}, dt);
      ops->copy_cols(gd.t, k.dst_col, gs.t, k.src_col, k.ncols);
      CHECK(to_host(*ops, gd.t) == want);  // a copy: bitwise
    }
    // One matrix as both dst and src: overlapping ranges need memmove semantics (the CPU's).
    for (Cols k : {Cols{3, 0, 8}, Cols{0, 3, 8}, Cols{8, 0, 8}}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(k.dst_col);
      const auto m0 = in_dtype(random_normal(size_t(N * Dd), 342, 0), dt);
      auto want = m0;
      cpu->copy_cols(as_tensor(want, {N, Dd}), k.dst_col, as_tensor(want, {N, Dd}), k.src_col, k.ncols);
      auto gm = to_device(*ops, m0, {N, Dd}, dt);
      ops->copy_cols(gm.t, k.dst_col, gm.t, k.src_col, k.ncols);
      CHECK(to_host(*ops, gm.t) == want);
    }
  }
}

TEST_CASE("cuda gather_rows and scatter_add_rows match the CPU (repeated and permuted indices)") {
  auto ops = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const int64_t N = 6, M = 9;
  const std::vector<int32_t> repeats = {0, 3, 3, 5, 1, 3, 0, 2, 3};  // row 3 four times, row 4 never
  const std::vector<int32_t> perm = {4, 0, 5, 2, 1, 3};              // M = N: every row once
  for (DType dt : kDtypes) {
    for (int64_t C : {int64_t(16), int64_t(5)}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(C);
      const auto inp = in_dtype(random_normal(size_t(N * C), 351, 0), dt);
      auto inp_h = inp;
      auto idx_h = repeats;
      std::vector<float> gwant(static_cast<size_t>(M * C));
      cpu->gather_rows(as_tensor(gwant, {M, C}), as_tensor(inp_h, {N, C}), as_tensor(idx_h, {M}));
      auto g_inp = to_device(*ops, inp, {N, C}, dt);
      auto g_idx = to_device(*ops, repeats, {M});
      auto out = zeros(*ops, {M, C}, dt);
      ops->gather_rows(out.t, g_inp.t, g_idx.t);
      CHECK(to_host(*ops, out.t) == gwant);  // a copy: bitwise

      // Scatter with repeats: the GPU adds with atomics in any order. F32: at most 3 roundings of
      // sums of O(1) values (1e-6). BF16: every atomic add rounds its partial sum to bf16, so the
      // error is bounded by (adds) * u * (sum of the magnitudes involved), checked per element.
      const auto dout = in_dtype(random_normal(size_t(M * C), 351, 1), dt);
      const auto dinp0 = in_dtype(random_normal(size_t(N * C), 351, 2), dt);
      auto swant = dinp0, dout_h = dout;
      cpu->scatter_add_rows(as_tensor(swant, {N, C}), as_tensor(dout_h, {M, C}), as_tensor(idx_h, {M}));
      auto g_dout = to_device(*ops, dout, {M, C}, dt), g_dinp = to_device(*ops, dinp0, {N, C}, dt);
      ops->scatter_add_rows(g_dinp.t, g_dout.t, g_idx.t);
      const auto got = to_host(*ops, g_dinp.t);
      if (dt == DType::F32) {
        check_close(got, swant, 1e-6, 1e-6, "scatter (repeats)");
      } else {
        std::vector<double> mag(static_cast<size_t>(N * C)), adds(size_t(N), 0.0);
        for (int64_t r = 0; r < N; ++r)
          for (int64_t c = 0; c < C; ++c) mag[size_t(r * C + c)] = std::abs(dinp0[size_t(r * C + c)]);
        for (int64_t i = 0; i < M; ++i) {
          adds[size_t(repeats[size_t(i)])] += 1.0;
          for (int64_t c = 0; c < C; ++c) mag[size_t(repeats[size_t(i)] * C + c)] += std::abs(dout[size_t(i * C + c)]);
        }
        size_t bad = 0;
        for (int64_t r = 0; r < N; ++r)
          for (int64_t c = 0; c < C; ++c) {
            const size_t e = size_t(r * C + c);
            bad += !(std::abs(double(got[e]) - double(swant[e])) <= adds[size_t(r)] * kBf16U * mag[e] + 1e-7);
          }
        CHECK_MESSAGE(bad == 0, bad, " bf16 scatter elements outside (adds * u * magnitude)");
      }

      // A permutation: each element gets one addition, so the result is the CPU's (f32) or its
      // single bf16 rounding.
      const auto dout_p = in_dtype(random_normal(size_t(N * C), 351, 3), dt);
      auto pwant = dinp0, dout_ph = dout_p;
      auto perm_h = perm;
      cpu->scatter_add_rows(as_tensor(pwant, {N, C}), as_tensor(dout_ph, {N, C}), as_tensor(perm_h, {N}));
      auto g_perm = to_device(*ops, perm, {N});
      auto g_doutp = to_device(*ops, dout_p, {N, C}, dt), g_dinp2 = to_device(*ops, dinp0, {N, C}, dt);
      ops->scatter_add_rows(g_dinp2.t, g_doutp.t, g_perm.t);
      check_close(to_host(*ops, g_dinp2.t), pwant, 0.0, dt == DType::BF16 ? 2 * kBf16U : 0.0, "scatter (permutation)");
    }
  }
}
