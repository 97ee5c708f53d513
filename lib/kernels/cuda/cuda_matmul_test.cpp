// GPU test (CTest label gpu; exits 77, reported as skipped, without a GPU): the CUDA backend's cuBLASLt
// products against the CPU backend on random inputs, in f32 and bf16, with shapes that are not
// multiples of 8 or 16.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_matmul_testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// The group g of a (G, rows, cols) host array.
std::vector<float> group(const std::vector<float>& v, int64_t g, int64_t per) {
  return std::vector<float>(v.begin() + g * per, v.begin() + (g + 1) * per);
}

}  // namespace

TEST_CASE("cuda gemm matches the CPU: every transpose, alpha/beta, beta = 0 overwrites NaN, f32 and bf16") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const bool tuned = gemm_tuning_subcases(*gpu);
  struct Dims {
    int64_t M, N, K;
  };
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Dims d : {Dims{5, 7, 3}, Dims{33, 65, 129}, Dims{1, 1, 1}, Dims{64, 48, 32}, Dims{17, 100, 9}}) {
      for (int t = 0; t < 4; ++t) {
        const bool ta = t & 1, tb = t & 2;
        const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
        CAPTURE(dtype);
        CAPTURE(d.M);
        CAPTURE(d.N);
        CAPTURE(d.K);
        CAPTURE(ta);
        CAPTURE(tb);
        auto a = input(size_t(d.M * d.K), 11, uint64_t(t), dt), b = input(size_t(d.K * d.N), 12, uint64_t(t), dt);
        auto c = input(size_t(d.M * d.N), 13, uint64_t(t), dt);
        const Shape sa = ta ? Shape{d.K, d.M} : Shape{d.M, d.K}, sb = tb ? Shape{d.N, d.K} : Shape{d.K, d.N};
        const Tol tol = tol_for(dt, d.K, scale_of(d.K));
        auto ga = to_device(*gpu, a, sa, dt), gb = to_device(*gpu, b, sb, dt), gc = to_device(*gpu, c, {d.M, d.N}, dt);
        gpu->gemm(gc.t, ga.t, gb.t, ta, tb, 0.7f, 0.3f);
        auto want = c;
        cpu->gemm(as_tensor(want, {d.M, d.N}), as_tensor(a, sa), as_tensor(b, sb), ta, tb, 0.7f, 0.3f);
        check_close(to_host(*gpu, gc.t), want, tol, "alpha 0.7, beta 0.3");

        auto gn = to_device(*gpu, std::vector<float>(c.size(), kNaN), {d.M, d.N}, dt);
        gpu->gemm(gn.t, ga.t, gb.t, ta, tb, 1.0f, 0.0f);
        std::vector<float> want0(c.size(), kNaN);
        cpu->gemm(as_tensor(want0, {d.M, d.N}), as_tensor(a, sa), as_tensor(b, sb), ta, tb, 1.0f, 0.0f);
        check_close(to_host(*gpu, gn.t), want0, tol, "beta 0 over NaN");
      }
    }
  }
  CHECK((tuned_products(*gpu) > 0) == tuned);
  auto a = zeros(*gpu, {2, 3}), b = zeros(*gpu, {2, 3}), c = zeros(*gpu, {2, 2}), h = zeros(*gpu, {3, 2}, DType::BF16);
  CHECK_THROWS_WITH_AS(gpu->gemm(c.t, a.t, b.t, false, false, 1, 0), doctest::Contains("gemm"), Error);
  CHECK_THROWS_WITH_AS(gpu->gemm(c.t, a.t, h.t, false, false, 1, 0), doctest::Contains("dtype"), Error);
}

