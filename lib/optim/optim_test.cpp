// Tests of the learning-rate schedule, the AdamW parameter groups and gradient clipping.
#include <doctest/doctest.h>

#include <cmath>

#include "lib/kernels/buffer.h"
#include "lib/optim/adamw.h"
#include "lib/optim/lr_schedule.h"

using namespace mpigpt;

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

TEST_CASE("no_decay parsing names the bad kind") {
  CHECK(parse_no_decay("norms, biases").size() == 2);
  CHECK(parse_no_decay("none").empty());
  CHECK_THROWS_WITH_AS(parse_no_decay("norms,bias"), doctest::Contains("'bias'"), Error);
}

TEST_CASE("AdamW decays only the weight ranges and matches the scalar formula") {
  auto ops = make_cpu_ops();
  std::vector<ParamInfo> table = {{"w", {4}, ParamKind::Weight, 0, 0, -1},
                                  {"b", {2}, ParamKind::Bias, 4, 0, -1},
                                  {"e", {3}, ParamKind::Embedding, 6, 0, -1}};
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
