// Tests of the MoE layer on one rank: capacity and drop policies on hand-checked cases, forward
// against a naive per-token double reference, backward (dx, every weight, router with aux and
// z-loss) against central finite differences, and E=1, K=1 against the dense MLP.
#include "lib/model/moe.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/kernels/testing.h"
#include "lib/model/moe_testing.h"

using namespace mpigpt;
using namespace mpigpt::testing;

namespace {
using Policy = MoeConfig::DropPolicy;
const float kNaN = std::numeric_limits<float>::quiet_NaN();

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct Ref {
  std::vector<double> y;
  std::vector<int> routed;  // (T*K) expert of each kept assignment, -1 dropped
  double aux = 0.0, z = 0.0;
  double load = 0.0;  // max over experts of the top-k assignments (before capacity) / (T*K/E)
};

// The layer written per token in double, straight from its definition in moe.h.
Ref naive_moe(MoeHostWeights& w, const std::vector<float>& x, int64_t T) {
  const MoeConfig& c = w.cfg;
  const int64_t C = w.C, E = c.num_experts, K = c.top_k, F = c.hidden, Fs = c.shared_hidden;
  const bool glu = c.activation == MoeConfig::Activation::Swiglu;
  Ref r;
  r.y.assign(static_cast<size_t>(T * C), 0.0);
  r.routed.assign(static_cast<size_t>(T * K), -1);
  std::vector<double> gate(static_cast<size_t>(T * K)), Psum(static_cast<size_t>(E), 0.0), cnt(Psum);
  // y += proj(act(fc(x_t))) * scale for a dense MLP given as raw pointers.
  auto mlp = [&](int64_t t, const float* fc, const float* fcb, const float* proj, const float* projb, int64_t Fh,
                 double scale) {
    std::vector<double> h(static_cast<size_t>(glu ? 2 * Fh : Fh)), a(static_cast<size_t>(Fh));
    for (size_t j = 0; j < h.size(); ++j) {
      h[j] = fcb ? fcb[j] : 0.0;
      for (int64_t i = 0; i < C; ++i) h[j] += double(fc[j * C + i]) * x[t * C + i];
    }
    for (int64_t j = 0; j < Fh; ++j) a[j] = glu ? silu(h[j]) * h[Fh + j] : gelu(h[j]);
    for (int64_t o = 0; o < C; ++o) {
      double s = projb ? projb[o] : 0.0;
      for (int64_t j = 0; j < Fh; ++j) s += double(proj[o * Fh + j]) * a[j];
      r.y[t * C + o] += scale * s;
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> l(static_cast<size_t>(E)), p(l);
    double m = -INFINITY, s = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      l[e] = 0.0;
      for (int64_t i = 0; i < C; ++i) l[e] += double(w.router[e * C + i]) * x[t * C + i];
      m = std::max(m, l[e]);
    }
    for (int64_t e = 0; e < E; ++e) s += std::exp(l[e] - m);
    const double lse = m + std::log(s);
    r.z += lse * lse;
    for (int64_t e = 0; e < E; ++e)
      p[e] = c.router == MoeConfig::Router::Sigmoid ? 1.0 / (1.0 + std::exp(-l[e])) : std::exp(l[e] - lse);
    std::vector<int> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[e] = int(e), Psum[e] += p[e];
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
    double sk = 0.0;
    for (int64_t k = 0; k < K; ++k) sk += p[order[k]];
    for (int64_t k = 0; k < K; ++k) {
      r.routed[t * K + k] = order[k];
      gate[t * K + k] = p[order[k]] / (c.normalize_gates() ? sk : 1.0);
      cnt[order[k]] += 1;
    }
  }
  r.load = double(*std::max_element(cnt.begin(), cnt.end())) * double(E) / double(T * K);
  // Capacity: an assignment survives when fewer than `cap` assignments to its expert beat it.
  if (const int64_t cap = moe_capacity(c, T); cap > 0) {
    std::vector<int> kept = r.routed;
    for (int64_t a = 0; a < T * K; ++a) {
      int64_t beaten = 0;
      for (int64_t b = 0; b < T * K; ++b) {
        if (b == a || r.routed[b] != r.routed[a]) continue;
        const bool earlier = b / K < a / K;
        beaten += c.drop_policy == Policy::Position ? earlier : (gate[b] > gate[a] || (gate[b] == gate[a] && earlier));
      }
      if (beaten >= cap) kept[a] = -1;
    }
    r.routed = kept;
  }
  const int64_t H = w.H;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int e = r.routed[t * K + k];
      if (e < 0) continue;
      mlp(t, w.fc.data() + e * H * C, c.bias ? w.fcb.data() + e * H : nullptr, w.proj.data() + e * C * F,
          c.bias ? w.projb.data() + e * C : nullptr, F, gate[t * K + k]);
    }
    if (Fs)
      mlp(t, w.sfc.data(), c.bias ? w.sfcb.data() : nullptr, w.sproj.data(), c.bias ? w.sprojb.data() : nullptr, Fs,
          1.0);
  }
  double aux = 0.0;
  for (int64_t e = 0; e < E; ++e) aux += (cnt[e] / double(T * K)) * (Psum[e] / double(T));
  r.aux = c.aux_loss_coeff * double(E) * aux;
  r.z = c.z_loss_coeff * r.z / double(T);
  return r;
}
}  // namespace

