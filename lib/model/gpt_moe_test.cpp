// The GPT with mixture-of-experts layers: the gradient of LM loss + aux/z losses against central
// finite differences for both families (router, routed experts, shared expert and the dense
// layers around them), and an E=1, K=1 dropless MoE GPT equal to the dense GPT with its weights.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lib/core/rng.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

GptDims moe_dims(Family f, bool shared) {
  GptDims d = testing::tiny_gpt_dims(f);
  d.moe.E = 4;
  d.moe.K = 2;
  d.moe.F = f == Family::Llama ? 12 : 16;
  d.moe.shared_F = shared ? 8 : 0;
  d.moe.aux_coeff = 0.5f;  // large: the aux gradient must be visible against the LM loss
  d.moe.z_coeff = 0.05f;
  d.moe.norm_topk = f == Family::Llama;
  d.moe.layers = {false, true};  // a dense layer below, a MoE layer above
  if (shared) d.moe.layers = {true, true};
  return d;
}

void check_moe_gradients(Family fam, bool shared) {
  CAPTURE(int(fam));
  CAPTURE(shared);
  const GptDims d = moe_dims(fam, shared);
  const int B = 2;
  auto ops = make_cpu_ops();
  GPT model(d, *ops, B);
  model.init_weights(7);
  float* p = model.params_flat().f32();
  int moe_params = 0;
  for (const auto& info : model.params()) {
    if (info.kind == ParamKind::Norm || info.kind == ParamKind::Bias)
      for (int64_t i = 0; i < info.numel(); ++i) p[info.offset + i] += 0.2f * normal_at(9, 9, info.offset + i);
    if (info.name.find(".mlp.router.") != std::string::npos || info.name.find(".mlp.experts.") != std::string::npos ||
        info.name.find(".mlp.shared.") != std::string::npos)
      ++moe_params;
  }
  CHECK(moe_params == (fam == Family::GPT2 ? 5 : 3) * (shared ? 2 : 1) + (shared ? (fam == Family::GPT2 ? 8 : 4) : 0));
  const auto b = testing::tiny_batch(d, B);

  model.zero_grads();
  model.reset_moe_loss();
  model.forward(b.tokens.data(), b.targets.data(), 1.0f);
  const double aux0 = model.moe_loss_sum();
  CHECK(aux0 > 0.0);
  model.backward();
  std::vector<float> grad(model.grads_flat().f32(), model.grads_flat().f32() + model.num_params());

  // The objective: the LM loss sum plus aux_scale (1) times the MoE losses.
  auto loss = [&]() {
    model.reset_moe_loss();
    const double l = model.forward(b.tokens.data(), b.targets.data(), 0.0f);
    return l + model.moe_loss_sum();
  };
  testing::check_gradients_fd(model, grad, loss);
}

}  // namespace

TEST_CASE("MoE GPT-2: gradients of LM + aux + z loss match finite differences (router, experts, dense layers)") {
  check_moe_gradients(Family::GPT2, false);
}

TEST_CASE("MoE Llama (SwiGLU experts, shared expert, every layer MoE): gradients match finite differences") {
  check_moe_gradients(Family::Llama, true);
}

