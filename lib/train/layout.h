// The layout report of `mpigpt train --dry-run`: for a config and a world size, which rank
// holds which layers and which ranks it shares each group with, computed without training.
#pragma once
#include <string>
#include <vector>

#include "io/config/config.h"
#include "parallel/rank_grid.h"

namespace mpigpt {

MeshSizes mesh_sizes(const ParallelConfig& p);

// Global layer indices held by pipeline rank `pp_rank`, per model chunk (virtual stage):
// chunk v holds layer block v*pp + pp_rank of num_layers / (pp*vpp) consecutive layers.
std::vector<std::vector<int>> layers_of_stage(int num_layers, int pp, int vpp, int pp_rank);

std::string layout_report(const Config& cfg, int world);

}  // namespace mpigpt