TEST_CASE("cuda linear forward, and with the residual fused, matches the CPU, with and without bias, f32 and bf16") {
  // linear_residual_forward: out = inp @ weight^T + bias + residual in one cuBLASLt call reading the
  // residual as C; the CPU runs linear_forward, then add. Outputs NaN-filled (all overwritten).
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const bool tuned = gemm_tuning_subcases(*gpu);
  struct Dims {
    int64_t N, IC, OC;
  };
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Dims d : {Dims{15, 7, 9}, Dims{64, 96, 200}, Dims{33, 17, 31}, Dims{128, 64, 64}, Dims{1, 5, 3}}) {
      for (bool with_bias : {true, false}) {
        const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
        CAPTURE(dtype);
        CAPTURE(d.N);
        CAPTURE(d.IC);
        CAPTURE(d.OC);
        CAPTURE(with_bias);
        auto x = input(size_t(d.N * d.IC), 21, 0, dt), w = input(size_t(d.OC * d.IC), 21, 1, dt, 0.5f);
        auto bias = input(size_t(d.OC), 21, 2, dt);
        auto gx = to_device(*gpu, x, {d.N, d.IC}, dt), gw = to_device(*gpu, w, {d.OC, d.IC}, dt);
        auto gbias = to_device(*gpu, bias, {d.OC}, dt);
        auto gout = to_device(*gpu, std::vector<float>(size_t(d.N * d.OC), kNaN), {d.N, d.OC}, dt);
        gpu->linear_forward(gout.t, gx.t, gw.t, with_bias ? gbias.t : Tensor());
        std::vector<float> want(size_t(d.N * d.OC));
        cpu->linear_forward(as_tensor(want, {d.N, d.OC}), as_tensor(x, {d.N, d.IC}), as_tensor(w, {d.OC, d.IC}),
                            with_bias ? as_tensor(bias, {d.OC}) : Tensor());
        // Outputs: 0.5 sqrt(IC) from the product plus an O(1) bias.
        check_close(to_host(*gpu, gout.t), want, tol_for(dt, d.IC, 0.5 * scale_of(d.IC) + 1.0), "out");

        auto res = input(size_t(d.N * d.OC), 21, 3, dt);
        auto gres = to_device(*gpu, res, {d.N, d.OC}, dt);
        auto gsum = to_device(*gpu, std::vector<float>(size_t(d.N * d.OC), kNaN), {d.N, d.OC}, dt);
        gpu->linear_residual_forward(gsum.t, gx.t, gw.t, with_bias ? gbias.t : Tensor(), gres.t);
        std::vector<float> want_sum(size_t(d.N * d.OC));
        cpu->linear_residual_forward(as_tensor(want_sum, {d.N, d.OC}), as_tensor(x, {d.N, d.IC}),
                                     as_tensor(w, {d.OC, d.IC}), with_bias ? as_tensor(bias, {d.OC}) : Tensor(),
                                     as_tensor(res, {d.N, d.OC}));
        // Plus an O(1) residual.
        check_close(to_host(*gpu, gsum.t), want_sum, tol_for(dt, d.IC, 0.5 * scale_of(d.IC) + 2.0), "out + residual");
        CHECK(to_host(*gpu, gres.t) == res);  // the residual is only read
      }
    }
  }
  CHECK((tuned_products(*gpu) > 0) == tuned);
  // No input features (IC = 0): the output is the bias on every row.
  auto gbias = to_device(*gpu, std::vector<float>{1, -2, 3}, {3});
  auto gw = zeros(*gpu, {3, 0}), gx = zeros(*gpu, {4, 0});
  auto gout = to_device(*gpu, std::vector<float>(12, kNaN), {4, 3});
  gpu->linear_forward(gout.t, gx.t, gw.t, gbias.t);
  CHECK(to_host(*gpu, gout.t) == std::vector<float>{1, -2, 3, 1, -2, 3, 1, -2, 3, 1, -2, 3});

  auto x = zeros(*gpu, {4, 5}), w = zeros(*gpu, {5, 3}), o = zeros(*gpu, {4, 3});
  CHECK_THROWS_WITH_AS(gpu->linear_forward(o.t, x.t, w.t, Tensor()), doctest::Contains("linear_forward"), Error);
  auto w2 = zeros(*gpu, {3, 5}), r = zeros(*gpu, {4, 2});
  CHECK_THROWS_WITH_AS(gpu->linear_residual_forward(o.t, x.t, w2.t, Tensor(), r.t), doctest::Contains("residual"),
                       Error);
  CHECK_THROWS_WITH_AS(gpu->linear_residual_forward(o.t, x.t, w2.t, Tensor(), o.t), doctest::Contains("not be out"),
                       Error);
}

