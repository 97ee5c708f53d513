// AdamW and gradient clipping.
#include "lib/optim/adamw.h"

#include <cmath>
#include <sstream>

namespace mpigpt {

std::set<ParamKind> parse_no_decay(const std::string& list) {
  std::set<ParamKind> kinds;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty() || item == "none") continue;
    if (item == "norms") kinds.insert(ParamKind::Norm);
    else if (item == "biases") kinds.insert(ParamKind::Bias);
    else if (item == "embeddings") kinds.insert(ParamKind::Embedding);
    else if (item == "weights") kinds.insert(ParamKind::Weight);
    else fail("training.no_decay: '{}' is not a parameter kind; use a comma list of norms, biases, embeddings, weights (or none)", item);
  }
  return kinds;
}

AdamW::AdamW(Ops& ops, const std::vector<ParamInfo>& table, Tensor params, Tensor grads, const AdamWConfig& cfg)
    : ops_(ops), params_(params), grads_(grads), cfg_(cfg),
      m_(ops, params.nbytes()), v_(ops, params.nbytes()) {
  MPIGPT_CHECK(params.numel() == grads.numel(), "params {} grads {}", params.numel(), grads.numel());
  for (const auto& p : table) {
    const bool decay = !cfg.no_decay.count(p.kind);
    if (!ranges_.empty() && ranges_.back().decay == decay && ranges_.back().begin + ranges_.back().count == p.offset)
      ranges_.back().count += p.numel();
    else
      ranges_.push_back({p.offset, p.numel(), decay});
  }
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  for (const auto& r : ranges_) {
    ops_.adamw(params_.flat_slice(r.begin, r.count), grads_.flat_slice(r.begin, r.count),
               m().flat_slice(r.begin, r.count), v().flat_slice(r.begin, r.count), lr, cfg_.beta1, cfg_.beta2,
               cfg_.eps, r.decay ? cfg_.weight_decay : 0.0f, step_, grad_scale);
  }
}

double grad_norm(Ops& ops, Tensor grads) { return std::sqrt(ops.sum_squares(grads)); }

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0f;
  return float(max_norm / (norm + 1e-6));
}

}  // namespace mpigpt