TEST_CASE("MoE parameter table: names, global shapes, replicated over tp, init by global index") {
  GptDims d = moe_dims(Family::GPT2, true);
  d.moe.layers = {false, true};
  ModelPlacement pl;
  pl.tp = 2;
  pl.tp_rank = 1;
  const auto t = build_param_table(d, pl);
  auto find = [&](const std::string& n) -> const ParamInfo* {
    for (const auto& p : t)
      if (p.name == n) return &p;
    return nullptr;
  };
  REQUIRE(find("layers.0.mlp.fc.weight"));
  CHECK_FALSE(find("layers.1.mlp.fc.weight"));
  const ParamInfo* r = find("layers.1.mlp.router.weight");
  const ParamInfo* fc = find("layers.1.mlp.experts.fc.weight");
  const ParamInfo* pr = find("layers.1.mlp.experts.proj.weight");
  REQUIRE((r && fc && pr && find("layers.1.mlp.experts.fc.bias") && find("layers.1.mlp.experts.proj.bias")));
  REQUIRE((find("layers.1.mlp.shared.fc.weight") && find("layers.1.mlp.shared.proj.bias")));
  CHECK(r->shape == Shape{4, d.C});
  CHECK(fc->shape == Shape{4, 16, d.C});
  CHECK(pr->shape == Shape{4, d.C, 16});
  CHECK(fc->split == TpSplit::None);
  CHECK(pr->init_std == doctest::Approx(d.init_std / std::sqrt(2.0f * d.L)));
  // The same values on every tp rank and in the single-rank table.
  const auto t1 = build_param_table(d);
  for (const auto* p : {r, fc, pr}) {
    const ParamInfo* q = nullptr;
    for (const auto& x : t1)
      if (x.name == p->name) q = &x;
    REQUIRE(q);
    std::vector<float> a(p->numel()), b(q->numel());
    init_param(*p, 3, a.data());
    init_param(*q, 3, b.data());
    CHECK(a == b);
  }
  CHECK(d.num_params() > testing::tiny_gpt_dims(Family::GPT2).num_params());
}

TEST_CASE("MoE GPT with E=1, K=1, dropless equals the dense GPT with the same weights") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    const GptDims dense_d = testing::tiny_gpt_dims(fam);
    GptDims moe_d = dense_d;
    moe_d.moe.E = 1;
    moe_d.moe.K = 1;
    moe_d.moe.F = dense_d.F;
    moe_d.moe.layers = {true, true};
    const int B = 2;
    auto ops = make_cpu_ops();
    GPT dense(dense_d, *ops, B), moe(moe_d, *ops, B);
    dense.init_weights(7);
    moe.init_weights(8);
    // Copy every dense weight to its MoE counterpart (mlp.fc -> mlp.experts.fc, one expert).
    auto index_of = [](const GPT& m, const std::string& n) {
      for (size_t i = 0; i < m.params().size(); ++i)
        if (m.params()[i].name == n) return int(i);
      return -1;
    };
    for (size_t i = 0; i < dense.params().size(); ++i) {
      std::string n = dense.params()[i].name;
      const size_t at = n.find(".mlp.");
      if (at != std::string::npos) n.replace(at, 5, ".mlp.experts.");
      const int j = index_of(moe, n);
      CAPTURE(n);
      REQUIRE(j >= 0);
      REQUIRE(moe.param(j).numel() == dense.param(int(i)).numel());
      std::memcpy(moe.param(j).f32(), dense.param(int(i)).f32(), sizeof(float) * dense.param(int(i)).numel());
    }
    const auto b = testing::tiny_batch(dense_d, B);
    dense.zero_grads();
    moe.zero_grads();
    const double ld = dense.forward(b.tokens.data(), b.targets.data(), 0.1f);
    const double lm = moe.forward(b.tokens.data(), b.targets.data(), 0.1f);
    CHECK(lm == doctest::Approx(ld).epsilon(1e-6));
    // The MoE layers' saved state (router outputs, expert rows in and out, hidden units) counts:
    // it holds at least what the dense MLP holds (fc and act) plus the dispatched rows.
    CHECK(moe.activation_bytes() > dense.activation_bytes());
    dense.backward();
    moe.backward();
    for (size_t i = 0; i < dense.params().size(); ++i) {
      std::string n = dense.params()[i].name;
      const size_t at = n.find(".mlp.");
      if (at != std::string::npos) n.replace(at, 5, ".mlp.experts.");
      CAPTURE(n);
      const int j = index_of(moe, n);
      const float* gd = dense.grad(int(i)).f32();
      const float* gm = moe.grad(j).f32();
      double err = 0, ref = 0;
      for (int64_t k = 0; k < dense.param(int(i)).numel(); ++k) {
        err = std::max(err, double(std::abs(gd[k] - gm[k])));
        ref = std::max(ref, double(std::abs(gd[k])));
      }
      CHECK(err <= 1e-5 * ref + 1e-7);
    }
    // A single softmax expert has gate 1 whatever the router says: no router gradient.
    const int r = index_of(moe, "layers.0.mlp.router.weight");
    REQUIRE(r >= 0);
    CHECK(ops->sum_squares(moe.grad(r)) == 0.0);
  }
}
