// The GPT parameter table and weight initialisation.
#include "lib/model/params.h"

#include <cmath>

#include "lib/core/rng.h"

namespace mpigpt {

const char* param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::Weight: return "weight";
    case ParamKind::Bias: return "bias";
    case ParamKind::Norm: return "norm";
    case ParamKind::Embedding: return "embedding";
  }
  return "?";
}

std::vector<ParamInfo> build_param_table(const GptDims& d) {
  std::vector<ParamInfo> t;
  const bool g = d.gpt2();
  // Residual-branch output projections are scaled by 1/sqrt(2L) (GPT-2 paper, Megatron).
  const float out_std = d.init_std / std::sqrt(2.0f * d.L);
  auto add = [&](std::string name, Shape s, ParamKind k, float std = 0, int64_t valid_rows = -1) {
    t.push_back(ParamInfo{std::move(name), s, k, 0, std, valid_rows});
  };
  add("embedding.word.weight", {d.Vp, d.C}, ParamKind::Embedding, d.init_std, d.V);
  if (g) add("embedding.position.weight", {d.maxT, d.C}, ParamKind::Embedding, d.init_std);
  for (int l = 0; l < d.L; ++l) {
    std::string p = "layers." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {d.C}, ParamKind::Norm);
    if (g) add(p + "attn_norm.bias", {d.C}, ParamKind::Bias);
    add(p + "attn.qkv.weight", {d.qkv_dim(), d.C}, ParamKind::Weight, d.init_std);
    if (g) add(p + "attn.qkv.bias", {d.qkv_dim()}, ParamKind::Bias);
    add(p + "attn.proj.weight", {d.C, d.NH * d.HD()}, ParamKind::Weight, out_std);
    if (g) add(p + "attn.proj.bias", {d.C}, ParamKind::Bias);
    add(p + "mlp_norm.weight", {d.C}, ParamKind::Norm);
    if (g) add(p + "mlp_norm.bias", {d.C}, ParamKind::Bias);
    // SwiGLU's gate and up projections are one [gate; up] matrix.
    add(p + "mlp.fc.weight", {int64_t(g ? d.F : 2 * d.F), d.C}, ParamKind::Weight, d.init_std);
    if (g) add(p + "mlp.fc.bias", {d.F}, ParamKind::Bias);
    add(p + "mlp.proj.weight", {d.C, d.F}, ParamKind::Weight, out_std);
    if (g) add(p + "mlp.proj.bias", {d.C}, ParamKind::Bias);
  }
  add("final_norm.weight", {d.C}, ParamKind::Norm);
  if (g) add("final_norm.bias", {d.C}, ParamKind::Bias);
  if (!d.tied) add("lm_head.weight", {d.Vp, d.C}, ParamKind::Weight, d.init_std, d.V);
  int64_t off = 0;
  for (auto& p : t) {
    p.offset = off;
    off += p.numel();
  }
  return t;
}

void init_param(const ParamInfo& p, uint64_t seed, float* dst) {
  const int64_t n = p.numel();
  if (p.init_std == 0) {
    const float v = p.kind == ParamKind::Norm ? 1.0f : 0.0f;
    for (int64_t i = 0; i < n; ++i) dst[i] = v;
    return;
  }
  const uint64_t stream = stream_of(p.name);
  const int64_t cols = p.shape.ndim > 1 ? p.shape[p.shape.ndim - 1] : 1;
  const int64_t limit = p.valid_rows < 0 ? n : p.valid_rows * cols;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = i < limit ? p.init_std * normal_at(seed, stream, uint64_t(i)) : 0.0f;
}

}  // namespace mpigpt
