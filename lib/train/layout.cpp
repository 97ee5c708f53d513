// The --dry-run layout report.
#include "lib/train/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/rank_grid.h"
#include "parallel/schedule.h"

namespace mpigpt {

static std::string ranks_str(const std::vector<int>& r) { return fmt::format("[{}]", fmt::join(r, " ")); }

std::string layout_report(const Config& cfg, int world) {
  const MeshSizes s = mesh_sizes(cfg.parallel);
  const RankGrid d = dense_grid(s, world), e = expert_grid(s, world);
  const int pp = cfg.parallel.pp, vpp = cfg.parallel.vpp;
  std::string out = fmt::format(
      "layout: {} ranks = tp {} x cp {} x dp {} x pp {} (order {}); expert grid: expert_tp {} x ep {} x "
      "expert_dp {} x pp {}\n"
      "model: {} layers in {} pipeline stage(s) x {} virtual stage(s); {} micro-batch(es) of {} per data-parallel "
      "rank per step\n",
      world, s.tp, s.cp, d.size("dp"), pp, s.order, s.expert_tp, s.ep, e.size("dp"), pp, cfg.model.num_layers, pp,
      vpp, cfg.training.global_batch / (cfg.training.micro_batch * d.size("dp")), cfg.training.micro_batch);
  for (int r = 0; r < world; ++r) {
    const int p = d.coord(r, "pp");
    std::string layers;
    for (const auto& [first, end] : layers_of_stage(pipeline_layers(cfg.parallel, cfg.model.num_layers), pp, p))
      layers += std::string(layers.empty() ? "" : ", ") +
                (first == end ? std::string("none") : std::to_string(first) + "-" + std::to_string(end - 1));
    std::string extra;
    if (p == 0) extra += " +embedding";
    if (p == pp - 1) extra += " +head";
    out += fmt::format("{} | layers {}{} | tp {} dp {} pp {} cp {} ep {}\n", describe_rank(s, world, r), layers, extra,
                       ranks_str(d.members(r, "tp")), ranks_str(d.members(r, "dp")), ranks_str(d.members(r, "pp")),
                       ranks_str(d.members(r, "cp")), ranks_str(e.members(r, "ep")));
  }
  return out;
}

}  // namespace mpigpt
