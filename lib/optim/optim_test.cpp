// Tests of the learning-rate schedule, the AdamW parameter groups, AdamW over owned ranges
// of a padded buffer, and gradient clipping.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>

#include "lib/kernels/buffer.h"
#include "lib/optim/adamw.h"
#include "lib/optim/lr_schedule.h"

using namespace mpigpt;

namespace {
OptimParam param(const std::string& name, int64_t n, bool decay, int64_t offset) {
  OptimParam p;
  p.name = name;
  p.numel = n;
  p.decay = decay;
  p.offset = offset;
  return p;
}
}  // namespace

TEST_CASE("warmup is linear from 0; cosine reaches min_lr at the end of decay and stays there") {
  LrSchedule s{1e-3, 1e-4, 10, 90, DecayStyle::Cosine};
  CHECK(s.at(1) == doctest::Approx(1e-4));
  CHECK(s.at(10) == doctest::Approx(1e-3));
  CHECK(s.at(55) == doctest::Approx(1e-4 + 0.5 * 9e-4));  // half-way: cos = 0
  CHECK(s.at(100) == doctest::Approx(1e-4));
  CHECK(s.at(500) == doctest::Approx(1e-4));
  for (int64_t it = 11; it < 100; ++it) CHECK(s.at(it + 1) <= s.at(it));
}

TEST_CASE("linear and constant decay") {
  LrSchedule lin{1.0, 0.0, 0, 10, DecayStyle::Linear};
  CHECK(lin.at(5) == doctest::Approx(0.5));
  CHECK(lin.at(10) == doctest::Approx(0.0));
  LrSchedule cst{2.0, 0.0, 4, 10, DecayStyle::Constant};
  CHECK(cst.at(2) == doctest::Approx(1.0));
  CHECK(cst.at(50) == doctest::Approx(2.0));
  CHECK_THROWS_WITH_AS(parse_decay_style("exp"), doctest::Contains("training.lr_schedule = 'exp'"), Error);
}

TEST_CASE("AdamW decays only the weight ranges and matches the scalar formula") {
  auto ops = make_cpu_ops();
  std::vector<OptimParam> table = {param("w", 4, true, 0), param("b", 2, false, 4), param("e", 3, false, 6)};
  Buffer pb(*ops, 9 * 4), gb(*ops, 9 * 4);
  Tensor p = pb.tensor({9}), g = gb.tensor({9});
  for (int i = 0; i < 9; ++i) {
    p.f32()[i] = 1.0f + 0.1f * i;
    g.f32()[i] = 0.5f - 0.1f * i;
  }
  AdamWConfig cfg;
  cfg.weight_decay = 0.5f;
  AdamW opt(*ops, table, p, g, cfg);
  std::vector<double> ref_p(9), m(9, 0), v(9, 0);
  for (int i = 0; i < 9; ++i) ref_p[i] = p.f32()[i];
  for (int step = 1; step <= 3; ++step) {
    const double lr = 0.01, scale = 0.5;
    opt.step(float(lr), float(scale));
    for (int i = 0; i < 9; ++i) {
      const double gi = g.f32()[i] * scale;
      m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * gi;
      v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * gi * gi;
      const double mh = m[i] / (1 - std::pow(cfg.beta1, step)), vh = v[i] / (1 - std::pow(cfg.beta2, step));
      const double wd = i < 4 ? cfg.weight_decay : 0.0;
      ref_p[i] -= lr * (mh / (std::sqrt(vh) + cfg.eps) + wd * ref_p[i]);
    }
  }
  for (int i = 0; i < 9; ++i) CHECK(p.f32()[i] == doctest::Approx(ref_p[i]).epsilon(1e-5));
  CHECK(opt.steps() == 3);
}

