#include "lib/kernels/agreement.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace mpigpt {

namespace {
double element(const void* p, size_t i, DType dt) {
  if (dt == DType::BF16) return std::bit_cast<float>(uint32_t(static_cast<const uint16_t*>(p)[i]) << 16);
  return static_cast<const float*>(p)[i];
}

// The rms of want over [begin, end), its finite elements only (0 when there are none).
double rms_of(const void* want, size_t begin, size_t end, DType dt) {
  double sum_sq = 0;
  size_t finite = 0;
  for (size_t i = begin; i < end; ++i) {
    const double w = element(want, i, dt);
    if (std::isfinite(w)) {
      sum_sq += w * w;
      ++finite;
    }
  }
  return finite ? std::sqrt(sum_sq / double(finite)) : 0.0;
}
}  // namespace

std::string Agreement::str() const {
  const std::string detail = fmt::format(
      "difference {:.3g}% of the norm; worst element {}: {:.6g} against {:.6g}, {:.3g}x its bound; rms {:.3g}",
      norm_ratio * 100, worst, got, want, ratio, rms);
  if (ok) return fmt::format("agrees ({})", detail);
  if (disagreeing > 0) return fmt::format("{} of {} elements disagree ({})", disagreeing, n, detail);
  return fmt::format("differs by {:.3g}% of the norm, over the bound {:.3g}% ({})", norm_ratio * 100,
                     norm_bound * 100, detail);
}

Agreement agreement(const void* want, const void* got, size_t n, DType dt, const AgreementBounds& bounds) {
  MPIGPT_CHECK(dt == DType::F32 || dt == DType::BF16, "agreement: dtype {} is not a floating-point type",
               dtype_name(dt));
  Agreement a;
  a.n = n;
  a.norm_bound = bounds.norm;
  a.rms = rms_of(want, 0, n, dt);
  const size_t group = bounds.group > 0 ? bounds.group : std::max<size_t>(n, 1);
  double diff_sq = 0, want_sq = 0;
  for (size_t begin = 0; begin < n; begin += group) {
    const size_t end = std::min(n, begin + group);
    const double scale = std::max(group < n ? rms_of(want, begin, end, dt) : a.rms, a.rms);
    for (size_t i = begin; i < end; ++i) {
      const double w = element(want, i, dt), g = element(got, i, dt);
      double ratio;
      if (!std::isfinite(w) || !std::isfinite(g)) {
        const bool same = (std::isnan(w) && std::isnan(g)) || w == g;
        ratio = same ? 0.0 : INFINITY;
      } else {
        const double err = std::abs(g - w), bound = bounds.element * (std::abs(w) + scale);
        ratio = err == 0.0 ? 0.0 : bound > 0.0 ? err / bound : INFINITY;
        diff_sq += err * err;
        want_sq += w * w;
      }
      if (ratio > 1.0) ++a.disagreeing;
      if (ratio > a.ratio || i == 0) {
        a.ratio = ratio;
        a.worst = i;
        a.want = w;
        a.got = g;
      }
    }
  }
  a.norm_ratio = diff_sq == 0.0 ? 0.0 : want_sq > 0.0 ? std::sqrt(diff_sq / want_sq) : INFINITY;
  a.ok = a.disagreeing == 0 && a.norm_ratio <= bounds.norm;
  return a;
}

}  // namespace mpigpt
