// GPU tests (label gpu) of the CUDA backend's fused ops against the CPU backend, whose versions are
// the separate ops in turn: linear + GELU, the projection's backward with GELU's, and the residual add
// fused into LayerNorm/RMSNorm.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_matmul_testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

// bf16 takes cuBLASLt's GELU_AUX_BIAS (forward) and DGELU (backward) epilogues where they apply, f32
// and the rest the product and the GELU kernel. Tolerances (the reasoning of cuda_matmul_testing.h
// and cuda_norm_test.cpp):
//  - f32: the GELU ops run the two f32 kernels, so they differ from the CPU only in summation order
//    (atol 5e-7 sqrt(K) scale, rtol 1e-5), plus the GELU kernel's few ulps (covered by rtol).
//  - bf16: the GPU rounds its result once to bf16 (2^-8 relative), and where the epilogue runs its
//    GELU is evaluated from the fp32 accumulator, not from a rounded pre-activation: atol/rtol 1e-2
//    (atol at the output's scale, for elements that cancel to near zero).
//  - The residual norms must equal the GPU's own add followed by its norm bit for bit (the kernel
//    rounds the sum as the add op does, then normalises the stored sum), and the CPU's in f32 to
//    the norm tests' 1e-5.

const float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Dims {
  int64_t N, IC, OC;
};
// OC % 8 == 0 takes the epilogue in bf16; {15, 7, 9} and {33, 17, 42} take the two kernels.
const Dims kDims[] = {{64, 96, 256}, {33, 17, 40}, {15, 7, 9}, {33, 17, 42}, {256, 128, 512}, {1, 8, 8}};

}  // namespace

TEST_CASE("cuda linear_gelu_forward matches the CPU's linear then GELU, with and without bias, f32 and bf16") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const bool tuned = gemm_tuning_subcases(*gpu);
  for (DType dt : {DType::F32, DType::BF16}) {
    for (Dims d : kDims) {
      for (bool with_bias : {true, false}) {
        const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
        CAPTURE(dtype);
        CAPTURE(d.N);
        CAPTURE(d.IC);
        CAPTURE(d.OC);
        CAPTURE(with_bias);
        // Pre-activations of O(1) (weights 1/sqrt(IC)) so that GELU's curved part is exercised.
        auto x = input(size_t(d.N * d.IC), 41, 0, dt), w = input(size_t(d.OC * d.IC), 41, 1, dt, 1.0f / std::sqrt(float(d.IC)));
        auto bias = input(size_t(d.OC), 41, 2, dt, 0.5f);
        const Tensor cb = with_bias ? as_tensor(bias, {d.OC}) : Tensor();
        std::vector<float> out(size_t(d.N * d.OC)), pre(out.size());
        cpu->linear_gelu_forward(as_tensor(out, {d.N, d.OC}), as_tensor(pre, {d.N, d.OC}), as_tensor(x, {d.N, d.IC}),
                                 as_tensor(w, {d.OC, d.IC}), cb);
        auto gx = to_device(*gpu, x, {d.N, d.IC}, dt), gw = to_device(*gpu, w, {d.OC, d.IC}, dt);
        auto gb = to_device(*gpu, bias, {d.OC}, dt);
        auto gout = to_device(*gpu, std::vector<float>(out.size(), kNaN), {d.N, d.OC}, dt);
        auto gpre = to_device(*gpu, std::vector<float>(out.size(), kNaN), {d.N, d.OC}, dt);
        gpu->linear_gelu_forward(gout.t, gpre.t, gx.t, gw.t, with_bias ? gb.t : Tensor());
        const Tol tol = tol_for(dt, d.IC, 1.5);
        check_close(to_host(*gpu, gpre.t), pre, tol, "pre");
        check_close(to_host(*gpu, gout.t), out, tol, "out");

        // In bf16 with OC % 8 == 0 the epilogue must have run: its GELU reads the fp32 accumulator,
        // so some outputs differ from GELU of the rounded pre-activation (the two-kernel path).
        if (dt == DType::BF16 && d.OC % 8 == 0 && d.N * d.OC >= 1000) {
          auto split = zeros(*gpu, {d.N, d.OC}, dt);
          gpu->gelu_forward(split.t, gpre.t);
          CHECK_MESSAGE(to_host(*gpu, split.t) != to_host(*gpu, gout.t),
                        "the GELU epilogue did not run (the result equals the two-kernel path)");
        }
      }
    }
  }
  CHECK((tuned_products(*gpu) > 0) == tuned);
  auto x = zeros(*gpu, {4, 5}), w = zeros(*gpu, {3, 5}), o = zeros(*gpu, {4, 3}), p = zeros(*gpu, {4, 2});
  CHECK_THROWS_WITH_AS(gpu->linear_gelu_forward(o.t, p.t, x.t, w.t, Tensor()), doctest::Contains("pre"), Error);
  auto p16 = zeros(*gpu, {4, 3}, DType::BF16);
  CHECK_THROWS_WITH_AS(gpu->linear_gelu_forward(o.t, p16.t, x.t, w.t, Tensor()), doctest::Contains("dtype"), Error);
}

