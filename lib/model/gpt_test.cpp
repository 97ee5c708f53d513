// Gradient checks of the whole GPT (both families) against central finite differences: every
// parameter tensor of every layer is probed, so a wrong backward anywhere shows up here. Also:
// init is layout-independent and deterministic; training.no_decay's parameter kinds parse.
#include "lib/model/gpt.h"

#include <doctest/doctest.h>

#include <cmath>
#include <set>
#include <vector>

#include "lib/core/rng.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

GptDims tiny_dims(Family f) { return testing::tiny_gpt_dims(f); }
using Batch = testing::TinyBatch;
Batch make_batch(const GptDims& d, int B) { return testing::tiny_batch(d, B); }

void check_gradients(Family fam, bool qkv_bias = false) {
  GptDims d = tiny_dims(fam);
  d.qkv_bias = qkv_bias;
  const int B = 2;
  auto ops = make_cpu_ops();
  GPT model(d, *ops, B);
  model.init_weights(7);
  // Norm weights/biases start at 1/0; perturb them so their gradients are generic.
  float* p = model.params_flat().f32();
  for (const auto& info : model.params())
    if (info.kind == ParamKind::Norm || info.kind == ParamKind::Bias)
      for (int64_t i = 0; i < info.numel(); ++i) p[info.offset + i] += 0.2f * normal_at(9, 9, info.offset + i);
  const Batch b = make_batch(d, B);

  model.zero_grads();
  model.forward(b.tokens.data(), b.targets.data(), 1.0f);
  model.backward();
  std::vector<float> grad(model.grads_flat().f32(), model.grads_flat().f32() + model.num_params());

  auto loss = [&]() { return model.forward(b.tokens.data(), b.targets.data(), 0.0f); };
  testing::check_gradients_fd(model, grad, loss);
}

}  // namespace

TEST_CASE("GPT-2 family: every parameter's gradient matches central finite differences") {
  check_gradients(Family::GPT2);
}

TEST_CASE("Llama family (RMSNorm, RoPE, SwiGLU, GQA, untied): gradients match finite differences") {
  check_gradients(Family::Llama);
}

TEST_CASE("Llama with q/k/v biases (Qwen2): gradients match finite differences") {
  check_gradients(Family::Llama, true);
}

TEST_CASE("padded vocabulary rows stay zero and get no gradient") {
  const GptDims d = tiny_dims(Family::GPT2);
  auto ops = make_cpu_ops();
  GPT model(d, *ops, 1);
  model.init_weights(3);
  const Batch b = make_batch(d, 1);
  model.zero_grads();
  model.forward(b.tokens.data(), b.targets.data(), 1.0f);
  model.backward();
  const float* w = model.param(0).f32();
  const float* g = model.grad(0).f32();
  for (int64_t i = int64_t(d.V) * d.C; i < int64_t(d.Vp) * d.C; ++i) {
    REQUIRE(w[i] == 0.0f);
    REQUIRE(g[i] == 0.0f);
  }
}

TEST_CASE("initial loss is near ln(V) and the forward is deterministic") {
  GptDims d = tiny_dims(Family::GPT2);
  d.init_std = 0.02f;
  auto ops = make_cpu_ops();
  GPT model(d, *ops, 2);
  model.init_weights(1);
  const Batch b = make_batch(d, 2);
  const double l1 = model.forward(b.tokens.data(), b.targets.data(), 0.0f);
  const double l2 = model.forward(b.tokens.data(), b.targets.data(), 0.0f);
  CHECK(l1 == l2);
  const double mean = l1 / (2 * d.T - 1);
  CHECK(mean == doctest::Approx(std::log(double(d.V))).epsilon(0.02));
}

TEST_CASE("init depends on (seed, name, element) only; output projections are scaled by 1/sqrt(2L)") {
  GptDims d = tiny_dims(Family::GPT2);
  d.init_std = 0.02f;
  auto table = build_param_table(d);
  std::vector<float> a, b;
  for (const auto& p : table) {
    a.resize(p.numel());
    b.resize(p.numel());
    init_param(p, 42, a.data());
    init_param(p, 42, b.data());
    CHECK(a == b);
    if (p.name == "layers.1.attn.proj.weight") {
      CHECK(p.init_std == doctest::Approx(0.02 / std::sqrt(4.0)));
      CHECK(a[5] == doctest::Approx(p.init_std * normal_at(42, stream_of(p.name), 5)));
    }
    if (p.kind == ParamKind::Norm) CHECK(a[0] == 1.0f);
    if (p.kind == ParamKind::Bias) CHECK(a[0] == 0.0f);
  }
  // Deeper model: the same named tensor gets the same values (layout/size independence).
  GptDims deeper = d;
  deeper.L = 3;
  auto t2 = build_param_table(deeper);
  REQUIRE(t2[4].name == "layers.0.attn.qkv.weight");
  REQUIRE(table[4].name == t2[4].name);
  std::vector<float> c(t2[4].numel());
  a.resize(table[4].numel());
  init_param(table[4], 42, a.data());
  init_param(t2[4], 42, c.data());
  CHECK(a == c);
}

TEST_CASE("causality: logits at position t depend on tokens <= t and on no later token") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    CAPTURE(int(fam));
    GptDims d = tiny_dims(fam);
    auto ops = make_cpu_ops();
    GPT model(d, *ops, 1);
    model.init_weights(4);
    Batch b = make_batch(d, 1);
    model.forward(b.tokens.data(), b.targets.data(), 0.0f);
    const std::vector<float> base(model.logits().f32(), model.logits().f32() + d.T * d.Vp);
    const int changed = 2;
    b.tokens[changed] = (b.tokens[changed] + 1) % d.V;
    model.forward(b.tokens.data(), b.targets.data(), 0.0f);
    const float* now = model.logits().f32();
    for (int t = 0; t < d.T; ++t) {
      double diff = 0;
      for (int v = 0; v < d.V; ++v) diff = std::max(diff, double(std::abs(now[t * d.Vp + v] - base[t * d.Vp + v])));
      CAPTURE(t);
      if (t < changed) CHECK(diff == 0.0);
      else CHECK(diff > 1e-4);  // the changed token and every later position see it
    }
  }
}

TEST_CASE("no_decay parsing names the bad kind") {
  CHECK(parse_no_decay("norms, biases") == std::set<ParamKind>{ParamKind::Norm, ParamKind::Bias});
  CHECK(parse_no_decay("none").empty());
  CHECK_THROWS_WITH_AS(parse_no_decay("norms,bias"), doctest::Contains("'bias'"), Error);
}
