// GPU test (CTest label gpu; exits 77, skipped, without a GPU or without NCCL): a one-rank NCCL
// communicator. Every result is read after compute work queued right before and right after the
// call: the communication stream must wait for the input, the compute stream for the output.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "lib/kernels/cuda/cuda_testing.h"
#include "parallel/comm.h"
#include "parallel/comm_nccl.h"
#include "parallel/nccl_loader.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {

std::unique_ptr<Ops> ops_with_nccl() {
  std::unique_ptr<Ops> ops = cuda_ops_or_skip();
  if (const std::string e = nccl_load_error(); !e.empty()) {
    MESSAGE("NCCL cannot be loaded: skipped (" << e << ")");
    std::exit(77);
  }
  return ops;
}

std::vector<float> times(std::vector<float> v, float s) {
  for (float& x : v) x *= s;
  return v;
}

// Small integers and halves: exact in bf16.
const std::vector<float> kValues = {1, -2, 3, 4.5f, 0.5f, -8, 16, 7};

}  // namespace

// What Comm routes to NCCL at one rank: out-of-place reduce-scatter and all-gather, all-to-all-v.
TEST_CASE("NCCL, one rank: Comm's calls that reach NCCL, ordered against the compute stream") {
  std::unique_ptr<Ops> ops = ops_with_nccl();
  Comm c(MPI_COMM_SELF);
  c.use_nccl(ops->stream(), true);  // a one-rank group has no point-to-point links to make
  REQUIRE(c.uses_nccl());
  const int64_t n = int64_t(kValues.size());
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
    CAPTURE(dtype);
    SUBCASE("reduce-scatter and all-gather, blocking and not") {
      for (bool blocking : {true, false}) {
        CAPTURE(blocking);
        DeviceTensor inp = to_device(*ops, kValues, {n}, dt), mid = zeros(*ops, {n}, dt), out = zeros(*ops, {n}, dt);
        ops->scale(inp.t, 2.0f);  // queued just before: the communication stream must wait for it
        if (blocking) {
          c.reduce_scatter_sum(mid.t, inp.t);
        } else {
          Request r = c.ireduce_scatter_sum(mid.t, inp.t);
          while (!r.test()) {
          }
          CHECK(r.done());
        }
        ops->scale(mid.t, 3.0f);  // queued just after: must see the result
        if (blocking) {
          c.all_gather(out.t, mid.t);
        } else {
          Request r = c.iall_gather(out.t, mid.t);
          r.wait();
          CHECK(r.done());
        }
        ops->scale(out.t, 0.5f);
        CHECK(to_host(*ops, out.t) == times(kValues, 3.0f));
      }
    }
    SUBCASE("all-to-all-v") {
      DeviceTensor inp = to_device(*ops, kValues, {n}, dt), out = to_device(*ops, std::vector<float>(n, -1), {n}, dt);
      c.all_to_all_v(out.t, {n - 2}, inp.t, {n - 2});  // the last two elements stay as they were
      std::vector<float> want = kValues;
      want[n - 2] = want[n - 1] = -1;
      CHECK(to_host(*ops, out.t) == want);
    }
  }
  CHECK(c.stats().calls > 0);  // counted like the host path
  // The staged path again, and back.
  c.use_staging(ops->stream());
  CHECK_FALSE(c.uses_nccl());
  c.use_nccl(ops->stream(), false);
  CHECK(c.uses_nccl());
}

TEST_CASE("NCCL, one rank: a group's communicator split from its parent's (engine.nccl_init = split)") {
  std::unique_ptr<Ops> ops = ops_with_nccl();
  Comm world(MPI_COMM_SELF), group(MPI_COMM_SELF), outside(MPI_COMM_NULL);
  CHECK_THROWS_WITH_AS(group.use_nccl_split(ops->stream(), false, world),
                       doctest::Contains("has no NCCL communicator yet (use_nccl)"), Error);
  world.use_nccl(ops->stream(), false);
  outside.use_nccl_split(ops->stream(), false, world);  // takes its part in the split, gets nothing
  CHECK_FALSE(outside.uses_nccl());
  group.use_nccl_split(ops->stream(), true, world);
  REQUIRE(group.uses_nccl());
  group.use_nccl_split(ops->stream(), true, world);  // again: rebinds the stream, splits nothing
  const int64_t n = int64_t(kValues.size());
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::string dtype = dtype_name(dt);
    CAPTURE(dtype);
    DeviceTensor inp = to_device(*ops, kValues, {n}, dt), mid = zeros(*ops, {n}, dt), out = zeros(*ops, {n}, dt);
    ops->scale(inp.t, 2.0f);
    group.reduce_scatter_sum(mid.t, inp.t);
    ops->scale(mid.t, 3.0f);
    group.all_gather(out.t, mid.t);
    ops->scale(out.t, 0.5f);
    CHECK(to_host(*ops, out.t) == times(kValues, 3.0f));
  }
  CHECK(group.stats().calls == 4);
}

// Comm skips the reductions of a one-rank group, so they are called on comm_nccl.h directly.
TEST_CASE("NCCL, one rank: every collective of comm_nccl.h, in place and out of place, f32 bf16 i32") {
  std::unique_ptr<Ops> ops = ops_with_nccl();
  DeviceComm dc;
  dc.compute_stream = ops->stream();
  dc.group = nccl_comm(MPI_COMM_SELF, 0, 1);
  const int64_t n = int64_t(kValues.size());
  for (DType dt : {DType::F32, DType::BF16}) {
    const std::string dtype = dtype_name(dt);  // a string: doctest prints a char* as a pointer
    CAPTURE(dtype);
    DeviceTensor t = to_device(*ops, kValues, {n}, dt);
    ops->scale(t.t, 2.0f);
    nccl_allreduce(dc, t.t, ReduceOp::Sum).wait();
    nccl_allreduce(dc, t.t, ReduceOp::Max).wait();
    nccl_broadcast(dc, t.t, 0).wait();
    nccl_reduce_scatter(dc, t.t.flat_slice(0, n), t.t).wait();  // in place: block rank 0 of one
    nccl_all_gather(dc, t.t, t.t.flat_slice(0, n)).wait();      // in place
    Request r = nccl_allreduce(dc, t.t, ReduceOp::Sum);
    while (!r.test()) {
    }
    ops->scale(t.t, 0.5f);
    CHECK(to_host(*ops, t.t) == kValues);
  }
  DeviceTensor i = to_device(*ops, std::vector<int32_t>{3, -4, 5}, {3});
  nccl_allreduce(dc, i.t, ReduceOp::Max).wait();
  nccl_all_gather(dc, i.t, i.t).wait();
  CHECK(to_host_i32(*ops, i.t) == std::vector<int32_t>{3, -4, 5});

  // Failures name the call and NCCL's reason; point-to-point needs a link.
  DeviceTensor f = to_device(*ops, kValues, {n});
  CHECK_THROWS_WITH_AS(nccl_broadcast(dc, f.t, 3), doctest::Contains("Broadcast("), Error);
  CHECK_THROWS_WITH_AS(nccl_send(dc, f.t, 0), doctest::Contains("NCCL point-to-point runs over links"), Error);
  ops->synchronize();
}
