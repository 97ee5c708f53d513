// Tests of the layer assignment of (interleaved) pipeline stages and of the dry-run report.
#include "lib/train/layout.h"

#include <doctest/doctest.h>

#include <set>

using namespace mpigpt;

TEST_CASE("chunk v on pipeline rank p holds layer block v*pp+p; all layers exactly once") {
  CHECK(layers_of_stage(8, 2, 2, 1) == std::vector<std::vector<int>>{{2, 3}, {6, 7}});
  CHECK(layers_of_stage(8, 4, 1, 3) == std::vector<std::vector<int>>{{6, 7}});
  for (int pp : {1, 2, 4})
    for (int vpp : {1, 2}) {
      std::multiset<int> all;
      for (int p = 0; p < pp; ++p)
        for (const auto& c : layers_of_stage(16, pp, vpp, p)) all.insert(c.begin(), c.end());
      CHECK(all.size() == 16);
      CHECK(std::set<int>(all.begin(), all.end()).size() == 16);
    }
}

TEST_CASE("dry-run report lists every rank with coordinates, layers and groups") {
  Config cfg;
  cfg.parallel.tp = 2;
  cfg.parallel.pp = 2;
  cfg.model.num_layers = 4;
  cfg.training.micro_batch = 1;
  cfg.training.global_batch = 4;
  cfg.resolve_defaults();
  const std::string r = layout_report(cfg, 8);
  CHECK(r.find("8 ranks = tp 2 x cp 1 x dp 2 x pp 2") != std::string::npos);
  CHECK(r.find("TP2-CP1-EP1-DP2-PP2 rank 5 = (tp 1, cp 0, ep 0, dp 0, pp 1) | layers 2-3 +head | tp [4 5] dp [5 7] "
               "pp [1 5]") != std::string::npos);
  CHECK(r.find("rank 0 = (tp 0, cp 0, ep 0, dp 0, pp 0) | layers 0-1 +embedding") != std::string::npos);
}
