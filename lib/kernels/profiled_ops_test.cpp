// Tests of the op profiler: it forwards every op unchanged and attributes time and calls by name.
#include "lib/kernels/profiled_ops.h"

#include <doctest/doctest.h>

#include "lib/kernels/testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

TEST_CASE("ProfiledOps gives the inner backend's results and counts calls per op, largest time first") {
  auto cpu = make_cpu_ops();
  ProfiledOps prof(*cpu);
  CHECK(prof.device() == Device::CPU);
  CHECK(prof.name() == cpu->name());
  const int64_t N = 64, IC = 96, OC = 128;
  auto x = random_normal(size_t(N * IC), 7, 0);
  auto w = random_normal(size_t(OC * IC), 7, 1);
  auto b = random_normal(size_t(OC), 7, 2);
  std::vector<float> y_prof(size_t(N * OC)), y_ref(size_t(N * OC));
  for (int rep = 0; rep < 3; ++rep)
    prof.linear_forward(as_tensor(y_prof, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), as_tensor(b, {OC}));
  cpu->linear_forward(as_tensor(y_ref, {N, OC}), as_tensor(x, {N, IC}), as_tensor(w, {OC, IC}), as_tensor(b, {OC}));
  CHECK(y_prof == y_ref);
  CHECK(prof.sum(as_tensor(y_prof, {N * OC})) == cpu->sum(as_tensor(y_ref, {N * OC})));  // values pass through
  prof.scale(as_tensor(y_prof, {N * OC}), 2.0f);
  CHECK(y_prof[5] == 2.0f * y_ref[5]);

  const auto r = prof.report();
  REQUIRE(r.size() == 3);
  for (size_t i = 1; i < r.size(); ++i) CHECK(r[i - 1].seconds >= r[i].seconds);
  for (const OpTime& t : r) {
    CHECK(t.seconds > 0.0);
    CHECK(t.calls == (t.op == "linear_forward" ? 3 : 1));
  }
  prof.reset();
  CHECK(prof.report().empty());
}
