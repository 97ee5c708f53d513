// Tests of the `mpigpt train --dry-run` layout report.
#include "lib/train/layout.h"

#include <doctest/doctest.h>

using namespace mpigpt;

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
