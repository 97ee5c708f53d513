// Argument checks that do not depend on the backend (shapes and host arrays only), shared by the
// CPU and CUDA implementations of an op so that both refuse the same calls with the same message.
#pragma once
#include <cstdint>

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

}  // namespace mpigpt