TEST_CASE("moe capacity and drop policies on hand-checked cases") {
  MoeConfig c;
  c.num_experts = 2, c.top_k = 1, c.hidden = 1;
  c.capacity_factor = 0.0f;
  CHECK(moe_capacity(c, 100) == 0);  // dropless
  c.capacity_factor = 1.0f;
  CHECK(moe_capacity(c, 4) == 2);
  c.capacity_factor = 1.1f;
  CHECK(moe_capacity(c, 20) == 11);  // 1.1f * 10 is 11, not 12
  c.capacity_factor = 0.3f;
  CHECK(moe_capacity(c, 4) == 1);

  // Four tokens, K = 1, all to expert 0 but token 2 (expert 1). Token indices are not in storage order.
  const std::vector<int32_t> expert = {0, 0, 1, 0};
  const std::vector<float> gate = {0.6f, 0.9f, 0.5f, 0.9f};
  const std::vector<int32_t> index = {3, 2, 1, 0};  // token 3 is the earliest
  auto keep = moe_capacity_keep(expert.data(), gate.data(), index.data(), 4, 1, 2, 2, Policy::Probs);
  // expert 0: gates 0.9 (idx 2), 0.9 (idx 0) win over 0.6; the tie at 0.9 needs no break here.
  CHECK(keep == std::vector<uint8_t>{0, 1, 1, 1});
  keep = moe_capacity_keep(expert.data(), gate.data(), index.data(), 4, 1, 2, 1, Policy::Probs);
  CHECK(keep == std::vector<uint8_t>{0, 0, 1, 1});  // the 0.9 tie goes to the lower token index (0: storage 3)
  keep = moe_capacity_keep(expert.data(), gate.data(), index.data(), 4, 1, 2, 2, Policy::Position);
  CHECK(keep == std::vector<uint8_t>{0, 1, 1, 1});  // earliest: indices 0 (storage 3) and 2 (storage 1)
  keep = moe_capacity_keep(expert.data(), gate.data(), index.data(), 4, 1, 2, 1, Policy::Position);
  CHECK(keep == std::vector<uint8_t>{0, 0, 1, 1});

  // K = 2 over three experts, capacity 2; -1 (already dropped) entries stay dropped.
  const std::vector<int32_t> e2 = {0, 1, 0, 2, 0, 1, -1, 1};
  const std::vector<float> g2 = {0.5f, 0.2f, 0.4f, 0.3f, 0.7f, 0.1f, 0.9f, 0.6f};
  const std::vector<int32_t> i2 = {0, 1, 2, 3};
  keep = moe_capacity_keep(e2.data(), g2.data(), i2.data(), 4, 2, 3, 2, Policy::Probs);
  // expert 0: 0.7 (t2), 0.5 (t0) kept, 0.4 (t1) dropped; expert 1: 0.6 (t3), 0.2 (t0) kept, 0.1 dropped
  CHECK(keep == std::vector<uint8_t>{1, 1, 0, 1, 1, 0, 0, 1});
  keep = moe_capacity_keep(e2.data(), g2.data(), i2.data(), 4, 2, 3, 2, Policy::Position);
  // expert 0: t0, t1 kept, t2 dropped; expert 1: t0, t2 kept, t3 dropped
  CHECK(keep == std::vector<uint8_t>{1, 1, 1, 1, 0, 1, 0, 0});
}

