// Learning-rate schedule.
#include "lib/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "lib/core/error.h"

namespace mpigpt {

DecayStyle parse_decay_style(const std::string& s) {
  if (s == "cosine") return DecayStyle::Cosine;
  if (s == "linear") return DecayStyle::Linear;
  if (s == "constant") return DecayStyle::Constant;
  fail("training.lr_schedule = '{}' is not a schedule; use cosine, linear or constant", s);
}

double LrSchedule::at(int64_t it) const {
  if (warmup > 0 && it <= warmup) return peak * double(it) / double(warmup);
  if (style == DecayStyle::Constant) return peak;
  if (decay <= 0) return peak;
  const double frac = std::clamp(double(it - warmup) / double(decay), 0.0, 1.0);
  const double coeff = style == DecayStyle::Cosine ? 0.5 * (1.0 + std::cos(M_PI * frac)) : 1.0 - frac;
  return min + coeff * (peak - min);
}

}  // namespace mpigpt