TEST_CASE("cuda linear_backward_gelu matches the CPU: dpre overwrites, dweight and dbias accumulate in f32") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const bool tuned = gemm_tuning_subcases(*gpu);
  for (DType dt : {DType::F32, DType::BF16}) {
    // The projection (OC outputs) whose input act = gelu(pre) has IC features: the epilogue needs
    // IC % 8 == 0.
    for (Dims d : kDims) {
      const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
      CAPTURE(dtype);
      CAPTURE(d.N);
      CAPTURE(d.IC);
      CAPTURE(d.OC);
      auto pre = input(size_t(d.N * d.IC), 51, 0, dt, 1.5f), act = input(pre.size(), 51, 1, dt);
      auto w = input(size_t(d.OC * d.IC), 51, 2, dt), g = input(size_t(d.N * d.OC), 51, 3, dt);
      auto dw0 = random_normal(w.size(), 52, 0), db0 = random_normal(size_t(d.OC), 52, 1);
      auto gpre = to_device(*gpu, pre, {d.N, d.IC}, dt), gact = to_device(*gpu, act, {d.N, d.IC}, dt);
      auto gw = to_device(*gpu, w, {d.OC, d.IC}, dt), gg = to_device(*gpu, g, {d.N, d.OC}, dt);
      auto gdpre = to_device(*gpu, std::vector<float>(pre.size(), kNaN), {d.N, d.IC}, dt);
      auto gdw = to_device(*gpu, dw0, {d.OC, d.IC}), gdb = to_device(*gpu, db0, {d.OC});
      std::vector<float> dpre(pre.size(), kNaN), dw = dw0, db = db0;
      for (int pass = 0; pass < 2; ++pass) {  // two micro-batches: the gradients add up twice
        CAPTURE(pass);
        gpu->linear_backward_gelu(gdpre.t, gdw.t, gdb.t, gg.t, gact.t, gw.t, gpre.t);
        cpu->linear_backward_gelu(as_tensor(dpre, {d.N, d.IC}), as_tensor(dw, {d.OC, d.IC}), as_tensor(db, {d.OC}),
                                  as_tensor(g, {d.N, d.OC}), as_tensor(act, {d.N, d.IC}), as_tensor(w, {d.OC, d.IC}),
                                  as_tensor(pre, {d.N, d.IC}));
        const double scale = std::sqrt(double(d.OC));
        check_close(to_host(*gpu, gdpre.t), dpre, tol_for(dt, d.OC, scale), "dpre");
        const double gscale = 2 * std::sqrt(double(d.N)) + 1;
        check_close(to_host(*gpu, gdw.t), dw, tol_for(DType::F32, d.N, gscale), "dweight");
        check_close(to_host(*gpu, gdb.t), db, tol_for(DType::F32, d.N, gscale), "dbias");
      }
    }
  }
  CHECK((tuned_products(*gpu) > 0) == tuned);
  auto g = zeros(*gpu, {4, 3}), w = zeros(*gpu, {3, 5}), p = zeros(*gpu, {4, 5}), bad = zeros(*gpu, {4, 4});
  CHECK_THROWS_WITH_AS(gpu->linear_backward_gelu(p.t, Tensor(), Tensor(), g.t, Tensor(), w.t, bad.t),
                       doctest::Contains("pre"), Error);
}

