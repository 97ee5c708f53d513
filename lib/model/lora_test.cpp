// LoRA: the adapted linear against a double-precision oracle of the merged weight W + s B A, the
// whole GPT with adapters against the GPT with merged weights (each target alone, both families),
// finite differences of the adapters' gradients, and the frozen base's table.
#include "lib/model/lora.h"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "lib/core/error.h"
#include "lib/core/rng.h"
#include "lib/model/gpt.h"
#include "lib/model/gpt_testing.h"

using namespace mpigpt;

namespace {

std::vector<float> randn(int64_t n, uint64_t stream, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * normal_at(3, stream, uint64_t(i));
  return v;
}

double rel_err(const std::vector<double>& want, const float* got) {
  double err = 0, ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(want[i] - double(got[i])));
    ref = std::max(ref, std::abs(want[i]));
  }
  return err / std::max(ref, 1e-30);
}

int index_of(const GPT& m, const std::string& name) {
  for (size_t i = 0; i < m.params().size(); ++i)
    if (m.params()[i].name == name) return int(i);
  FAIL("no parameter ", name);
  return -1;
}

}  // namespace

TEST_CASE("lora: forward and backward equal the merged weight's, in double precision") {
  auto ops = make_cpu_ops();
  const int64_t N = 7, IN = 12, OUT = 10, r = 3;
  const float s = 2.5f;
  std::vector<float> x = randn(N * IN, 1, 1), W = randn(OUT * IN, 2, 0.3f), A = randn(r * IN, 3, 0.3f),
                     B = randn(OUT * r, 4, 0.3f), dy = randn(N * OUT, 5, 1);
  // The oracle: W' = W + s B A, y = x W'^T, dx = dy W', dW' = dy^T x, dA = s B^T dW', dB = s dW' A^T.
  std::vector<double> Wm(OUT * IN), y(N * OUT), dx(N * IN), dW(OUT * IN), dA(r * IN), dB(OUT * r);
  for (int64_t o = 0; o < OUT; ++o)
    for (int64_t i = 0; i < IN; ++i) {
      double ba = 0;
      for (int64_t k = 0; k < r; ++k) ba += double(B[o * r + k]) * A[k * IN + i];
      Wm[o * IN + i] = W[o * IN + i] + s * ba;
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OUT; ++o)
      for (int64_t i = 0; i < IN; ++i) {
        y[n * OUT + o] += double(x[n * IN + i]) * Wm[o * IN + i];
        dx[n * IN + i] += double(dy[n * OUT + o]) * Wm[o * IN + i];
        dW[o * IN + i] += double(dy[n * OUT + o]) * x[n * IN + i];
      }
  for (int64_t k = 0; k < r; ++k)
    for (int64_t o = 0; o < OUT; ++o)
      for (int64_t i = 0; i < IN; ++i) {
        dA[k * IN + i] += s * double(B[o * r + k]) * dW[o * IN + i];
        dB[o * r + k] += s * dW[o * IN + i] * A[k * IN + i];
      }

  auto t = [](std::vector<float>& v, Shape sh) { return Tensor(v.data(), sh); };
  std::vector<float> out(N * OUT), u(N * r), du(N * r), gx(N * IN), gA(r * IN, 0.5f), gB(OUT * r, -0.25f);
  ops->linear_forward(t(out, {N, OUT}), t(x, {N, IN}), t(W, {OUT, IN}), Tensor());
  lora_forward(*ops, t(out, {N, OUT}), t(u, {N, r}), t(x, {N, IN}), t(A, {r, IN}), t(B, {OUT, r}), s);
  CHECK(rel_err(y, out.data()) < 1e-5);
  ops->linear_backward(t(gx, {N, IN}), Tensor(), Tensor(), t(dy, {N, OUT}), t(x, {N, IN}), t(W, {OUT, IN}));
  lora_backward(*ops, t(gx, {N, IN}), t(gA, {r, IN}), t(gB, {OUT, r}), t(du, {N, r}), t(dy, {N, OUT}),
                t(x, {N, IN}), t(u, {N, r}), t(A, {r, IN}), t(B, {OUT, r}), s);
  CHECK(rel_err(dx, gx.data()) < 1e-5);
  for (auto& v : dA) v += 0.5;  // the factor gradients accumulate into what they held
  for (auto& v : dB) v -= 0.25;
  CHECK(rel_err(dA, gA.data()) < 1e-5);
  CHECK(rel_err(dB, gB.data()) < 1e-5);
}