namespace {
struct Case {
  const char* name;
  MoeConfig cfg;
};
std::vector<Case> cases() {
  std::vector<Case> out;
  MoeConfig c;
  c.num_experts = 4, c.top_k = 2, c.hidden = 5;
  c.aux_loss_coeff = 0.1f, c.z_loss_coeff = 0.05f;
  c.capacity_factor = 1.0f;  // capacity 4 of 8 tokens * 2 / 4
  out.push_back({"softmax gelu bias, capacity (probs), aux + z", c});
  c.drop_policy = Policy::Position, c.router = MoeConfig::Router::Sigmoid;
  c.activation = MoeConfig::Activation::Swiglu, c.bias = false;
  out.push_back({"sigmoid swiglu, capacity (position), aux + z", c});
  c.capacity_factor = 0.0f, c.router = MoeConfig::Router::Softmax, c.norm_topk_prob = true;
  c.shared_hidden = 3;
  out.push_back({"softmax renormalised swiglu, dropless, shared expert", c});
  c.activation = MoeConfig::Activation::Gelu, c.bias = true, c.top_k = 1, c.capacity_factor = 0.75f;
  c.norm_topk_prob = false;
  out.push_back({"softmax gelu K=1, capacity 0.75 (probs), shared expert with bias", c});
  return out;
}
}  // namespace

TEST_CASE("moe layer forward against the naive per-token reference") {
  auto ops = make_cpu_ops();
  const int64_t T = 8, C = 6;
  for (const auto& cs : cases()) {
    CAPTURE(cs.name);
    MoeHostWeights w(cs.cfg, C, 41);
    auto x = random_normal(static_cast<size_t>(T * C), 42);
    MoeLayer layer(cs.cfg, *ops, C);
    MoeActs acts;
    std::vector<float> y(static_cast<size_t>(T * C), kNaN);
    const MoeLosses L = layer.forward(acts, as_tensor(y, {T, C}), as_tensor(x, {T, C}), nullptr, w.views());
    const Ref ref = naive_moe(w, x, T);
    int dropped = 0;
    for (int e : ref.routed) dropped += e < 0;
    if (cs.cfg.capacity_factor > 0) CHECK(dropped > 0);  // the case does exercise dropping
    // fp32 products of length <= 6 of unit-scale values: a few 1e-7 relative per term.
    auto r = allclose(y, ref.y, 2e-6, 1e-5);
    CHECK_MESSAGE(r.ok, r.str());
    CHECK(L.aux == doctest::Approx(ref.aux).epsilon(1e-6));
    CHECK(L.z == doctest::Approx(ref.z).epsilon(1e-6));
    CHECK(L.load_imbalance == doctest::Approx(ref.load).epsilon(1e-12));
    // Saved state: at least the expert rows in and out, hidden units and router outputs.
    const int64_t M = int64_t(ref.routed.size()) - dropped, Hh = w.H, Fe = cs.cfg.hidden, E = cs.cfg.num_experts;
    CHECK(acts.bytes() >= size_t(4 * (M * (2 * C + Hh + Fe) + T * 2 * E)));
    CHECK(L.load_imbalance > 1.0);  // 8 tokens over the experts cannot be perfectly even here
  }
}

