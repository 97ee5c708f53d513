// Learning-rate schedule: linear warmup from 0 to the peak, then cosine, linear or constant
// decay to the minimum over decay_iters, then the minimum (Megatron's OptimizerParamScheduler).
#pragma once
#include <cstdint>
#include <string>

namespace mpigpt {

enum class DecayStyle { Cosine, Linear, Constant };
DecayStyle parse_decay_style(const std::string& s);  // "cosine" | "linear" | "constant"

struct LrSchedule {
  double peak = 3e-4;
  double min = 0.0;
  int64_t warmup = 0;  // iterations of warmup
  int64_t decay = 0;   // iterations of decay after warmup
  DecayStyle style = DecayStyle::Cosine;
  // Learning rate of iteration `it` (1-based: the first optimizer step is it = 1).
  double at(int64_t it) const;
};

}  // namespace mpigpt