TEST_CASE("AdamW over owned slices of a padded buffer: the slices together are the full update") {
  auto ops = make_cpu_ops();
  const std::vector<int64_t> numels = {37, 100, 5, 64, 300, 17, 1, 250};
  const bool decays[] = {false, true, false, false};  // as embedding, weight, bias, norm
  const int dp = 3;
  const BufferLayout L = plan_buffer(numels, 96, dp, 16);
  std::vector<OptimParam> table;
  for (size_t i = 0; i < numels.size(); ++i)  // not "p" + ...: a GCC 12 -Wrestrict false positive
    table.push_back(param(std::string("p").append(std::to_string(i)), numels[i], decays[i % 4], L.offsets[i]));
  const std::vector<Range> params = L.param_ranges();
  // params and gradients; padding holds sentinels that must survive (a NaN gradient would spread)
  std::vector<float> p0(L.total, 123.0f), g(L.total, std::nanf(""));
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (const Range& x : params)
    for (int64_t i = x.begin; i < x.end; ++i) {
      p0[i] = nd(rng);
      g[i] = nd(rng);
    }
  AdamWConfig cfg;
  cfg.weight_decay = 0.3f;
  std::vector<float> full = p0, sliced = p0;
  const Tensor G(g.data(), {L.total});
  AdamW whole(*ops, table, Tensor(full.data(), {L.total}), G, cfg);
  std::vector<std::unique_ptr<AdamW>> parts;
  int64_t state = 0;
  for (int r = 0; r < dp; ++r) {
    const std::vector<Range> own = owned_ranges(L, true, r);
    parts.push_back(std::make_unique<AdamW>(*ops, table, Tensor(sliced.data(), {L.total}), G, cfg, own));
    CHECK(parts.back()->state_numel() == total_size(intersect_ranges(own, params)));
    CHECK(parts.back()->state_bytes() == dp_memory(L, true, r).optimizer);
    state += parts.back()->state_numel();
    // the pieces are exactly the owned parameter elements, each inside its parameter
    std::vector<Range> covered;
    for (const AdamW::Piece& pc : parts.back()->pieces()) {
      CHECK(pc.begin >= table[pc.param].offset);
      CHECK(pc.begin + pc.count <= table[pc.param].offset + table[pc.param].numel);
      covered.push_back({pc.begin, pc.begin + pc.count});
    }
    CHECK(normalize_ranges(covered) == intersect_ranges(own, params));
  }
  CHECK(state == whole.state_numel());
  CHECK(whole.state_numel() == total_size(params));
  bool cuts_through = false;  // the test means something only if a slice splits a parameter
  for (int r = 1; r < dp; ++r)
    for (size_t b = 0; b < L.buckets.size(); ++b)
      for (const Range& x : params) cuts_through |= x.begin < L.slice(int(b), r).begin && L.slice(int(b), r).begin < x.end;
  CHECK(cuts_through);
  for (int step = 1; step <= 3; ++step) {
    whole.step(0.01f, 0.7f);
    for (auto& o : parts) o->step(0.01f, 0.7f);
  }
  CHECK(std::memcmp(full.data(), sliced.data(), full.size() * 4) == 0);  // bit for bit, padding included
  for (int64_t i = 0; i < L.total; ++i)
    if (!std::isnan(g[i])) CHECK(full[i] != p0[i]);
    else CHECK(full[i] == 123.0f);
}

TEST_CASE("sum_squares_of adds up the given ranges only") {
  auto ops = make_cpu_ops();
  std::vector<float> g = {1, 2, 3, 4, 5, 6};
  const Tensor t(g.data(), {6});
  CHECK(sum_squares_of(*ops, t, {{0, 2}, {4, 5}}) == 1 + 4 + 25);
  CHECK(sum_squares_of(*ops, t, {}) == 0);
  CHECK(sum_squares_of(*ops, t, {{0, 6}}) == doctest::Approx(grad_norm(*ops, t) * grad_norm(*ops, t)));
  CHECK_THROWS_WITH_AS(sum_squares_of(*ops, t, {{5, 7}}), doctest::Contains("outside 6"), Error);
}

TEST_CASE("clipping scales the gradient norm down to the limit, never up") {
  CHECK(clip_scale(0.5, 1.0) == 1.0f);
  CHECK(clip_scale(4.0, 1.0) == doctest::Approx(0.25).epsilon(1e-5));
  CHECK(clip_scale(4.0, 0.0) == 1.0f);
  auto ops = make_cpu_ops();
  Buffer b(*ops, 2 * 4);
  Tensor t = b.tensor({2});
  t.f32()[0] = 3;
  t.f32()[1] = 4;
  CHECK(grad_norm(*ops, t) == doctest::Approx(5.0));
}
