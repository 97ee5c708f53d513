// Alpa's stage assignment (stage_assign.h).
#include "lib/plan/stage_assign.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/error.h"

namespace mpigpt {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The least sum of stage times over assignments whose every stage time is at most `bound`, with the
// assignment; layers empty when there is none. costs[s][i][j] = cost(s, i, j) for i <= j.
StageAssignment least_sum(const std::vector<std::vector<std::vector<double>>>& costs, int L, int S, double bound) {
  // best[s][j]: the least sum of stages 0..s-1 holding layers [0, j); from[s][j]: where stage s-1 starts.
  std::vector<std::vector<double>> best(size_t(S) + 1, std::vector<double>(size_t(L) + 1, kInf));
  std::vector<std::vector<int>> from(size_t(S) + 1, std::vector<int>(size_t(L) + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s)
    for (int j = 0; j <= L; ++j)
      for (int i = 0; i <= j; ++i) {
        const double c = costs[size_t(s - 1)][size_t(i)][size_t(j)];
        if (c > bound || best[size_t(s - 1)][size_t(i)] == kInf) continue;
        if (best[size_t(s - 1)][size_t(i)] + c < best[size_t(s)][size_t(j)]) {
          best[size_t(s)][size_t(j)] = best[size_t(s - 1)][size_t(i)] + c;
          from[size_t(s)][size_t(j)] = i;
        }
      }
  StageAssignment a;
  if (best[size_t(S)][size_t(L)] == kInf) return a;
  a.sum = best[size_t(S)][size_t(L)];
  a.layers.assign(size_t(S), 0);
  for (int s = S, j = L; s > 0; --s) {
    const int i = from[size_t(s)][size_t(j)];
    a.layers[size_t(s - 1)] = j - i;
    a.max = std::max(a.max, costs[size_t(s - 1)][size_t(i)][size_t(j)]);
    j = i;
  }
  return a;
}

}  // namespace

StageAssignment assign_stages(int num_layers, int stages, int micro_batches, const StageCost& cost) {
  if (num_layers < 0 || stages < 1 || micro_batches < 1)
    fail("assign_stages: {} layers, {} stages, {} micro-batches", num_layers, stages, micro_batches);
  const int L = num_layers, S = stages;
  std::vector<std::vector<std::vector<double>>> costs(
      size_t(S), std::vector<std::vector<double>>(size_t(L) + 1, std::vector<double>(size_t(L) + 1, kInf)));
  std::vector<double> bounds;
  for (int s = 0; s < S; ++s)
    for (int i = 0; i <= L; ++i)
      for (int j = i; j <= L; ++j) {
        const double c = cost(s, i, j);
        if (std::isnan(c) || c < 0) fail("assign_stages: stage {} over layers [{}, {}) costs {}", s, i, j, c);
        costs[size_t(s)][size_t(i)][size_t(j)] = c;
        if (c < kInf) bounds.push_back(c);
      }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  // Feasibility is monotone in the bound: find the least feasible one by bisection.
  size_t lo = 0, hi = bounds.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (least_sum(costs, L, S, bounds[mid]).layers.empty())
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == bounds.size())
    fail("no assignment of {} layers to {} pipeline stages fits: every split leaves a stage that cannot hold its "
         "layers (memory); use more stages or less memory per layer", L, S);
  // No assignment's sum is below the least sum without a bound, so none under a bound b beats
  // least + (micro_batches - 1) * b: the search ends at the first bound where that reaches the best.
  const double least = least_sum(costs, L, S, kInf).sum;
  StageAssignment best;
  best.time = kInf;
  for (size_t k = lo; k < bounds.size() && least + double(micro_batches - 1) * bounds[k] < best.time; ++k) {
    StageAssignment a = least_sum(costs, L, S, bounds[k]);
    if (a.layers.empty()) continue;
    a.time = a.sum + double(micro_batches - 1) * a.max;
    if (a.time < best.time) best = a;
  }
  return best;
}

StageCost additive_stage_cost(std::vector<double> layer_times, double embedding, double head, int stages) {
  std::vector<double> prefix(layer_times.size() + 1, 0.0);
  for (size_t l = 0; l < layer_times.size(); ++l) prefix[l + 1] = prefix[l] + layer_times[l];
  return [prefix, embedding, head, stages](int stage, int first, int end) {
    return prefix[size_t(end)] - prefix[size_t(first)] + (stage == 0 ? embedding : 0.0) +
           (stage == stages - 1 ? head : 0.0);
  };
}

}  // namespace mpigpt