TEST_CASE("cuda residual norms equal the GPU's add then norm bit for bit and the CPU's in f32, sum aliasing a or b") {
  auto gpu = cuda_ops_or_skip();
  auto cpu = make_cpu_ops();
  const float eps = 1e-5f;
  struct Shape2 {
    int64_t N, C;
  };
  for (bool layer : {true, false}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (Shape2 s : {Shape2{37, 768}, Shape2{5, 13}, Shape2{64, 2048}}) {
        for (int alias = 0; alias < 3; ++alias) {  // sum separate, sum == a, sum == b
          CAPTURE(layer);
          const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
          CAPTURE(dtype);
          CAPTURE(s.N);
          CAPTURE(s.C);
          CAPTURE(alias);
          const int64_t N = s.N, C = s.C;
          auto a = input(size_t(N * C), 61, 0, dt, 2.0f, 3.0f), b = input(a.size(), 61, 1, dt);
          auto w = input(size_t(C), 61, 2, dt, 0.5f, 1.0f), bias = input(size_t(C), 61, 3, dt);
          auto ga = to_device(*gpu, a, {N, C}, dt), gb = to_device(*gpu, b, {N, C}, dt);
          auto gw = to_device(*gpu, w, {C}, dt), gbias = to_device(*gpu, bias, {C}, dt);
          auto gsum = zeros(*gpu, {N, C}, dt), gout = zeros(*gpu, {N, C}, dt);
          auto gmean = zeros(*gpu, {N}), grstd = zeros(*gpu, {N});
          Tensor sum = alias == 0 ? gsum.t : alias == 1 ? ga.t : gb.t;
          if (layer)
            gpu->residual_layernorm_forward(sum, gout.t, gmean.t, grstd.t, ga.t, gb.t, gw.t, gbias.t, eps);
          else
            gpu->residual_rmsnorm_forward(sum, gout.t, grstd.t, ga.t, gb.t, gw.t, eps);
          auto got_sum = to_host(*gpu, sum), got_out = to_host(*gpu, gout.t);
          auto got_rstd = to_host(*gpu, grstd.t), got_mean = to_host(*gpu, gmean.t);

          // The GPU's separate ops on fresh copies of the inputs.
          auto ra = to_device(*gpu, a, {N, C}, dt), rb = to_device(*gpu, b, {N, C}, dt);
          auto rsum = zeros(*gpu, {N, C}, dt), rout = zeros(*gpu, {N, C}, dt);
          auto rmean = zeros(*gpu, {N}), rrstd = zeros(*gpu, {N});
          gpu->add(rsum.t, ra.t, rb.t);
          if (layer)
            gpu->layernorm_forward(rout.t, rmean.t, rrstd.t, rsum.t, gw.t, gbias.t, eps);
          else
            gpu->rmsnorm_forward(rout.t, rrstd.t, rsum.t, gw.t, eps);
          CHECK(got_sum == to_host(*gpu, rsum.t));
          CHECK(got_out == to_host(*gpu, rout.t));
          CHECK(got_rstd == to_host(*gpu, rrstd.t));
          if (layer) CHECK(got_mean == to_host(*gpu, rmean.t));

          if (dt != DType::F32) continue;
          std::vector<float> sum_c(a.size()), out_c(a.size()), mean_c(static_cast<size_t>(N)), rstd_c(static_cast<size_t>(N));
          if (layer)
            cpu->residual_layernorm_forward(as_tensor(sum_c, {N, C}), as_tensor(out_c, {N, C}), as_tensor(mean_c, {N}),
                                            as_tensor(rstd_c, {N}), as_tensor(a, {N, C}), as_tensor(b, {N, C}),
                                            as_tensor(w, {C}), as_tensor(bias, {C}), eps);
          else
            cpu->residual_rmsnorm_forward(as_tensor(sum_c, {N, C}), as_tensor(out_c, {N, C}), as_tensor(rstd_c, {N}),
                                          as_tensor(a, {N, C}), as_tensor(b, {N, C}), as_tensor(w, {C}), eps);
          CHECK(got_sum == sum_c);  // one f32 addition on both sides
          check_close(got_out, out_c, {1e-5, 1e-5}, "out");
          check_close(got_rstd, rstd_c, {1e-6, 1e-5}, "rstd");
        }
      }
    }
  }
  auto a = zeros(*gpu, {4, 8}), b = zeros(*gpu, {4, 6}), o = zeros(*gpu, {4, 8}), w = zeros(*gpu, {8});
  auto r = zeros(*gpu, {4});
  CHECK_THROWS_WITH_AS(gpu->residual_rmsnorm_forward(o.t, o.t, r.t, a.t, b.t, w.t, 1e-5f),
                       doctest::Contains("residual_rmsnorm_forward: b"), Error);
}
