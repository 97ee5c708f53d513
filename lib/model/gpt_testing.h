// Shared helpers of the GPT tests: tiny dimensions, a deterministic batch, and the
// finite-difference probe of every parameter's gradient.
#pragma once
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "lib/core/rng.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_dims.h"

namespace mpigpt::testing {

inline GptDims tiny_gpt_dims(Family f) {
  GptDims d;
  d.family = f;
  d.L = 2;
  d.C = 16;
  d.NH = 4;
  d.NKV = f == Family::Llama ? 2 : 4;
  d.F = f == Family::Llama ? 24 : 64;
  d.T = 6;
  d.maxT = 8;
  d.V = 23;
  d.Vp = 32;
  d.tied = f == Family::GPT2;
  d.init_std = 0.3f;  // large weights: strong non-linearity and gradients well above fp32 noise
  return d;
}

// Whether element g (global flat index) of parameter p may be non-zero: false only in a LoRA B
// outside its structure (an adapter per projection, LoraDims::part_blocks: a row of projection i
// lives in block i's r columns only).
inline bool lora_b_live(const GptDims& d, const ParamInfo& p, int64_t g) {
  if (!d.lora.on() || !p.name.ends_with("lora_B.weight")) return true;
  const int n = p.global.ndim;
  if (n < 2) return true;  // a vector: no factor B
  const int64_t w = p.global.d[size_t(n - 1)], H = p.global.d[size_t(n - 2)], row = g / w % H,
                block = g % w / d.lora.rank;
  std::vector<int64_t> rows;
  std::vector<int> blocks;
  if (p.name.find(".attn.qkv.") != std::string::npos) {
    rows = {int64_t(d.NH) * d.HD(), int64_t(d.NKV) * d.HD(), int64_t(d.NKV) * d.HD()};
    blocks = d.lora.part_blocks(kLoraQkv, 3);
  } else if (p.name.find(".fc.") != std::string::npos && !d.gpt2()) {
    rows = {H / 2, H / 2};
    blocks = d.lora.part_blocks(kLoraFc1, 2);
  } else {
    return true;
  }
  for (size_t i = 0, r0 = 0; i < rows.size(); r0 += size_t(rows[i++]))
    if (row < int64_t(r0) + rows[i]) return blocks[i] == block;
  return false;
}

// tiny_gpt_dims with LoRA adapters of rank 3 (scale 2) on `targets` (LoraTarget bits); `moe`: GPT-2
// a dense layer below a MoE layer of 4 experts, Llama both MoE with a shared expert (not adapted).
inline GptDims lora_dims(Family fam, unsigned targets, bool moe = false) {
  GptDims d = tiny_gpt_dims(fam);
  d.lora.rank = 3;
  d.lora.alpha = 6.0f;
  d.lora.targets = targets;
  if (moe) {
    d.moe.E = 4;
    d.moe.K = 2;
    d.moe.F = fam == Family::Llama ? 12 : 16;
    d.moe.shared_F = fam == Family::Llama ? 8 : 0;
    d.moe.aux_coeff = 0.5f;
    d.moe.z_coeff = 0.05f;
    d.moe.norm_topk = fam == Family::Llama;
    d.moe.layers = {fam == Family::Llama, true};
  }
  return d;
}

// B starts at zero; random values (by global element) make B A matter, and A's gradient non-zero.
// The model must hold its parameters on the host.
inline void randomize_lora_b(GPT& m) {
  for (size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    if (!p.name.ends_with("lora_B.weight")) continue;
    float* w = m.param(int(i)).f32();
    for (int64_t k = 0; k < p.numel(); ++k) {
      const int64_t g = p.global_index(k);
      w[k] = lora_b_live(m.dims(), p, g) ? 0.3f * normal_at(13, stream_of(p.name), uint64_t(g)) : 0.0f;
    }
  }
}

struct TinyBatch {
  std::vector<int32_t> tokens, targets;
};

inline TinyBatch tiny_batch(const GptDims& d, int B) {
  TinyBatch b;
  for (int i = 0; i < B * d.T; ++i) {
    b.tokens.push_back(int32_t(bits_at(5, 1, i) % d.V));
    // One ignored target checks that masked positions carry no gradient.
    b.targets.push_back(i == 3 ? -1 : int32_t(bits_at(5, 2, i) % d.V));
  }
  return b;
}

// Checks `grad` (the model's analytic gradient, one float per trained parameter element at its buffer
// offset) against central differences of `loss` at 8 elements of every parameter, each probe to
// 2e-2 relative + 2e-3 and the probed vector of each parameter to 1e-2 relative + 1e-3 (a wrong
// backward is off by O(1)). `loss` must evaluate the objective at the model's current weights.
inline void check_gradients_fd(GPT& model, const std::vector<float>& grad, const std::function<double()>& loss) {
  float* p = model.params_flat().f32();
  const double eps = 1e-2;
  for (const auto& info : model.params()) {
    if (info.frozen) continue;  // no gradient (LoRA's base)
    CAPTURE(info.name);
    double err2 = 0, ref2 = 0;
    const int probes = 8;
    for (int k = 0; k < probes; ++k) {
      int64_t i = int64_t(bits_at(11, stream_of(info.name), k) % uint64_t(info.numel()));
      if (info.valid_rows >= 0) i %= info.valid_rows * info.shape[1];  // padded rows have no gradient path
      float* w = p + info.offset + i;
      const float saved = *w;
      *w = saved + float(eps);
      const double lp = loss();
      *w = saved - float(eps);
      const double lm = loss();
      *w = saved;
      const double fd = (lp - lm) / (2 * eps);
      const double an = grad[info.offset + i];
      err2 += (fd - an) * (fd - an);
      ref2 += fd * fd;
      CHECK(std::abs(fd - an) <= 2e-2 * std::abs(fd) + 2e-3);
    }
    CHECK(std::sqrt(err2) <= 1e-2 * std::sqrt(ref2) + 1e-3);
  }
}

}  // namespace mpigpt::testing
