// One process: the bucket plan of the data-parallel buffer (alignment, dp divisibility, whole
// parameters in order, buckets formed from the last parameter backwards), range algebra,
// ownership, memory accounting, and GradSync on a group of one rank doing nothing.
#include "parallel/data_parallel.h"

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace mpigpt;

namespace {

int64_t param_sum(const BufferLayout& L, int first, int last) {
  int64_t s = 0;
  for (int p = first; p <= last; ++p) s += L.numels[p];
  return s;
}

// Every property plan_buffer promises, for one input.
void check_plan(const std::vector<int64_t>& numels, int64_t bucket_elems, int dp, int64_t align) {
  CAPTURE(bucket_elems);
  CAPTURE(dp);
  CAPTURE(align);
  const BufferLayout L = plan_buffer(numels, bucket_elems, dp, align);
  const int n = int(numels.size());
  REQUIRE(L.offsets.size() == numels.size());
  CHECK(L.numels == numels);
  if (n == 0) {
    CHECK(L.buckets.empty());
    CHECK(L.total == 0);
    return;
  }
  REQUIRE(!L.buckets.empty());
  for (int p = 0; p < n; ++p) {
    CHECK(L.offsets[p] % align == 0);
    if (p > 0) CHECK(L.offsets[p] >= L.offsets[p - 1] + numels[p - 1]);  // in order, never overlapping
  }
  int next_param = 0;
  int64_t at = 0;
  for (size_t b = 0; b < L.buckets.size(); ++b) {
    const Bucket& k = L.buckets[b];
    CAPTURE(b);
    CHECK(k.begin == at);  // buckets tile the buffer
    CHECK(k.first_param == next_param);
    CHECK(k.last_param >= k.first_param);
    CHECK(k.numel() % (int64_t(dp) * align) == 0);
    CHECK((k.numel() > 0 || param_sum(L, 0, n - 1) == 0));  // no bucket of nothing but padding
    for (int p = k.first_param; p <= k.last_param; ++p) {  // every parameter whole inside its bucket
      CHECK(L.offsets[p] >= k.begin);
      CHECK(L.offsets[p] + numels[p] <= k.end);
    }
    // only the padding needed: the last parameter ends within one dp * align block of the end
    CHECK(k.end - (L.offsets[k.last_param] + numels[k.last_param]) < int64_t(dp) * align);
    if (bucket_elems > 0) {
      // formed backwards: a bucket closes at the first parameter that makes it reach bucket_elems,
      // so without its first parameter it is below the target; only the first bucket (what was
      // left at the front) may be below the target as a whole
      int f = k.first_param;  // empty parameters left at the front join the first bucket
      while (f < k.last_param && numels[f] == 0) ++f;
      CHECK(param_sum(L, f + 1, k.last_param) < bucket_elems);
      if (b > 0) CHECK(param_sum(L, k.first_param, k.last_param) >= bucket_elems);
    }
    for (int r = 0; r < dp; ++r) {  // equal, aligned, consecutive slices
      const Range s = L.slice(int(b), r);
      CHECK(s.size() * dp == k.numel());
      CHECK(s.begin % align == 0);
      CHECK(s.begin == k.begin + r * s.size());
    }
    next_param = k.last_param + 1;
    at = k.end;
  }
  CHECK(next_param == n);
  CHECK(at == L.total);
  if (bucket_elems <= 0) CHECK(L.buckets.size() == 1);
}

}  // namespace

