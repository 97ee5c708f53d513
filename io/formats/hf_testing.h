// Tiny GPT-2, Llama and Mixtral models, their GptDims and random parameters, shared by the Hugging
// Face tests (hf_format_test, hf_config_test, hf_oracle_test).
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "io/formats/hf_format.h"
#include "lib/model/gpt_dims.h"
#include "lib/train/trainer.h"

namespace mpigpt::testing {

inline ModelConfig tiny_gpt2() {
  ModelConfig m;
  m.family = "gpt2";
  m.num_layers = 2;
  m.hidden = 16;
  m.num_heads = 4;
  m.seq_len = 8;
  m.max_position = 12;
  return m;
}

inline ModelConfig tiny_llama() {
  ModelConfig m;
  m.family = "llama";
  m.num_layers = 2;
  m.hidden = 16;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.ffn_hidden = 24;
  m.seq_len = 8;
  m.max_position = 32;
  m.tie_embeddings = false;
  m.rope_theta = 500000.0;
  return m;
}

// Llama with every MLP a mixture of 4 experts of width 12, top-2, renormalised: a Mixtral.
inline ModelConfig tiny_mixtral() {
  ModelConfig m = tiny_llama();
  m.num_experts = 4;
  m.moe_top_k = 2;
  m.moe_ffn_hidden = 12;
  m.moe_norm_topk_prob = true;
  m.moe_aux_loss_coeff = 0.02;
  return m;
}

// The GPT of `m` as training builds it (lib/train's make_dims), with vocabulary V padded to Vp rows
// and activations for T tokens.
inline GptDims dims_of(const ModelConfig& m, int V, int Vp, int T) {
  Config c;
  c.model = m;
  if (c.model.ffn_hidden <= 0) c.model.ffn_hidden = 4 * m.hidden;
  c.model.vocab_size = V;
  GptDims d = make_dims(c, V);
  d.Vp = Vp;
  d.T = T;
  return d;
}

// Random parameters with the shapes of param_shapes: norm weights near 1, vocabulary padding zero.
inline TensorMap random_ours(const ModelConfig& m, int V, int Vp, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  TensorMap out;
  for (const auto& [name, s] : param_shapes(m, Vp)) {
    HostTensor t{s, std::vector<float>(size_t(s.numel()))};
    const bool norm = name.find("norm.weight") != std::string::npos, bias = name.ends_with(".bias");
    for (float& x : t.data) x = norm ? 1.f + 0.1f * n(gen) : (bias ? 0.1f : 0.3f) * n(gen);
    if (name == "embedding.word.weight" || name == "lm_head.weight")
      std::fill(t.data.begin() + int64_t(V) * s[1], t.data.end(), 0.f);
    out[name] = std::move(t);
  }
  return out;
}

}  // namespace mpigpt::testing
