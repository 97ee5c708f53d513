// AdamW and gradient clipping.
#include "lib/optim/adamw.h"

#include <cmath>

namespace mpigpt {

AdamW::AdamW(Ops& ops, const std::vector<OptimParam>& table, Tensor params, Tensor grads, const AdamWConfig& cfg,
             const std::vector<Range>& owned)
    : ops_(ops), params_(params), grads_(grads), cfg_(cfg) {
  MPIGPT_CHECK(params.numel() == grads.numel(), "params {} grads {}", params.numel(), grads.numel());
  const std::vector<Range> own = owned.empty() ? std::vector<Range>{{0, params.numel()}} : normalize_ranges(owned);
  MPIGPT_CHECK(own.empty() || (own.front().begin >= 0 && own.back().end <= params.numel()),
               "AdamW: owned ranges [{}, {}) exceed the buffer of {} elements", own.front().begin, own.back().end,
               params.numel());
  for (int i = 0; i < int(table.size()); ++i) {
    const OptimParam& p = table[i];
    MPIGPT_CHECK(p.offset >= 0 && p.offset + p.numel <= params.numel(),
                 "AdamW: parameter {} at [{}, {}) lies outside the buffer of {} elements", p.name, p.offset,
                 p.offset + p.numel, params.numel());
    const float decay = p.decay ? cfg.weight_decay : 0.0f;
    // The decay belongs to the parameter, so a slice through one still decays correctly.
    for (const Range& r : intersect_ranges({{p.offset, p.offset + p.numel}}, own)) {
      pieces_.push_back({i, r.begin, r.size(), state_numel_});
      AdamWRun* last = runs_.empty() ? nullptr : &runs_.back();
      if (last && last->weight_decay == decay && last->begin + last->count == r.begin &&
          last->state + last->count == state_numel_)
        last->count += r.size();
      else
        runs_.push_back({r.begin, r.size(), state_numel_, decay});
      state_numel_ += r.size();
    }
  }
  m_ = Buffer(ops, size_t(state_numel_) * 4);
  v_ = Buffer(ops, size_t(state_numel_) * 4);
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  if (runs_.empty()) return;  // this rank owns no optimizer state
  ops_.adamw_runs(params_, grads_, m(), v(), runs_, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, step_, grad_scale);
}

double grad_norm(Ops& ops, Tensor grads) { return std::sqrt(ops.sum_squares(grads)); }

double sum_squares_of(Ops& ops, Tensor grads, const std::vector<Range>& ranges) {
  double s = 0;
  for (const Range& r : ranges) {
    MPIGPT_CHECK(r.begin >= 0 && r.end <= grads.numel(), "sum_squares_of: [{}, {}) outside {} elements", r.begin,
                 r.end, grads.numel());
    if (!r.empty()) s += ops.sum_squares(grads.flat_slice(r.begin, r.size()));
  }
  return s;
}

float clip_scale(double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm)) return 1.0f;
  return float(max_norm / (norm + 1e-6));
}

}  // namespace mpigpt