TEST_CASE("plan_buffer: buckets form from the last parameter backwards, padded to dp * align") {
  SUBCASE("a worked example") {
    // {10,10,10,10,10} in buckets of 20: forming backwards gives [3,4] [1,2] [0]; forwards would
    // have given [0,1] [2,3] [4]
    BufferLayout L = plan_buffer({10, 10, 10, 10, 10}, 20, 1, 1);
    REQUIRE(L.buckets.size() == 3);
    CHECK(L.buckets[0].first_param == 0);
    CHECK(L.buckets[0].last_param == 0);
    CHECK(L.buckets[1].first_param == 1);
    CHECK(L.buckets[2].first_param == 3);
    CHECK(L.offsets == std::vector<int64_t>{0, 10, 20, 30, 40});
    CHECK(L.total == 50);
    // dp 2, align 4: parameters start on multiples of 4, buckets end on multiples of 8
    L = plan_buffer({10, 10, 10, 10, 10}, 20, 2, 4);
    CHECK(L.offsets == std::vector<int64_t>{0, 16, 28, 40, 52});
    CHECK(L.buckets[0].end == 16);
    CHECK(L.buckets[1].end == 40);
    CHECK(L.total == 64);
    CHECK(L.param_ranges() == std::vector<Range>{{0, 10}, {16, 26}, {28, 38}, {40, 50}, {52, 62}});
  }
  SUBCASE("edge cases") {
    const BufferLayout big = plan_buffer({100, 7, 300}, 50, 4, 16);  // a big parameter is a bucket of its own
    REQUIRE(big.buckets.size() == 2);
    CHECK(big.buckets[1].first_param == 2);
    CHECK(big.buckets[0].last_param == 1);
    const BufferLayout one = plan_buffer({5, 6, 7}, 0, 2, 16);         // no bucket size: one bucket
    CHECK(one.buckets.size() == 1);
    CHECK(one.total == 64);
    const BufferLayout zeros = plan_buffer({0, 0, 30}, 10, 1, 16);     // no bucket of zero elements
    REQUIRE(zeros.buckets.size() == 1);
    CHECK(zeros.buckets[0].first_param == 0);
    CHECK(plan_buffer({}, 10, 4, 16).total == 0);
    CHECK_THROWS_WITH_AS(plan_buffer({1}, 10, 0, 16), doctest::Contains("dp 0"), Error);
    check_plan({0, 0, 30}, 10, 3, 16);
    check_plan({30, 0, 0}, 10, 3, 16);
  }
  SUBCASE("random tables") {
    std::mt19937_64 rng(7);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<int64_t> numels(rng() % 20);
      for (auto& x : numels) x = rng() % 5 == 0 ? int64_t(rng() % 3) : int64_t(rng() % 2000);
      const int64_t bucket = int64_t(rng() % 3000) - 100;
      const int dp = 1 + int(rng() % 8);
      check_plan(numels, bucket, dp, rng() % 2 ? 16 : 1);
    }
  }
}

TEST_CASE("ranges: normalise, intersect (against a brute-force bitmap)") {
  CHECK(normalize_ranges({{5, 8}, {0, 2}, {2, 3}, {7, 9}, {4, 4}}) == std::vector<Range>{{0, 3}, {5, 9}});
  CHECK(intersect_ranges({{0, 10}, {20, 30}}, {{5, 25}}) == std::vector<Range>{{5, 10}, {20, 25}});
  CHECK(intersect_ranges({{0, 10}}, {}).empty());
  CHECK(total_size({{0, 3}, {5, 9}}) == 7);
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 200; ++trial) {
    auto random_list = [&] {
      std::vector<Range> r(rng() % 6);
      for (auto& x : r) {
        x.begin = int64_t(rng() % 60);
        x.end = x.begin + int64_t(rng() % 15);
      }
      return r;
    };
    const std::vector<Range> a = random_list(), b = random_list(), c = intersect_ranges(a, b);
    std::vector<int> in_a(80, 0), in_b(80, 0), in_c(80, 0);
    for (const Range& x : a) for (int64_t i = x.begin; i < x.end; ++i) in_a[i] = 1;
    for (const Range& x : b) for (int64_t i = x.begin; i < x.end; ++i) in_b[i] = 1;
    for (const Range& x : c) for (int64_t i = x.begin; i < x.end; ++i) in_c[i] += 1;
    for (int i = 0; i < 80; ++i) CHECK(in_c[i] == (in_a[i] & in_b[i]));
    CHECK(c == normalize_ranges(c));
  }
}

