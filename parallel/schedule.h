// Pipeline schedules as data (DESIGN principle 4): the pure function that lists, per pipeline
// rank, the forwards, backwards and messages of one training step (plain and interleaved 1F1B),
// the layers each model chunk holds, and a simulator that replays such lists.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mpigpt {

// Forward/Backward compute one micro-batch through one model chunk; the other four move the
// activation (forward direction) or its gradient (backward direction) between neighbouring
// virtual stages. Sends never block; receives block until the data is there.
enum class ActionType : uint8_t { Forward, Backward, SendForward, RecvForward, SendBackward, RecvBackward };

// One step of one pipeline rank. `chunk` is always this rank's model chunk the action belongs
// to: the one that computes, whose output is sent (Send*) or whose input arrives (Recv*).
// `peer` is the pipeline rank on the other end of a message, -1 for compute.
struct Action {
  ActionType type = ActionType::Forward;
  int mb = 0;
  int chunk = 0;
  int peer = -1;
  bool operator==(const Action&) const = default;
};

// schedule[p] = the actions of pipeline rank p, in the order it executes them.
using Schedule = std::vector<std::vector<Action>>;

// The virtual stage of model chunk `chunk` on pipeline rank `pp_rank`: layer block chunk*pp +
// pp_rank (Megatron's interleaved assignment). Activations flow from virtual stage s to s+1, so
// from the last rank's chunk c back to rank 0's chunk c+1.
inline int virtual_stage(int pp, int pp_rank, int chunk) { return chunk * pp + pp_rank; }

// The layers [first, end) held by pipeline rank `pp_rank` in each of its model chunks, where
// stage_layers[s] is the number of layers of virtual stage s (pp * vpp entries, in stage order,
// from pipeline_layers() of the configuration) and chunk v is virtual stage v*pp + pp_rank. A chunk
// may hold no layer (first == end).
std::vector<std::pair<int, int>> layers_of_stage(const std::vector<int>& stage_layers, int pp, int pp_rank);

// The 1F1B schedule of one step with m micro-batches over pp ranks holding vpp model chunks
// each, in Megatron-LM's order: plain 1F1B for vpp == 1 (any m >= 1), Megatron's interleaved 1F1B
// for vpp > 1 (m must be a multiple of pp). Receives sit right before the compute that needs them
// and sends right after the compute that produced them. The executor (pipeline_parallel.h) runs
// these lists over MPI. Throws mpigpt::Error naming the config fields on bad input.
Schedule make_schedule(int pp, int vpp, int m);

// Compact text for logs and docs: compute "F3.1" / "B3.1" (micro-batch 3, chunk 1), sends
// "sF3.1>2" (to rank 2), receives "rB3.1<2" (from rank 2).
std::string to_string(const Action& a);
// One rank's actions separated by spaces; compute_only leaves the messages out.
std::string to_string(const std::vector<Action>& actions, bool compute_only = false);
// Every rank on its own line, "rank 0: F0.0 F1.0 ...".
std::string to_string(const Schedule& schedule, bool compute_only = false);

// Time costs for the simulator. forward[s] / backward[s] is the time of one micro-batch
// through virtual stage s (pp*vpp entries), or a single entry for every stage; a message
// arrives p2p_latency after it was sent.
struct SimCosts {
  std::vector<double> forward{1.0};
  std::vector<double> backward{2.0};
  double p2p_latency = 0;
};

// What replaying a schedule found. errors lists, readably, every unmatched or duplicated
// message and, on a deadlock, where each stuck rank waits; the timing fields are then
// meaningless.
struct SimResult {
  double makespan = 0;              // when the last rank finishes
  double ideal = 0;                 // compute time of the busiest rank: the makespan without bubble
  double bubble = 0;                // (makespan - ideal) / ideal
  std::vector<double> busy;         // compute time per rank
  std::vector<double> finish;       // when each rank finishes
  std::vector<int> peak_in_flight;  // per rank: most (mb, chunk) forwards at once without their backward
  bool deadlock = false;            // some rank has actions left but none can progress
  int unmatched = 0;                // messages sent but never received, received but never sent, or doubled
  std::vector<std::string> errors;
  bool ok() const { return errors.empty(); }
};

// Replay `schedule` (pp ranks, vpp chunks each) on an idealised machine, which measures the bubble
// and the activation memory and finds deadlocks and unmatched messages without running a model:
// compute takes its cost, a send takes no time and its message arrives p2p_latency later, a
// receive waits for its message. A message is identified by (sender, receiver, direction,
// micro-batch, virtual-stage boundary), so each send must meet exactly one receive naming the same.
SimResult simulate(const Schedule& schedule, int pp, int vpp, const SimCosts& costs);
// The same with one forward and one backward cost for every virtual stage.
SimResult simulate(const Schedule& schedule, int pp, int vpp, double forward_cost, double backward_cost,
                   double p2p_latency = 0);

}  // namespace mpigpt
