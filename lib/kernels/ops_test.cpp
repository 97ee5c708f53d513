// Tests of the ops' fronts: the contract checks every backend gets, and the per-op timing.
#include "lib/kernels/ops.h"

#include <doctest/doctest.h>

#include "lib/core/error.h"
#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("ops profiling counts calls per op by name, largest time first, outermost ops only") {
  auto cpu = make_cpu_ops();
  const int64_t N = 64, IC = 96, OC = 128;
  auto x = random_normal(size_t(N * IC), 7, 0);
  auto w = random_normal(size_t(OC * IC), 7, 1);
  auto b = random_normal(size_t(OC), 7, 2);
  std::vector<float> y(size_t(N * OC)), res(size_t(N * OC), 1.0f);
  const Tensor ty = as_tensor(y, {N, OC}), tx = as_tensor(x, {N, IC}), tw = as_tensor(w, {OC, IC}),
               tb = as_tensor(b, {OC});
  cpu->linear_forward(ty, tx, tw, tb);  // not profiling yet
  CHECK(cpu->op_times().empty());

  cpu->profile_ops(true);
  for (int rep = 0; rep < 3; ++rep) cpu->linear_forward(ty, tx, tw, tb);
  const double s = cpu->sum(as_tensor(y, {N * OC}));
  CHECK(s == cpu->sum(as_tensor(y, {N * OC})));  // values pass through
  // The CPU runs the fused op as linear_forward then add: counted as the one op the caller called.
  cpu->linear_residual_forward(as_tensor(y, {N, OC}), tx, tw, tb, as_tensor(res, {N, OC}));
  const auto r = cpu->op_times();
  REQUIRE(r.size() == 3);
  for (size_t i = 1; i < r.size(); ++i) CHECK(r[i - 1].seconds >= r[i].seconds);
  for (const OpTime& t : r) {
    CAPTURE(t.op);
    CHECK(t.seconds > 0.0);
    CHECK(t.calls == (t.op == "linear_forward" ? 3 : t.op == "sum" ? 2 : 1));
    CHECK((t.op == "linear_forward" || t.op == "sum" || t.op == "linear_residual_forward"));
  }
  cpu->profile_ops(true);  // starts again
  CHECK(cpu->op_times().empty());
  cpu->profile_ops(false);
  cpu->scale(as_tensor(y, {N * OC}), 2.0f);
  CHECK(cpu->op_times().empty());
}

TEST_CASE("ops fronts check each call's contract for every backend, naming the op and the argument") {
  auto cpu = make_cpu_ops();
  std::vector<float> a(8), b(8), c(6), two(2);
  const Tensor ta = as_tensor(a, {2, 4}), tb = as_tensor(b, {2, 4});
  // A dtype the backend does not compute in, an undefined required tensor, a mismatched shape.
  const Tensor bf16(a.data(), Shape{2, 4}, DType::BF16, Device::CPU);
  CHECK_THROWS_WITH_AS(cpu->add(ta, ta, bf16), doctest::Contains("add: the data tensors of one call share one dtype"),
                       Error);
  CHECK_THROWS_WITH_AS(cpu->add(bf16, bf16, bf16),
                       doctest::Contains("add: out is bf16(2, 4), a dtype this backend does not compute in"), Error);
  CHECK_THROWS_WITH_AS(cpu->gelu_forward(Tensor(), ta),
                       doctest::Contains("gelu_forward: out is required but undefined"), Error);
  CHECK_THROWS_WITH_AS(cpu->add(ta, tb, as_tensor(c, {6})), doctest::Contains("differ in element count"), Error);
  // A device tensor handed to the CPU backend.
  const Tensor on_gpu(a.data(), Shape{2, 4}, DType::F32, Device::CUDA);
  CHECK_THROWS_WITH_AS(cpu->scale(on_gpu, 2.0f), doctest::Contains("scale: t f32(2, 4) lives in device memory"),
                       Error);
  // i32 where i32 is asked for, f32 where f32 is.
  CHECK_THROWS_WITH_AS(cpu->gather_rows(ta, tb, as_tensor(two, {2})),
                       doctest::Contains("gather_rows: index must be i32"), Error);
  CHECK_THROWS_WITH_AS(cpu->adamw(ta, tb, ta, tb, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 0, 1.0f),
                       doctest::Contains("adamw: step must be >= 1"), Error);
}
