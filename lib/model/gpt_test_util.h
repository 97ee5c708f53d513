// Shared helpers of the GPT tests: tiny dimensions and a deterministic batch.
#pragma once
#include <cstdint>
#include <vector>

#include "lib/core/rng.h"
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

}  // namespace mpigpt::testing
