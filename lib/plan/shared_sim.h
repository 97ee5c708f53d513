// The pipeline schedule replayed on shared cores (the CPU backend with more ranks than cores): the
// ranks that have work share the cores equally (processor sharing), idle ranks take none.
#pragma once
#include <vector>

#include "parallel/schedule.h"

namespace mpigpt {

// Replays `schedule` as simulate() does, but with `copies` identical pipelines (the data-, tensor-
// and context-parallel replicas) on `cores` cores: forward[s] / backward[s] are core-seconds of
// work, and while k ranks of each pipeline compute, each runs at min(1, cores / (copies * k)) of a
// core. A message arrives p2p_latency after its send. With cores >= copies * pp it equals simulate().
SimResult simulate_shared(const Schedule& schedule, int pp, int vpp, const SimCosts& work, int copies, int cores);

// Seconds until every task is done when independent tasks of `work` core-seconds start together and
// share `cores` cores equally (each at most one core).
double shared_makespan(std::vector<double> work, int cores);

}  // namespace mpigpt
