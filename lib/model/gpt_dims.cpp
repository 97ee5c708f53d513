// FLOP and parameter counts of a GPT shape.
#include "lib/model/gpt_dims.h"

#include <algorithm>

#include "lib/model/params.h"

namespace mpigpt {

namespace {

// The bits that adapt layer t: its shared adapter's, then its projections' own in row order.
std::vector<unsigned> lora_bits(LoraTarget t) {
  if (t == kLoraQkv) return {kLoraQkv, kLoraQ, kLoraK, kLoraV};
  if (t == kLoraFc1) return {kLoraFc1, kLoraGate, kLoraUp};
  return {t};
}

}  // namespace

bool LoraDims::adapts(LoraTarget t) const {
  unsigned any = 0;
  for (unsigned b : lora_bits(t)) any |= b;
  return on() && (targets & any) != 0;
}

std::vector<int> LoraDims::part_blocks(LoraTarget t, int nparts) const {
  const std::vector<unsigned> bits = lora_bits(t);
  if ((targets & bits[0]) || bits.size() == 1 || size_t(nparts) != bits.size() - 1)  // shared, or one projection
    return std::vector<int>(size_t(nparts), adapts(t) ? 0 : -1);
  std::vector<int> blocks;
  int next = 0;
  for (int p = 0; p < nparts; ++p) blocks.push_back((targets & bits[size_t(p) + 1]) ? next++ : -1);
  return blocks;
}

int64_t LoraDims::width(LoraTarget t, int nparts) const {
  int blocks = 0;
  for (int b : part_blocks(t, nparts)) blocks = std::max(blocks, b + 1);
  return int64_t(blocks) * rank;
}

std::vector<int> slot_kind(const GptDims& d, int first, int end, bool embed, bool head) {
  std::vector<int> k = {end - first, embed, head};
  for (int l = first; l < end; ++l) k.push_back(d.is_moe(l));
  return k;
}

int64_t GptDims::lora_width(LoraTarget t) const {
  return lora.width(t, t == kLoraQkv ? 3 : t == kLoraFc1 && !gpt2() ? 2 : 1);
}

double GptDims::train_flops_per_token() const {
  const double c = C, hd = HD(), f = F;
  const double glu = gpt2() ? 1 : 2;
  const double proj = 2.0 * c * qkv_dim()          // QKV projection
                      + 2.0 * NH * hd * c;         // attention output projection
  const double core = 2.0 * T * NH * hd;           // QK^T and PV, 2*2*T*NH*HD halved by the causal mask
  auto mlp = [&](double hidden) { return 2.0 * c * hidden * glu + 2.0 * hidden * c; };  // up (+gate), down
  // LoRA's update of a layer in -> out through `width` rows of A: x A^T, then (x A^T) B^T.
  auto adapter = [&](LoraTarget t, double in, double out) { return 2.0 * lora_width(t) * (in + out); };
  double weights = 2.0 * c * Vp, attention = 0, adapters = 0;  // weight GEMMs (from the logits), cores, LoRA
  for (int l = 0; l < L; ++l) {  // a MoE layer: router, K experts per token (each its adapters), shared expert
    weights += proj + (is_moe(l) ? 2.0 * c * moe.E + moe.K * mlp(moe.F) + mlp(moe.shared_F) : mlp(f));
    attention += core;
    const double hidden = is_moe(l) ? moe.F : f, per_token = is_moe(l) ? moe.K : 1;
    adapters += adapter(kLoraQkv, c, qkv_dim()) + adapter(kLoraProj, NH * hd, c) +
                per_token * (adapter(kLoraFc1, c, hidden * glu) + adapter(kLoraFc2, hidden, c));
  }
  // Forward, input gradient and weight gradient: 3x the forward; under LoRA the frozen weights get
  // no gradient (2x) while the adapters do.
  return (lora.on() ? 2.0 : 3.0) * weights + 3.0 * (attention + adapters);
}

int64_t GptDims::num_params() const {
  int64_t n = 0;
  for (const auto& p : build_param_table(*this)) n += p.numel();
  return n;
}

}  // namespace mpigpt
