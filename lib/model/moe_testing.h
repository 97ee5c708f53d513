// Test helpers for the MoE layer: the global weights of a layer as host vectors (views of any
// contiguous slab of experts), shared by moe_test.cpp and the expert-parallel tests.
#pragma once
#include <vector>

#include "lib/kernels/testing.h"
#include "lib/model/moe.h"

namespace mpigpt::testing {

struct MoeHostWeights {
  MoeConfig cfg;
  int64_t C = 0, H = 0, Hs = 0;
  std::vector<float> router, fc, fcb, proj, projb, sfc, sfcb, sproj, sprojb;

  // Random weights (zeros when seed == 0, for gradients).
  MoeHostWeights(const MoeConfig& c, int64_t C_, uint64_t seed) : cfg(c), C(C_) {
    const bool glu = cfg.activation == MoeConfig::Activation::Swiglu;
    const int64_t E = cfg.num_experts, F = cfg.hidden, Fs = cfg.shared_hidden;
    H = glu ? 2 * F : F, Hs = glu ? 2 * Fs : Fs;
    auto make = [&](std::vector<float>& v, int64_t n, uint64_t stream, float sd) {
      v.assign(static_cast<size_t>(n), 0.0f);
      if (seed) fill_normal(v, seed, stream, sd);
    };
    make(router, E * C, 1, 0.6f);
    make(fc, E * H * C, 2, 0.5f);
    make(proj, E * C * F, 4, 0.5f);
    if (cfg.bias) make(fcb, E * H, 3, 0.2f), make(projb, E * C, 5, 0.2f);
    if (Fs) {
      make(sfc, Hs * C, 6, 0.5f), make(sproj, C * Fs, 8, 0.5f);
      if (cfg.bias) make(sfcb, Hs, 7, 0.2f), make(sprojb, C, 9, 0.2f);
    }
  }
  // Views of experts [first, first + El) (all when El = 0).
  MoeWeights views(int first = 0, int El = 0) {
    const int64_t E = cfg.num_experts, F = cfg.hidden, Fs = cfg.shared_hidden;
    if (El == 0) El = int(E);
    auto v = [](std::vector<float>& x, int64_t off, Shape s) {
      return x.empty() ? Tensor() : Tensor(x.data() + off, s);
    };
    MoeWeights w;
    w.router = v(router, 0, {E, C});
    w.fc = v(fc, first * H * C, {El, H, C});
    w.fc_bias = v(fcb, first * H, {El, H});
    w.proj = v(proj, first * C * F, {El, C, F});
    w.proj_bias = v(projb, first * C, {El, C});
    if (Fs) {
      w.shared_fc = v(sfc, 0, {Hs, C});
      w.shared_fc_bias = v(sfcb, 0, {Hs});
      w.shared_proj = v(sproj, 0, {C, Fs});
      w.shared_proj_bias = v(sprojb, 0, {C});
    }
    return w;
  }
  // Every parameter vector with a name (for loops over gradients).
  std::vector<std::pair<const char*, std::vector<float>*>> all() {
    return {{"router", &router},          {"fc", &fc},         {"fc_bias", &fcb},         {"proj", &proj},
            {"proj_bias", &projb},        {"shared_fc", &sfc}, {"shared_fc_bias", &sfcb}, {"shared_proj", &sproj},
            {"shared_proj_bias", &sprojb}};
  }
};

}  // namespace mpigpt::testing