TEST_CASE("moe layer backward against central finite differences (dx, all weights, router with aux and z)") {
  auto ops = make_cpu_ops();
  const int64_t T = 8, C = 6;
  for (const auto& cs : cases()) {
    CAPTURE(cs.name);
    MoeHostWeights w(cs.cfg, C, 51), g(cs.cfg, C, 0);
    auto x = random_normal(static_cast<size_t>(T * C), 52);
    auto wy = random_normal(static_cast<size_t>(T * C), 53);
    MoeLayer layer(cs.cfg, *ops, C);
    MoeActs acts;
    std::vector<float> y(static_cast<size_t>(T * C));
    const std::vector<int> routing = naive_moe(w, x, T).routed;
    int flips = 0;
    auto loss = [&] {
      const MoeLosses L = layer.forward(acts, as_tensor(y, {T, C}), as_tensor(x, {T, C}), nullptr, w.views());
      flips += naive_moe(w, x, T).routed != routing;  // a perturbation must not change the routing
      return dot(y, wy) + L.aux + L.z;
    };
    std::vector<std::pair<std::string, std::vector<double>>> num;
    // eps 1e-2: loss rounding (~48 fp32 terms of ~1, 1e-6 together) / 2e-2 is ~5e-5, and the
    // truncation eps^2/6 |f'''| stays below ~5e-5 for these unit-scale smooth functions.
    const double eps = 1e-2;
    num.push_back({"x", numerical_gradient(loss, x, eps)});
    for (auto [name, v] : w.all())
      if (!v->empty()) num.push_back({name, numerical_gradient(loss, *v, eps)});
    CHECK(flips == 0);

    loss();
    std::vector<float> dx(static_cast<size_t>(T * C), kNaN);
    MoeWeights gv = g.views();
    layer.backward(as_tensor(dx, {T, C}), acts, as_tensor(wy, {T, C}), w.views(), gv, 1.0f);
    for (auto& [name, n] : num) {
      CAPTURE(name);
      const std::vector<float>* got = &dx;
      for (auto [gname, gvec] : g.all())
        if (name == gname) got = gvec;
      auto r = allclose(*got, n, 2e-4, 2e-3);
      CHECK_MESSAGE(r.ok, r.str());
    }
  }
}

TEST_CASE("moe layer: aux_scale scales exactly the aux and z gradients; gradients accumulate") {
  auto ops = make_cpu_ops();
  const int64_t T = 8, C = 6;
  MoeConfig c = cases()[0].cfg;
  MoeHostWeights w(c, C, 61), g1(c, C, 0), g2(c, C, 0), g0(c, C, 0);
  auto x = random_normal(static_cast<size_t>(T * C), 62), dy = random_normal(static_cast<size_t>(T * C), 63);
  MoeLayer layer(c, *ops, C);
  MoeActs acts;
  std::vector<float> y(static_cast<size_t>(T * C)), dx1(y.size()), dx2(y.size()), dx0(y.size());
  layer.forward(acts, as_tensor(y, {T, C}), as_tensor(x, {T, C}), nullptr, w.views());
  MoeWeights v1 = g1.views(), v2 = g2.views(), v0 = g0.views();
  layer.backward(as_tensor(dx1, {T, C}), acts, as_tensor(dy, {T, C}), w.views(), v1, 1.0f);
  layer.backward(as_tensor(dx2, {T, C}), acts, as_tensor(dy, {T, C}), w.views(), v2, 0.5f);
  layer.backward(as_tensor(dx2, {T, C}), acts, as_tensor(dy, {T, C}), w.views(), v2, 0.5f);  // dx overwritten
  layer.backward(as_tensor(dx0, {T, C}), acts, as_tensor(dy, {T, C}), w.views(), v0, 0.0f);
  // g2 = two halves of the aux part plus twice the main part: g2 - g0 = g1 (in exact arithmetic).
  std::vector<double> want(g1.router.size());
  for (size_t i = 0; i < want.size(); ++i) want[i] = double(g1.router[i]) + double(g0.router[i]);
  auto r = allclose(g2.router, want, 1e-6, 1e-5);
  CHECK_MESSAGE(r.ok, r.str());
  std::vector<double> twice(g1.fc.size());  // expert weights see no aux gradient: two passes accumulated
  for (size_t i = 0; i < twice.size(); ++i) twice[i] = 2.0 * g1.fc[i];
  r = allclose(g2.fc, twice, 1e-6, 1e-6);
  CHECK_MESSAGE(r.ok, r.str());
  std::vector<double> dxw(dx1.size());
  for (size_t i = 0; i < dxw.size(); ++i) dxw[i] = 0.5 * (double(dx1[i]) + double(dx0[i]));
  r = allclose(dx2, dxw, 1e-6, 1e-5);
  CHECK_MESSAGE(r.ok, r.str());
}

