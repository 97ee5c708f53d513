// Tests of Alpa's stage assignment against brute force over every split, with additive and
// arbitrary stage costs, stages that cannot hold some ranges, and the embedding/head imbalance.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>

#include "lib/core/error.h"
#include "lib/plan/stage_assign.h"

using namespace mpigpt;

namespace {

// The least time over every split of L layers into S stages (counts >= 0), by enumeration.
double brute_force(int L, int S, int m, const StageCost& cost) {
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> counts(size_t(S), 0);
  auto visit = [&](auto&& self, int s, int left) -> void {
    if (s == S - 1) {
      counts[size_t(s)] = left;
      double sum = 0, max = 0;
      for (int k = 0, first = 0; k < S; first += counts[size_t(k)], ++k) {
        const double c = cost(k, first, first + counts[size_t(k)]);
        sum += c;
        max = std::max(max, c);
      }
      best = std::min(best, sum + double(m - 1) * max);
      return;
    }
    for (int n = 0; n <= left; ++n) {
      counts[size_t(s)] = n;
      self(self, s + 1, left - n);
    }
  };
  visit(visit, 0, L);
  return best;
}

// The time of an assignment, recomputed from its counts.
double time_of(const StageAssignment& a, int m, const StageCost& cost) {
  double sum = 0, max = 0;
  for (size_t k = 0, first = 0; k < a.layers.size(); first += size_t(a.layers[k]), ++k) {
    const double c = cost(int(k), int(first), int(first) + a.layers[k]);
    sum += c;
    max = std::max(max, c);
  }
  return sum + double(m - 1) * max;
}

}  // namespace

TEST_CASE("stage assignment: the embedding and head move layers off the first and last stage") {
  // 8 equal layers of 1 s, 2 stages: with nothing beside them 4 + 4; an embedding worth 2 layers on
  // the first stage gives 3 + 5; a head worth 2 layers on the last as well gives 4 + 4 again.
  const std::vector<double> ones(8, 1.0);
  CHECK(assign_stages(8, 2, 8, additive_stage_cost(ones, 0, 0, 2)).layers == std::vector<int>{4, 4});
  CHECK(assign_stages(8, 2, 8, additive_stage_cost(ones, 2, 0, 2)).layers == std::vector<int>{3, 5});
  CHECK(assign_stages(8, 2, 8, additive_stage_cost(ones, 2, 2, 2)).layers == std::vector<int>{4, 4});
  const StageAssignment a = assign_stages(8, 4, 16, additive_stage_cost(ones, 1, 3, 4));
  CHECK(a.layers == std::vector<int>{2, 3, 3, 0});  // stage times 3, 3, 3, 3
  CHECK(a.max == 3.0);
  CHECK(a.time == 12.0 + 15 * 3.0);
}

TEST_CASE("stage assignment equals brute force over every split") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int trial = 0; trial < 60; ++trial) {
    CAPTURE(trial);
    const int L = 1 + trial % 7, S = 1 + trial % 4, m = 1 + trial % 5;
    // Arbitrary (non-additive) costs per (stage, range), some ranges too big for their stage.
    std::vector<double> table(size_t(S * (L + 1) * (L + 1)));
    for (double& c : table) c = u(rng) < 0.35 ? std::numeric_limits<double>::infinity() : u(rng);
    for (int s = 0; s < S; ++s) table[size_t((s * (L + 1) + 0) * (L + 1) + 0)] = 0.5;  // empty stages fit
    const StageCost arbitrary = [&](int s, int i, int j) { return table[size_t((s * (L + 1) + i) * (L + 1) + j)]; };
    std::vector<double> times(static_cast<size_t>(L), 0.0);
    for (double& t : times) t = u(rng);
    const StageCost additive = additive_stage_cost(times, u(rng), u(rng), S);
    for (const StageCost& cost : {arbitrary, additive}) {
      const double want = brute_force(L, S, m, cost);
      if (std::isinf(want)) {
        CHECK_THROWS_AS(assign_stages(L, S, m, cost), Error);
        continue;
      }
      const StageAssignment a = assign_stages(L, S, m, cost);
      REQUIRE(a.layers.size() == size_t(S));
      int total = 0;
      for (int n : a.layers) total += n;
      CHECK(total == L);
      CHECK(a.time == doctest::Approx(want).epsilon(1e-12));
      CHECK(time_of(a, m, cost) == doctest::Approx(a.time).epsilon(1e-12));
    }
  }
}

TEST_CASE("stage assignment says when no split fits, and checks its arguments") {
  const StageCost nothing_fits = [](int, int i, int j) { return j - i > 1 ? std::numeric_limits<double>::infinity() : 1.0; };
  CHECK_THROWS_WITH_AS(assign_stages(5, 2, 4, nothing_fits), doctest::Contains("no assignment of 5 layers to 2"), Error);
  CHECK_THROWS_AS(assign_stages(4, 0, 4, nothing_fits), Error);
  const StageCost negative = [](int, int, int) { return -1.0; };
  CHECK_THROWS_WITH_AS(assign_stages(2, 1, 1, negative), doctest::Contains("costs -1"), Error);
}