TEST_CASE("cuda linear backward matches the CPU: dinp overwrites, dweight and dbias accumulate in f32") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const bool tuned = gemm_tuning_subcases(*gpu);
  struct Dims {
    int64_t N, IC, OC;
  };
  // {1000, 40, 24}: a tall dout whose bias gradient is summed in row chunks, then the chunks added.
  // OC a multiple of 8 (24, 200, 264) takes the 16-byte loads; 264 spans two of their column strips
  // and, with 700 rows, chunks of rows that are not a multiple of the 4 x 8 rows loaded at a time.
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Dims d : {Dims{15, 7, 9}, Dims{33, 17, 31}, Dims{1000, 40, 24}, Dims{256, 96, 200}, Dims{1, 3, 5},
                   Dims{700, 8, 264}}) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(d.N);
      CAPTURE(d.IC);
      CAPTURE(d.OC);
      auto x = input(size_t(d.N * d.IC), 31, 0, dt), w = input(size_t(d.OC * d.IC), 31, 1, dt);
      auto g = input(size_t(d.N * d.OC), 31, 2, dt);
      // Gradients already holding something (an earlier micro-batch): f32 whatever the data dtype.
      const auto dw0 = random_normal(w.size(), 32, 0), db0 = random_normal(size_t(d.OC), 32, 1);
      auto gx = to_device(*gpu, x, {d.N, d.IC}, dt), gw = to_device(*gpu, w, {d.OC, d.IC}, dt);
      auto gg = to_device(*gpu, g, {d.N, d.OC}, dt);
      auto gdx = to_device(*gpu, std::vector<float>(x.size(), kNaN), {d.N, d.IC}, dt);
      auto gdw = to_device(*gpu, dw0, {d.OC, d.IC}), gdb = to_device(*gpu, db0, {d.OC});
      std::vector<float> dx(x.size(), kNaN), dw = dw0, db = db0;
      for (int pass = 0; pass < 2; ++pass) {  // two micro-batches: the gradients add up twice
        CAPTURE(pass);
        gpu->linear_backward(gdx.t, gdw.t, gdb.t, gg.t, gx.t, gw.t);
        cpu->linear_backward(as_tensor(dx, {d.N, d.IC}), as_tensor(dw, {d.OC, d.IC}), as_tensor(db, {d.OC}),
                             as_tensor(g, {d.N, d.OC}), as_tensor(x, {d.N, d.IC}), as_tensor(w, {d.OC, d.IC}));
        check_close(to_host(*gpu, gdx.t), dx, tol_for(dt, d.OC, scale_of(d.OC)), "dinp");
        // dweight and dbias are f32 sums of N products (bf16 inputs, fp32 accumulation), on top of
        // an O(1) start: the f32 tolerance applies to bf16 data too.
        check_close(to_host(*gpu, gdw.t), dw, tol_for(DType::F32, d.N, 2 * scale_of(d.N) + 1), "dweight");
        check_close(to_host(*gpu, gdb.t), db, tol_for(DType::F32, d.N, 2 * scale_of(d.N) + 1), "dbias");
      }
      // Both gradients are bitwise reproducible (fixed summation orders, no atomics): the two
      // micro-batches again, on fresh gradients, without dinp.
      auto gdw2 = to_device(*gpu, dw0, {d.OC, d.IC}), gdb2 = to_device(*gpu, db0, {d.OC});
      for (int pass = 0; pass < 2; ++pass) gpu->linear_backward(Tensor(), gdw2.t, gdb2.t, gg.t, gx.t, Tensor());
      CHECK(to_host(*gpu, gdw2.t) == to_host(*gpu, gdw.t));
      CHECK(to_host(*gpu, gdb2.t) == to_host(*gpu, gdb.t));
      // dbias alone (no product to sum in: the column-sum kernel), twice, against the CPU's two
      // micro-batches, and bitwise reproducible.
      auto gdb3 = to_device(*gpu, db0, {d.OC}), gdb4 = to_device(*gpu, db0, {d.OC});
      for (auto* t : {&gdb3, &gdb3, &gdb4, &gdb4})
        gpu->linear_backward(Tensor(), Tensor(), t->t, gg.t, Tensor(), Tensor());
      check_close(to_host(*gpu, gdb3.t), db, tol_for(DType::F32, d.N, 2 * scale_of(d.N) + 1), "dbias alone");
      CHECK(to_host(*gpu, gdb4.t) == to_host(*gpu, gdb3.t));
      // Undefined gradients are skipped: dweight alone.
      auto gdw_only = zeros(*gpu, {d.OC, d.IC});
      gpu->linear_backward(Tensor(), gdw_only.t, Tensor(), gg.t, gx.t, Tensor());
      std::vector<float> dw_only(w.size(), 0.0f);
      cpu->linear_backward(Tensor(), as_tensor(dw_only, {d.OC, d.IC}), Tensor(), as_tensor(g, {d.N, d.OC}),
                           as_tensor(x, {d.N, d.IC}), Tensor());
      check_close(to_host(*gpu, gdw_only.t), dw_only, tol_for(DType::F32, d.N, scale_of(d.N)), "dweight only");
    }
  }
  CHECK((tuned_products(*gpu) > 0) == tuned);
  // Weight and bias gradients must be f32 whatever the data dtype.
  auto g = zeros(*gpu, {4, 3}, DType::BF16), x = zeros(*gpu, {4, 5}, DType::BF16);
  auto dw16 = zeros(*gpu, {3, 5}, DType::BF16), db16 = zeros(*gpu, {3}, DType::BF16);
  CHECK_THROWS_WITH_AS(gpu->linear_backward(Tensor(), dw16.t, Tensor(), g.t, x.t, Tensor()),
                       doctest::Contains("f32"), Error);
  CHECK_THROWS_WITH_AS(gpu->linear_backward(Tensor(), Tensor(), db16.t, g.t, Tensor(), Tensor()),
                       doctest::Contains("f32"), Error);
}

