// Alpa's stage assignment: contiguous layer ranges for the pipeline's virtual stages that minimise
// a step's time, sum(stage time) + (micro-batches - 1) * max(stage time), as a pipeline_layout.
#pragma once
#include <functional>
#include <vector>

namespace mpigpt {

// Seconds of one micro-batch's forward and backward on virtual stage `stage` holding layers
// [first, end) (first == end: none); +infinity where that stage cannot hold them (memory).
using StageCost = std::function<double(int stage, int first, int end)>;

struct StageAssignment {
  std::vector<int> layers;  // per virtual stage, in stage order (parallel.pipeline_layout)
  double sum = 0, max = 0;  // of the stage times
  double time = 0;          // sum + (micro_batches - 1) * max
};

// The assignment of `num_layers` layers to `stages` virtual stages with the least time. Alpa's
// dynamic program: for each candidate bound on the stage time (the costs of all ranges, in
// increasing order, from the least one some assignment meets), the least sum under that bound; it
// stops once the least unbounded sum plus (micro_batches - 1) * bound reaches the best time found.
// Throws mpigpt::Error when no assignment has a finite time.
StageAssignment assign_stages(int num_layers, int stages, int micro_batches, const StageCost& cost);

// The cost of additive stages: the layers' own times plus `embedding` on stage 0 and `head` on
// the last of `stages`.
StageCost additive_stage_cost(std::vector<double> layer_times, double embedding, double head, int stages);

}  // namespace mpigpt