TEST_CASE("lora: a fused layer's adapter blocks, shared or one per projection") {
  LoraDims l;
  l.rank = 4;
  l.targets = kLoraQkv | kLoraFc2;
  CHECK(l.part_blocks(kLoraQkv, 3) == std::vector<int>{0, 0, 0});
  CHECK(l.width(kLoraQkv, 3) == 4);
  CHECK(l.part_blocks(kLoraFc1, 2) == std::vector<int>{-1, -1});
  CHECK_FALSE(l.adapts(kLoraFc1));
  l.targets = kLoraQ | kLoraV | kLoraUp;
  CHECK(l.adapts(kLoraQkv));
  CHECK(l.part_blocks(kLoraQkv, 3) == std::vector<int>{0, -1, 1});
  CHECK(l.width(kLoraQkv, 3) == 8);
  CHECK(l.part_blocks(kLoraFc1, 2) == std::vector<int>{-1, 0});
  CHECK(l.width(kLoraFc1, 2) == 4);
  CHECK(l.width(kLoraProj) == 0);
  l.targets = kLoraQ | kLoraK | kLoraV | kLoraGate | kLoraUp;
  CHECK(l.part_blocks(kLoraQkv, 3) == std::vector<int>{0, 1, 2});
  CHECK(l.width(kLoraQkv, 3) == 12);
  CHECK(l.part_blocks(kLoraFc1, 2) == std::vector<int>{0, 1});
  CHECK(l.part_blocks(kLoraFc1, 1) == std::vector<int>{0});  // GPT-2's one up projection
  l.alpha = 32;
  l.rank = 16;
  CHECK(l.scale() == 2.0f);
  l.rslora = true;  // alpha / sqrt(r)
  CHECK(l.scale() == 8.0f);
  l.rank = 3;
  CHECK(l.scale() == float(32.0 / std::sqrt(3.0)));
}

