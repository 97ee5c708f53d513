// Four ranks: every Comm operation against the values it must produce, blocking and
// non-blocking, out of place and in place, and the byte counters that measure communication
// volume.
#include "parallel/comm.h"

#include <doctest/doctest.h>

#include <numeric>
#include <vector>

using namespace mpigpt;

namespace {
Tensor f32(std::vector<float>& v) { return Tensor(v.data(), {int64_t(v.size())}); }
Tensor i32(std::vector<int32_t>& v) { return Tensor(v.data(), {int64_t(v.size())}, DType::I32); }
}  // namespace

TEST_CASE("collectives produce the sums, gathers and exchanges they promise") {
  Comm c(MPI_COMM_WORLD);
  REQUIRE(c.size() == 4);
  const int r = c.rank(), P = c.size();

  SUBCASE("all-reduce sum and max, blocking and non-blocking") {
    std::vector<float> a = {float(r), float(10 * r)};
    c.allreduce_sum(f32(a));
    CHECK(a == std::vector<float>{6, 60});
    std::vector<float> m = {float(r), float(-r)};
    c.allreduce_max(f32(m));
    CHECK(m == std::vector<float>{3, 0});
    std::vector<float> b = {1, 2, 3};
    Request q = c.iallreduce_sum(f32(b));
    q.wait();
    CHECK(b == std::vector<float>{4, 8, 12});
    CHECK(q.done());
  }
  SUBCASE("reduce-scatter gives rank r the sum of everyone's block r") {
    std::vector<float> inp(P * 2), out(2);
    for (int i = 0; i < P * 2; ++i) inp[i] = float(100 * r + i);
    c.reduce_scatter_sum(f32(out), f32(inp));
    // sum over ranks q of (100 q + 2r + k) = 100*6 + 4*(2r + k)
    CHECK(out[0] == float(600 + 4 * (2 * r)));
    CHECK(out[1] == float(600 + 4 * (2 * r + 1)));
  }
  SUBCASE("all-gather concatenates in rank order; reduce-scatter + all-gather = all-reduce") {
    std::vector<int32_t> inp = {r, r * r}, out(P * 2);
    c.all_gather(i32(out), i32(inp));
    CHECK(out == std::vector<int32_t>{0, 0, 1, 1, 2, 4, 3, 9});
    std::vector<float> full(P * 3), part(3), gathered(P * 3), ref(P * 3);
    for (int i = 0; i < P * 3; ++i) full[i] = ref[i] = float(r * i + 1);
    c.allreduce_sum(f32(ref));
    c.ireduce_scatter_sum(f32(part), f32(full)).wait();
    c.iall_gather(f32(gathered), f32(part)).wait();
    CHECK(gathered == ref);
  }
  SUBCASE("broadcast, ring send/recv") {
    std::vector<float> b = {float(r), 7};
    c.broadcast(f32(b), 2);
    CHECK(b == std::vector<float>{2, 7});
    std::vector<float> mine = {float(r)}, got = {-1};
    Request rq = c.irecv(f32(got), (r + P - 1) % P, 5);
    Request sq = c.isend(f32(mine), (r + 1) % P, 5);
    sq.wait();
    rq.wait();
    CHECK(got[0] == float((r + P - 1) % P));
  }
  SUBCASE("all-to-all-v with uneven counts") {
    // rank r sends (q + 1) elements of value 10 r + q to each rank q
    std::vector<int64_t> sc(P), rc(P, r + 1);
    std::vector<float> inp, out;
    for (int q = 0; q < P; ++q) {
      sc[q] = q + 1;
      for (int k = 0; k <= q; ++k) inp.push_back(float(10 * r + q));
    }
    out.assign(P * (r + 1), -1);
    c.all_to_all_v(f32(out), rc, f32(inp), sc);
    for (int q = 0; q < P; ++q)
      for (int k = 0; k <= r; ++k) CHECK(out[q * (r + 1) + k] == float(10 * q + r));
  }
}

TEST_CASE("in-place reduce-scatter and all-gather on one buffer, blocking and non-blocking") {
  Comm c(MPI_COMM_WORLD);
  const int r = c.rank(), P = c.size();
  for (bool blocking : {true, false}) {
    CAPTURE(blocking);
    std::vector<float> buf(P * 3), ref(P * 3);
    for (int i = 0; i < P * 3; ++i) buf[i] = ref[i] = float(r * i + 1);
    c.allreduce_sum(f32(ref));
    c.reset_stats();
    if (blocking) {
      c.reduce_scatter_sum_inplace(f32(buf));
    } else {
      Request q = c.ireduce_scatter_sum_inplace(f32(buf));
      while (!q.test()) {
      }
      CHECK(q.done());
    }
    for (int k = 0; k < 3; ++k) CHECK(buf[r * 3 + k] == ref[r * 3 + k]);  // block r, not block 0
    for (int i = 0; i < P * 3; ++i)
      if (i / 3 != r) buf[i] = -1;  // the other blocks are scratch; the gather must overwrite them
    if (blocking) {
      c.all_gather_inplace(f32(buf));
    } else {
      Request q = c.iall_gather_inplace(f32(buf));
      q.wait();
      CHECK(q.done());
    }
    CHECK(buf == ref);
    CHECK(c.stats().reduce_scatter == P * 3 * 4);
    CHECK(c.stats().all_gather == 3 * 4);
    CHECK(c.stats().calls == 2);
  }
  std::vector<float> odd(P * 3 + 1);
  CHECK_THROWS_WITH_AS(c.reduce_scatter_sum_inplace(f32(odd)), doctest::Contains("is not 4 equal blocks"), Error);
  CHECK_THROWS_WITH_AS(c.all_gather_inplace(f32(odd)), doctest::Contains("is not 4 equal blocks"), Error);
  Comm self(MPI_COMM_SELF);  // one rank: nothing to do, nothing counted
  std::vector<float> one = {1, 2};
  self.reduce_scatter_sum_inplace(f32(one));
  self.all_gather_inplace(f32(one));
  CHECK(one == std::vector<float>{1, 2});
  CHECK(self.stats().calls == 0);
}

TEST_CASE("byte counters record the payload of every call") {
  Comm c(MPI_COMM_WORLD);
  c.reset_stats();
  std::vector<float> a(10, 1.0f), part(4), full(16);
  c.allreduce_sum(f32(a));
  c.reduce_scatter_sum(f32(part), f32(full));
  c.all_gather(f32(full), f32(part));
  CHECK(c.stats().allreduce == 40);
  CHECK(c.stats().reduce_scatter == 64);
  CHECK(c.stats().all_gather == 16);
  CHECK(c.stats().calls == 3);
  CHECK(c.stats().total() == 120);
}

TEST_CASE("mismatched buffers are named in the error") {
  Comm c(MPI_COMM_WORLD);
  std::vector<float> small(3), out(2);
  CHECK_THROWS_WITH_AS(c.reduce_scatter_sum(f32(out), f32(small)), doctest::Contains("must hold 4 blocks"), Error);
  CHECK_THROWS_WITH_AS(c.all_gather(f32(small), f32(out)), doctest::Contains("must hold 4 blocks"), Error);
}
