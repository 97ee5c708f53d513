// Tiny GPT-2, Llama and Mixtral models, their GptDims and random parameters, and the numpy oracle's
// plumbing, shared by the Hugging Face and PEFT tests.
#pragma once
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "io/formats/hf_format.h"
#include "io/io_testing.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt.h"
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

// Llama with biased q/k/v projections, tied as the small Qwen2.5 models are: a Qwen2.
inline ModelConfig tiny_qwen2() {
  ModelConfig m = tiny_llama();
  m.qkv_bias = true;
  m.tie_embeddings = true;
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

// ---- the numpy oracle, testdata/make_hf_tiny.py (hf_oracle_test, peft_oracle_test) ----------

// /usr/bin/python3 (or $MPIGPT_PYTHON) when it imports numpy, else "".
inline std::string python_with_numpy() {
  const char* env = std::getenv("MPIGPT_PYTHON");
  for (const char* p : {env, "/usr/bin/python3"})
    if (p && std::system(fmt::format("{} -c 'import numpy' >/dev/null 2>&1", p).c_str()) == 0) return p;
  return "";
}

inline std::string oracle_script() {
  return (repo_root() / "io" / "formats" / "testdata" / "make_hf_tiny.py").string();
}

// A file of raw little-endian values (the oracle's tokens.i32, logits.f64).
template <class T>
std::vector<T> read_raw(const std::string& path) {
  const std::string bytes = read_file(path);
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// Our CPU forward: logits (T, V) of one sequence, every parameter of d's table from `params`.
inline std::vector<float> our_logits(const TensorMap& params, const GptDims& d, const std::vector<int32_t>& tokens) {
  const int T = int(tokens.size());
  auto ops = make_cpu_ops();
  GPT model(d, *ops, 1);
  REQUIRE(model.params().size() == params.size());
  for (size_t i = 0; i < model.params().size(); ++i) {
    const ParamInfo& p = model.params()[i];
    REQUIRE(params.count(p.name));
    const HostTensor& t = params.at(p.name);
    REQUIRE(t.shape == p.global);
    std::memcpy(model.param(int(i)).f32(), t.data.data(), t.data.size() * 4);
  }
  std::vector<int32_t> targets(tokens.begin() + 1, tokens.end());
  targets.push_back(-1);
  model.forward(tokens.data(), targets.data(), 0.0f);
  const float* lg = model.logits().f32();
  std::vector<float> out;
  for (int t = 0; t < T; ++t) out.insert(out.end(), lg + int64_t(t) * d.Vp, lg + int64_t(t) * d.Vp + d.V);
  return out;
}

// How far our logits are from the oracle's: the largest difference (a NaN counts as infinite) and
// the largest reference logit; printed, and checked to be a model that is not degenerate.
struct LogitError {
  double worst = 0, scale = 0;
};
inline LogitError logit_error(const std::vector<float>& ours, const std::vector<double>& ref) {
  REQUIRE(ours.size() == ref.size());
  LogitError e;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double diff = std::abs(double(ours[i]) - ref[i]);
    e.worst = std::isfinite(diff) ? std::max(e.worst, diff) : INFINITY;  // NaN must not slip through max
    e.scale = std::max(e.scale, std::abs(ref[i]));
  }
  MESSAGE("max |logit - reference| = " << e.worst << " (largest logit " << e.scale << ")");
  CHECK(e.scale > 1.0);
  return e;
}

}  // namespace mpigpt::testing
