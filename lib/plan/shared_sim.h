// The pipeline schedule replayed on shared cores (the CPU backend with more ranks than cores): the
// ranks that have work share the cores they are placed on; waiting ranks take no core time but, being
// runnable (Open MPI yields while waiting when oversubscribed), take places on the cores.
#pragma once
#include <vector>

#include "parallel/schedule.h"

namespace mpigpt {

// Replays `schedule` as simulate() does, but with `copies` identical pipelines (the data-, tensor-
// and context-parallel replicas) on `cores` cores: forward[s] / backward[s] are core-seconds of
// work, and while k ranks of each pipeline compute and the others wait, each computing rank runs at
// busy_cores(copies * k, copies * (pp - k), cores) / (copies * k) of a core. A message arrives
// p2p_latency after its send. With cores >= copies * pp it equals simulate().
SimResult simulate_shared(const Schedule& schedule, int pp, int vpp, const SimCosts& work, int copies, int cores);

// Seconds until every task is done when independent tasks of `work` core-seconds start together and
// share the cores as above (a finished task waits for the others, on its core).
double shared_makespan(std::vector<double> work, int cores);

// The cores that `working` ranks keep busy when they and `waiting` ranks are spread evenly over
// `cores` cores (the scheduler balances runnable tasks) in random places: a core whose places all
// hold waiting ranks idles. The expected count of cores holding a working rank, at most `working`.
double busy_cores(int working, int waiting, int cores);

}  // namespace mpigpt
