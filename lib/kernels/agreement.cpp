#include "lib/kernels/agreement.h"

#include <fmt/format.h>

#include <bit>
#include <cmath>
#include <cstdint>

namespace mpigpt {

namespace {
double element(const void* p, size_t i, DType dt) {
  if (dt == DType::BF16) return std::bit_cast<float>(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
  return static_cast<const float*>(p)[i];
}
}  // namespace

std::string Agreement::str() const {
  const std::string worst_element =
      fmt::format("worst element {}: {:.6g} against {:.6g}, {:.3g}x the bound; rms {:.3g}", worst, got, want, ratio, rms);
  if (ok) return fmt::format("agrees ({})", worst_element);
  return fmt::format("{} of {} elements disagree ({})", disagreeing, n, worst_element);
}

Agreement agreement(const void* want, const void* got, size_t n, DType dt, double tol) {
  MPIGPT_CHECK(dt == DType::F32 || dt == DType::BF16, "agreement: dtype {} is not a floating-point type",
               dtype_name(dt));
  Agreement a;
  a.n = n;
  double sum_sq = 0;
  size_t finite = 0;
  for (size_t i = 0; i < n; ++i) {
    const double w = element(want, i, dt);
    if (std::isfinite(w)) {
      sum_sq += w * w;
      ++finite;
    }
  }
  a.rms = finite ? std::sqrt(sum_sq / double(finite)) : 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double w = element(want, i, dt), g = element(got, i, dt);
    double ratio;
    if (!std::isfinite(w) || !std::isfinite(g)) {
      const bool same = (std::isnan(w) && std::isnan(g)) || w == g;
      ratio = same ? 0.0 : INFINITY;
    } else {
      const double err = std::abs(g - w), bound = tol * (std::abs(w) + a.rms);
      ratio = err == 0.0 ? 0.0 : bound > 0.0 ? err / bound : INFINITY;
    }
    if (ratio > 1.0) ++a.disagreeing;
    if (ratio > a.ratio || i == 0) {
      a.ratio = ratio;
      a.worst = i;
      a.want = w;
      a.got = g;
    }
  }
  a.ok = a.disagreeing == 0;
  return a;
}

}  // namespace mpigpt
