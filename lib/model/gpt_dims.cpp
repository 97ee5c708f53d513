// FLOP and parameter counts of a GPT shape.
#include "lib/model/gpt_dims.h"

#include "lib/model/params.h"

namespace mpigpt {

std::vector<int> slot_kind(const GptDims& d, int first, int end, bool embed, bool head) {
  std::vector<int> k = {end - first, embed, head};
  for (int l = first; l < end; ++l) k.push_back(d.is_moe(l));
  return k;
}

double GptDims::train_flops_per_token() const {
  const double c = C, hd = HD(), f = F;
  const double glu = gpt2() ? 1 : 2;
  const double attn = 2.0 * c * qkv_dim()         // QKV projection
                      + 2.0 * NH * hd * c         // attention output projection
                      + 2.0 * T * NH * hd;        // QK^T and PV, 2*2*T*NH*HD halved by the causal mask
  auto mlp = [&](double hidden) { return 2.0 * c * hidden * glu + 2.0 * hidden * c; };  // up (+gate), down
  double fwd = 2.0 * c * Vp;                      // logits
  for (int l = 0; l < L; ++l)                     // a MoE layer: router, K experts per token, shared expert
    fwd += attn + (is_moe(l) ? 2.0 * c * moe.E + moe.K * mlp(moe.F) + mlp(moe.shared_F) : mlp(f));
  return 3.0 * fwd;
}

int64_t GptDims::num_params() const {
  int64_t n = 0;
  for (const auto& p : build_param_table(*this)) n += p.numel();
  return n;
}

}  // namespace mpigpt
