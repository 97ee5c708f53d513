// FLOP and parameter counts of a GPT shape.
#include "lib/model/gpt_dims.h"

#include "lib/model/params.h"

namespace mpigpt {

double GptDims::train_flops_per_token() const {
  const double c = C, hd = HD(), f = F;
  double per_layer = 2.0 * c * qkv_dim()          // QKV projection
                     + 2.0 * NH * hd * c          // attention output projection
                     + 2.0 * c * f * (gpt2() ? 1 : 2) + 2.0 * f * c  // MLP up (+gate), down
                     + 2.0 * T * NH * hd;         // QK^T and PV, 2*2*T*NH*HD halved by the causal mask
  double fwd = L * per_layer + 2.0 * c * Vp;      // + logits
  return 3.0 * fwd;
}

int64_t GptDims::num_params() const {
  int64_t n = 0;
  for (const auto& p : build_param_table(*this)) n += p.numel();
  return n;
}

}  // namespace mpigpt
