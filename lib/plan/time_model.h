// The planner's time model: the predicted step time of a configuration on a device profile, from
// per-op compute, per-group communication, mpigpt's overlaps and the simulated pipeline schedule.
#pragma once
#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/model/gpt_dims.h"
#include "lib/plan/memory.h"
#include "lib/plan/profile.h"

namespace mpigpt {

// One group's communication in a step, on the rank where it costs most.
struct GroupTime {
  std::string group;        // tp, cp, pp, dp_cp, ep, expert_tp_ep, embedding
  int ranks = 1;
  bool inside_node = true;  // every such group on one node (the intra-node link) or not (the network)
  double seconds = 0;       // all its calls
  double exposed = 0;       // what the step waits for (not hidden behind compute)
};

// One pipeline rank (all its model chunks).
struct StageTime {
  int pp_rank = 0;
  int layers = 0;
  double forward = 0, backward = 0;  // one micro-batch through all its chunks: compute and exposed tp/cp/ep
  double compute = 0;                // the step's compute: forwards, backwards, recompute, optimizer
  double pipeline_end = 0;           // when its last backward ends (the simulated schedule)
  double after = 0;                  // then: gradient reduction, embedding sum, optimizer (exposed)
};

struct TimeEstimate {
  std::string device;
  int micro_batches = 0;
  double step = 0;         // predicted seconds per step
  double compute = 0;      // the busiest rank's compute
  double pipeline = 0;     // the simulated schedule's makespan
  double bubble = 0;       // idle time of the busiest rank within the pipeline (seconds)
  double optimizer = 0;    // the largest rank's optimizer step
  bool shared_cores = false;  // ranks share cores (processor sharing replay)
  std::vector<GroupTime> groups;
  std::vector<StageTime> stages;
  double exposed_comm() const;  // sum of the groups' exposed seconds
  std::string report() const;   // multi-line breakdown
};

// The step time of `cfg` (validated for `world_size`) on ranks placed `per_node` to a node in
// world-rank order, on `device`. `d` is the resolved model shape (lib/train's make_dims).
// Optional: `cache` supplies the schedules, `memory` the estimate_memory of this cfg already made.
TimeEstimate estimate_time(const Config& cfg, const GptDims& d, int world_size, int per_node,
                           const DeviceProfile& device, ScheduleCache* cache = nullptr,
                           const MemoryEstimate* memory = nullptr);

}  // namespace mpigpt