TEST_CASE("cuda grouped linear matches the CPU per group, with an empty group, f32 and bf16") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  struct Case {
    std::vector<int64_t> rows;
    int64_t IC, OC;
  };
  // Odd IC/OC put the later groups' weights and biases at addresses cuBLASLt's vectorised kernels
  // cannot take (and the bias epilogue is skipped for them): the unaligned paths run too.
  for (DType dt : {DType::F32, DType::BF16}) {
    for (const Case& cs : {Case{{5, 0, 11, 3}, 7, 9}, Case{{0, 64, 1, 31}, 32, 48}, Case{{8, 8}, 16, 16}}) {
      const int64_t G = int64_t(cs.rows.size()), IC = cs.IC, OC = cs.OC;
      int64_t M = 0;
      for (int64_t r : cs.rows) M += r;
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(IC);
      CAPTURE(OC);
      CAPTURE(M);
      auto x = input(size_t(M * IC), 41, 0, dt), w = input(size_t(G * OC * IC), 41, 1, dt, 0.5f);
      auto bias = input(size_t(G * OC), 41, 2, dt), g = input(size_t(M * OC), 41, 3, dt);
      auto gx = to_device(*gpu, x, {M, IC}, dt), gw = to_device(*gpu, w, {G, OC, IC}, dt);
      auto gb = to_device(*gpu, bias, {G, OC}, dt), gg = to_device(*gpu, g, {M, OC}, dt);

      auto gout = to_device(*gpu, std::vector<float>(size_t(M * OC), kNaN), {M, OC}, dt);
      gpu->grouped_linear_forward(gout.t, gx.t, gw.t, gb.t, cs.rows.data());
      std::vector<float> out(size_t(M * OC));
      cpu->grouped_linear_forward(as_tensor(out, {M, OC}), as_tensor(x, {M, IC}), as_tensor(w, {G, OC, IC}),
                                  as_tensor(bias, {G, OC}), cs.rows.data());
      check_close(to_host(*gpu, gout.t), out, tol_for(dt, IC, 0.5 * scale_of(IC) + 1), "grouped out");

      const auto dw0 = random_normal(w.size(), 42, 0), db0 = random_normal(bias.size(), 42, 1);
      auto gdx = to_device(*gpu, std::vector<float>(x.size(), kNaN), {M, IC}, dt);
      auto gdw = to_device(*gpu, dw0, {G, OC, IC}), gdb = to_device(*gpu, db0, {G, OC});
      gpu->grouped_linear_backward(gdx.t, gdw.t, gdb.t, gg.t, gx.t, gw.t, cs.rows.data());
      std::vector<float> dx(x.size()), dw = dw0, db = db0;
      cpu->grouped_linear_backward(as_tensor(dx, {M, IC}), as_tensor(dw, {G, OC, IC}), as_tensor(db, {G, OC}),
                                   as_tensor(g, {M, OC}), as_tensor(x, {M, IC}), as_tensor(w, {G, OC, IC}),
                                   cs.rows.data());
      int64_t max_rows = 1;
      for (int64_t r : cs.rows) max_rows = std::max(max_rows, r);
      check_close(to_host(*gpu, gdx.t), dx, tol_for(dt, OC, 0.5 * scale_of(OC)), "grouped dinp");
      const auto gdw_h = to_host(*gpu, gdw.t), gdb_h = to_host(*gpu, gdb.t);
      check_close(gdw_h, dw, tol_for(DType::F32, max_rows, scale_of(max_rows) + 1), "grouped dweight");
      check_close(gdb_h, db, tol_for(DType::F32, max_rows, scale_of(max_rows) + 1), "grouped dbias");
      // A group without rows leaves its gradients exactly as they were.
      for (int64_t e = 0; e < G; ++e) {
        if (cs.rows[size_t(e)] != 0) continue;
        CAPTURE(e);
        CHECK(group(gdw_h, e, OC * IC) == group(dw0, e, OC * IC));
        CHECK(group(gdb_h, e, OC) == group(db0, e, OC));
      }
    }
  }
  auto x = zeros(*gpu, {4, 3}), w = zeros(*gpu, {2, 5, 3}), o = zeros(*gpu, {4, 5});
  const int64_t bad[] = {3, 2};
  CHECK_THROWS_WITH_AS(gpu->grouped_linear_forward(o.t, x.t, w.t, Tensor(), bad), doctest::Contains("groups hold"),
                       Error);
}