TEST_CASE("ownership: the whole buffer, or one slice of every bucket per rank") {
  const BufferLayout L = plan_buffer({37, 100, 5, 64, 300, 17, 1, 250}, 96, 4, 16);
  CHECK(owned_ranges(L, false, 2) == std::vector<Range>{{0, L.total}});
  std::vector<int> owner(L.total, 0);
  int64_t size0 = -1;
  for (int r = 0; r < 4; ++r) {
    const std::vector<Range> own = owned_ranges(L, true, r);
    CHECK(own.size() == L.buckets.size());
    if (size0 < 0) size0 = total_size(own);
    CHECK(total_size(own) == size0);
    for (const Range& x : own) for (int64_t i = x.begin; i < x.end; ++i) ++owner[i];
  }
  for (int64_t i = 0; i < L.total; ++i) CHECK(owner[i] == 1);  // every element exactly one owner
  CHECK(owned_ranges(plan_buffer({37, 100}, 96, 1, 16), true, 0) == std::vector<Range>{{0, 160}});
}

TEST_CASE("memory per rank: 4 + 4 + 8 bytes per parameter, 4 + 4 + 8/dp with the distributed optimizer") {
  // GPT-2 small (124M): the padded token and position embeddings, 12 blocks, the final norm
  const int64_t C = 768;
  std::vector<int64_t> numels = {50304 * C, 1024 * C};
  for (int l = 0; l < 12; ++l)
    for (int64_t n : {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C}) numels.push_back(n);
  numels.push_back(C);
  numels.push_back(C);
  int64_t P = 0;
  for (int64_t n : numels) P += n;
  for (int dp : {1, 2, 4}) {
    const BufferLayout L = plan_buffer(numels, int64_t(1) << 22, dp);
    CHECK(double(L.total - P) / double(P) < 1e-4);  // the padding is negligible
    const DpMemory ddp = dp_memory(L, false, dp - 1), dist = dp_memory(L, true, dp - 1);
    CHECK(ddp.optimizer == 8 * P);
    CHECK(ddp.total() == doctest::Approx(16.0 * double(P)).epsilon(1e-4));
    CHECK(dist.params == 4 * L.total);
    CHECK(dist.grads == 4 * L.total);
    CHECK(dist.total() == doctest::Approx((8.0 + 8.0 / dp) * double(P)).epsilon(1e-3));
    int64_t state = 0;  // the ranks' states together are exactly one copy
    for (int r = 0; r < dp; ++r) state += dp_memory(L, true, r).optimizer;
    CHECK(state == 8 * P);
  }
}

TEST_CASE("GradSync on one rank: no communication, gradients and parameters untouched") {
  Comm self(MPI_COMM_SELF);
  const BufferLayout L = plan_buffer({37, 100, 5, 64}, 64, 1, 16);
  std::vector<float> p(L.total, 1.5f), g(L.total, 2.5f);
  for (bool dist : {false, true}) {
    GradSync gs(self, L, Tensor(p.data(), {L.total}), Tensor(g.data(), {L.total}), {dist, true, true});
    CHECK(gs.owned_ranges() == std::vector<Range>{{0, L.total}});
    gs.grads_ready(0, L.total);
    gs.finish_grad_sync();
    gs.gather_params();
    gs.wait_params(0, 10);
    gs.wait_all_params();
    CHECK(self.stats().calls == 0);
    CHECK(g == std::vector<float>(L.total, 2.5f));
    CHECK(p == std::vector<float>(L.total, 1.5f));
    CHECK_THROWS_WITH_AS(gs.grads_ready(0, L.total + 1), doctest::Contains("outside the buffer"), Error);
  }
  const BufferLayout L2 = plan_buffer({37, 100}, 64, 2, 16);
  std::vector<float> p2(L2.total), g2(L2.total);
  CHECK_THROWS_WITH_AS(
      GradSync(self, L2, Tensor(p2.data(), {L2.total}), Tensor(g2.data(), {L2.total}), {true, false, false}),
      doctest::Contains("planned for dp 2 but the group has 1"), Error);
  CHECK_THROWS_WITH_AS(GradSync(self, L2, Tensor(p2.data(), {10}), Tensor(g2.data(), {L2.total}), {}),
                       doctest::Contains("layout's"), Error);
}
