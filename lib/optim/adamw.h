// AdamW over a model's flat parameter buffer: fp32 moments, decoupled weight decay applied per
// parameter kind (by default not to norms, biases and embeddings), bias correction, and
// clipping by the global gradient norm.
#pragma once
#include <cstdint>
#include <set>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/kernels/ops.h"
#include "lib/model/params.h"

namespace mpigpt {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  std::set<ParamKind> no_decay = {ParamKind::Norm, ParamKind::Bias, ParamKind::Embedding};
};

// Parse "norms,biases,embeddings" (any subset, or "none") into parameter kinds.
std::set<ParamKind> parse_no_decay(const std::string& list);

class AdamW {
 public:
  // The optimizer updates `params` (flat) from `grads` (flat); `table` says which ranges decay.
  AdamW(Ops& ops, const std::vector<ParamInfo>& table, Tensor params, Tensor grads, const AdamWConfig& cfg);
  // One step at learning rate lr; gradients are multiplied by grad_scale first (clipping).
  void step(float lr, float grad_scale);
  int64_t steps() const { return step_; }
  Tensor m() const { return m_.tensor({params_.numel()}); }
  Tensor v() const { return v_.tensor({params_.numel()}); }

 private:
  struct Range {
    int64_t begin, count;
    bool decay;
  };
  Ops& ops_;
  Tensor params_, grads_;
  AdamWConfig cfg_;
  Buffer m_, v_;
  std::vector<Range> ranges_;  // maximal runs of parameters with the same decay flag
  int64_t step_ = 0;
};

// sqrt of the sum of squares of the gradients, and the factor that clips them to max_norm
// (1 when max_norm is 0 or the norm is below it).
double grad_norm(Ops& ops, Tensor grads);
float clip_scale(double norm, double max_norm);

}  // namespace mpigpt
