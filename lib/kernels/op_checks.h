// Argument checks that do not depend on the backend (shapes and host arrays only), shared by the
// CPU and CUDA implementations of an op so that both refuse the same calls with the same message.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "lib/core/error.h"
#include "lib/core/tensor.h"

namespace mpigpt {

// Grouped linear: weight (G,OC,IC), bias (G,OC) optional, and group_rows, a host array of G row
// counts (each >= 0) that add up to the M rows of the input.
inline void check_grouped_linear(const char* op, const Tensor& weight, const Tensor& bias, int64_t M,
                                 const int64_t* group_rows) {
  MPIGPT_CHECK(weight.ndim() == 3, "{}: weight {} must be (G,OC,IC)", op, weight.shape.str());
  MPIGPT_CHECK(!bias.defined() || bias.numel() == weight.size(0) * weight.size(1),
               "{}: bias {} must be (G,OC) for weight {}", op, bias.shape.str(), weight.shape.str());
  MPIGPT_CHECK(group_rows != nullptr, "{}: group_rows (a host array of G row counts) is required", op);
  int64_t total = 0;
  for (int64_t g = 0; g < weight.size(0); ++g) {
    MPIGPT_CHECK(group_rows[g] >= 0, "{}: group {} has {} rows", op, g, group_rows[g]);
    total += group_rows[g];
  }
  MPIGPT_CHECK(total == M, "{}: the groups hold {} rows but the input has {}", op, total, M);
}

// AdamW runs: param and grad of one length, m and v of another; every run inside them, of
// non-negative length, and no two runs sharing a parameter or a moment element.
inline void check_adamw_runs(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const std::vector<AdamWRun>& runs) {
  const char* op = "adamw_runs";
  MPIGPT_CHECK(grad.numel() == param.numel() && v.numel() == m.numel(),
               "{}: param {} and grad {} must have the same length, and m {} and v {}", op, param.str(), grad.str(),
               m.str(), v.str());
  std::vector<std::pair<int64_t, int64_t>> p, s;
  for (const AdamWRun& r : runs) {
    MPIGPT_CHECK(r.count >= 0 && r.begin >= 0 && r.state >= 0 && r.begin + r.count <= param.numel() &&
                     r.state + r.count <= m.numel(),
                 "{}: run of {} elements at {} (state {}) lies outside param {} or m {}", op, r.count, r.begin,
                 r.state, param.str(), m.str());
    if (r.count == 0) continue;
    p.emplace_back(r.begin, r.begin + r.count);
    s.emplace_back(r.state, r.state + r.count);
  }
  for (auto* ranges : {&p, &s}) {
    std::sort(ranges->begin(), ranges->end());
    for (size_t i = 1; i < ranges->size(); ++i)
      MPIGPT_CHECK((*ranges)[i - 1].second <= (*ranges)[i].first, "{}: runs overlap at [{}, {}) and [{}, {}) of {}",
                   op, (*ranges)[i - 1].first, (*ranges)[i - 1].second, (*ranges)[i].first, (*ranges)[i].second,
                   ranges == &p ? "param" : "m");
  }
}

}  // namespace mpigpt