TEST_CASE("moe layer with E=1, K=1, no capacity equals the dense MLP with the same weights") {
  auto ops = make_cpu_ops();
  const int64_t T = 7, C = 6;
  for (auto act : {MoeConfig::Activation::Gelu, MoeConfig::Activation::Swiglu}) {
    MoeConfig c;
    c.num_experts = 1, c.top_k = 1, c.hidden = 5, c.activation = act, c.bias = act == MoeConfig::Activation::Gelu;
    MoeHostWeights w(c, C, 71), g(c, C, 0);
    auto x = random_normal(static_cast<size_t>(T * C), 72), dy = random_normal(static_cast<size_t>(T * C), 73);
    MoeLayer layer(c, *ops, C);
    MoeActs acts;
    std::vector<float> y(static_cast<size_t>(T * C)), dx(y.size());
    layer.forward(acts, as_tensor(y, {T, C}), as_tensor(x, {T, C}), nullptr, w.views());
    MoeWeights gv = g.views();
    layer.backward(as_tensor(dx, {T, C}), acts, as_tensor(dy, {T, C}), w.views(), gv, 1.0f);

    const int64_t F = c.hidden, H = w.H;
    std::vector<float> h(static_cast<size_t>(T * H)), a(static_cast<size_t>(T * F)), yd(y.size()), dxd(y.size()),
        da(a.size()), dh(h.size()), dfc(w.fc.size(), 0.0f), dproj(w.proj.size(), 0.0f), dfcb(w.fcb.size(), 0.0f),
        dprojb(w.projb.size(), 0.0f);
    const bool b = c.bias;
    ops->linear_forward(as_tensor(h, {T, H}), as_tensor(x, {T, C}), as_tensor(w.fc, {H, C}),
                        b ? as_tensor(w.fcb, {H}) : Tensor());
    if (b)
      ops->gelu_forward(as_tensor(a, {T, F}), as_tensor(h, {T, H}));
    else
      ops->swiglu_forward(as_tensor(a, {T, F}), as_tensor(h, {T, H}));
    ops->linear_forward(as_tensor(yd, {T, C}), as_tensor(a, {T, F}), as_tensor(w.proj, {C, F}),
                        b ? as_tensor(w.projb, {C}) : Tensor());
    ops->linear_backward(as_tensor(da, {T, F}), as_tensor(dproj, {C, F}), b ? as_tensor(dprojb, {C}) : Tensor(),
                         as_tensor(dy, {T, C}), as_tensor(a, {T, F}), as_tensor(w.proj, {C, F}));
    if (b)
      ops->gelu_backward(as_tensor(dh, {T, H}), as_tensor(da, {T, F}), as_tensor(h, {T, H}));
    else
      ops->swiglu_backward(as_tensor(dh, {T, H}), as_tensor(da, {T, F}), as_tensor(h, {T, H}));
    ops->linear_backward(as_tensor(dxd, {T, C}), as_tensor(dfc, {H, C}), b ? as_tensor(dfcb, {H}) : Tensor(),
                         as_tensor(dh, {T, H}), as_tensor(x, {T, C}), as_tensor(w.fc, {H, C}));
    // The same ops on the same operands, the gate exactly 1 and the router gradient exactly 0.
    CHECK(max_abs_diff(y, yd) == 0.0);
    CHECK(max_abs_diff(dx, dxd) == 0.0);
    CHECK(max_abs_diff(g.fc, dfc) == 0.0);
    CHECK(max_abs_diff(g.proj, dproj) == 0.0);
    CHECK(max_abs_diff(g.fcb, dfcb) == 0.0);
    CHECK(max_abs_diff(g.projb, dprojb) == 0.0);
    CHECK(max_abs(std::vector<double>(g.router.begin(), g.router.end())) == 0.0);
  }
}