namespace {

// The adapted layer `layer` ("mlp.fc") of layer l: on a MoE layer the routed experts' ("mlp.experts.fc").
std::string adapted(const GptDims& d, int l, const std::string& layer) {
  const bool expert = d.is_moe(l) && layer.starts_with("mlp.");
  return "layers." + std::to_string(l) + "." + (expert ? "mlp.experts." + layer.substr(4) : layer);
}

// The GPT with adapters on `target` against the plain GPT whose weight is W + s B A (per expert
// W_e + s B_e A_e on a MoE layer): the same loss, and the adapters' gradients are the merged
// weight's gradient dW projected: s B^T dW and s dW A^T.
void check_merged(Family fam, unsigned target, const char* layer, bool moe = false, bool rslora = false) {
  CAPTURE(int(fam));
  CAPTURE(layer);
  CAPTURE(moe);
  CAPTURE(rslora);
  GptDims dl = testing::lora_dims(fam, target, moe);
  dl.lora.rslora = rslora;
  GptDims d = dl;
  d.lora = LoraDims{};
  const int Bsz = 2;
  auto ops = make_cpu_ops();
  GPT lm(dl, *ops, Bsz), base(d, *ops, Bsz);
  lm.init_weights(7);
  base.init_weights(7);
  testing::randomize_lora_b(lm);
  const double s = dl.lora.scale();
  // Weight, A and B of layer l: (E, OUT, IN), (E, r, IN), (E, OUT, r), E = 1 for a dense layer; r
  // the layer's width (rank x blocks with an adapter per projection).
  struct Mats {
    int iw, ia, ib;
    int64_t E, OUT, IN, r;
  };
  auto mats = [&](int l) {
    const std::string pre = adapted(d, l, layer);
    Mats m{index_of(base, pre + ".weight"), index_of(lm, pre + ".lora_A.weight"), index_of(lm, pre + ".lora_B.weight"),
           1, 0, 0, 0};
    const Shape w = base.params()[m.iw].shape;
    const int n = w.ndim == 3 ? 3 : 2;  // an expert tensor (E, OUT, IN) or a matrix (OUT, IN)
    m.E = n == 3 ? w[0] : 1, m.OUT = w[n - 2], m.IN = w[n - 1], m.r = lm.params()[m.ia].shape[n == 3 ? 1 : 0];
    const int64_t r = m.r;
    const std::string name = layer;
    REQUIRE(r == (name == "attn.qkv" ? dl.lora_width(kLoraQkv) : name == "mlp.fc" ? dl.lora_width(kLoraFc1) : dl.lora.rank));
    REQUIRE(lm.params()[m.ia].shape == (n == 3 ? Shape{m.E, r, m.IN} : Shape{r, m.IN}));
    REQUIRE(lm.params()[m.ib].shape == (n == 3 ? Shape{m.E, m.OUT, r} : Shape{m.OUT, r}));
    return m;
  };
  for (int l = 0; l < d.L; ++l) {  // merge, in double
    const Mats m = mats(l);
    const int64_t r = m.r;
    for (int64_t e = 0; e < m.E; ++e) {
      float* W = base.param(m.iw).f32() + e * m.OUT * m.IN;
      const float *A = lm.param(m.ia).f32() + e * r * m.IN, *B = lm.param(m.ib).f32() + e * m.OUT * r;
      for (int64_t o = 0; o < m.OUT; ++o)
        for (int64_t i = 0; i < m.IN; ++i) {
          double ba = 0;
          for (int64_t k = 0; k < r; ++k) ba += double(B[o * r + k]) * A[k * m.IN + i];
          W[o * m.IN + i] = float(double(W[o * m.IN + i]) + s * ba);
        }
    }
  }
  const auto b = testing::tiny_batch(d, Bsz);
  const float dloss = 1.0f / float(Bsz * d.T - 1);
  lm.zero_grads();
  base.zero_grads();
  const double ll = lm.forward(b.tokens.data(), b.targets.data(), dloss);
  const double lb = base.forward(b.tokens.data(), b.targets.data(), dloss);
  CHECK(ll == doctest::Approx(lb).epsilon(1e-6));
  CHECK(lm.moe_loss_sum() == doctest::Approx(base.moe_loss_sum()).epsilon(1e-6));
  lm.backward();
  base.backward();
  for (int l = 0; l < d.L; ++l) {
    CAPTURE(l);
    const Mats m = mats(l);
    const int64_t r = m.r;
    for (int64_t e = 0; e < m.E; ++e) {
      CAPTURE(e);
      const float* dW = base.grad(m.iw).f32() + e * m.OUT * m.IN;
      const float *A = lm.param(m.ia).f32() + e * r * m.IN, *B = lm.param(m.ib).f32() + e * m.OUT * r;
      std::vector<double> dA(size_t(r * m.IN)), dB(size_t(m.OUT * r));
      for (int64_t k = 0; k < r; ++k)
        for (int64_t o = 0; o < m.OUT; ++o)
          for (int64_t i = 0; i < m.IN; ++i) {
            dA[k * m.IN + i] += s * double(B[o * r + k]) * dW[o * m.IN + i];
            dB[o * r + k] += s * double(dW[o * m.IN + i]) * A[k * m.IN + i];
          }
      // An adapter per projection: B's entries outside its blocks get no gradient (they stay zero).
      for (int64_t k = 0; k < m.OUT * r; ++k)
        if (!testing::lora_b_live(dl, lm.params()[m.ib], e * m.OUT * r + k)) dB[size_t(k)] = 0;
      CHECK(rel_err(dA, lm.grad(m.ia).f32() + e * r * m.IN) < 1e-4);
      CHECK(rel_err(dB, lm.grad(m.ib).f32() + e * m.OUT * r) < 1e-4);
    }
  }
}

}  // namespace

TEST_CASE("lora: each target of the GPT equals the merged weight, forward and backward (both families)") {
  for (Family fam : {Family::GPT2, Family::Llama}) {
    check_merged(fam, kLoraQkv, "attn.qkv");
    check_merged(fam, kLoraProj, "attn.proj");
    check_merged(fam, kLoraFc1, "mlp.fc");
    check_merged(fam, kLoraFc2, "mlp.proj");
    // A MoE model: attention on both layers, fc1/fc2 dense below, one adapter per routed expert above.
    check_merged(fam, kLoraQkv, "attn.qkv", true);
    check_merged(fam, kLoraFc1, "mlp.fc", true);
    check_merged(fam, kLoraFc2, "mlp.proj", true);
    // An adapter of its own per projection: q and v (k not adapted), all three, one alone.
    check_merged(fam, kLoraQ | kLoraV, "attn.qkv");
    check_merged(fam, kLoraQ | kLoraK | kLoraV, "attn.qkv", true);
    check_merged(fam, kLoraK, "attn.qkv");
  }
  check_merged(Family::Llama, kLoraGate | kLoraUp, "mlp.fc");
  check_merged(Family::Llama, kLoraUp, "mlp.fc");
  check_merged(Family::Llama, kLoraGate | kLoraUp, "mlp.fc", true);  // per routed expert
  check_merged(Family::Llama, kLoraGate, "mlp.fc", true);
  // Rank-stabilised: the update scaled by alpha / sqrt(r), dense and per routed expert.
  check_merged(Family::Llama, kLoraQkv, "attn.qkv", false, true);
  check_merged(Family::Llama, kLoraFc2, "mlp.proj", true, true);
}

TEST_CASE("lora: the adapters' gradients match finite differences (both families, every target, dense and MoE)") {
  for (Family fam : {Family::GPT2, Family::Llama})
    for (bool moe : {false, true}) {
      CAPTURE(int(fam));
      CAPTURE(moe);
      GptDims d = testing::lora_dims(fam, kLoraQkv | kLoraProj | kLoraFc1 | kLoraFc2, moe);
      // Every token to every expert (K = E): the top-k choice is piecewise constant, and probes of
      // 1e-2 on the factors cross its near-ties in this tiny model. check_merged covers top-2 routing.
      if (moe) d.moe.K = d.moe.E;
      const int B = 2;
      auto ops = make_cpu_ops();
      GPT model(d, *ops, B);
      model.init_weights(7);
      testing::randomize_lora_b(model);
      const auto b = testing::tiny_batch(d, B);
      model.zero_grads();
      model.forward(b.tokens.data(), b.targets.data(), 1.0f);
      model.backward();
      const Tensor g = model.grads_flat();
      std::vector<float> grad(g.f32(), g.f32() + g.numel());
      // The objective: the LM loss plus (aux_scale 1) the MoE losses, which the adapters below move.
      testing::check_gradients_fd(model, grad, [&] {
        model.reset_moe_loss();
        const double l = model.forward(b.tokens.data(), b.targets.data(), 0.0f);
        return l + model.moe_loss_sum();
      });
    }
}

TEST_CASE("lora: the base is frozen and laid out after the adapters; A is Kaiming-uniform from the fan-in, B zero") {
  const GptDims d = testing::lora_dims(Family::Llama, kLoraQkv | kLoraFc2);
  auto ops = make_cpu_ops();
  GPT m(d, *ops, 1);
  m.init_weights(7);
  int64_t trained = 0;
  int adapters = 0;
  for (size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    CAPTURE(p.name);
    CHECK(p.frozen == !is_lora_param(p.name));
    if (p.frozen) {
      CHECK(p.offset >= m.grads_flat().numel());
      CHECK_FALSE(m.grad(int(i)).defined());
      continue;
    }
    ++adapters;
    trained += p.numel();
    const float* w = m.param(int(i)).f32();
    double amax = 0;
    for (int64_t k = 0; k < p.numel(); ++k) amax = std::max(amax, double(std::abs(w[k])));
    if (p.name.ends_with("lora_B.weight")) {
      CHECK(amax == 0);
    } else {  // bound 1/sqrt(in): C for qkv, F for fc2
      const double bound = 1.0 / std::sqrt(double(p.shape[1]));
      CHECK(amax <= bound);
      CHECK(amax > 0.7 * bound);
    }
  }
  CHECK(adapters == 2 * 2 * d.L);
  CHECK(m.grads_flat().numel() == trained);
  CHECK(trained == d.L * 3 * ((d.C + d.qkv_dim()) + (d.F + d.C)));
}
