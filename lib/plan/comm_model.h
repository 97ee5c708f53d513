// The communication of a step for the time model: each group's calls and bytes, whether the group
// stays inside a node (decided by the rank order), and a call's time as latency + bytes / bandwidth.
#pragma once
#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/model/gpt_dims.h"
#include "lib/plan/profile.h"

namespace mpigpt {

enum class CommKind { AllReduce, ReduceScatter, AllGather, AllToAll, P2P };

// `count` calls over `group` (the Mesh's names: tp, cp, pp, dp_cp, ep, expert_dp, embedding), each
// moving a buffer of `bytes` (a gather's whole output, a reduction's whole input, a message).
struct CommCall {
  std::string group;
  CommKind kind = CommKind::AllReduce;
  double bytes = 0;
  double count = 1;
};

// Whether every group of kind `group` ("tp", "cp", "dp_cp", "pp", "ep", "expert_dp", "embedding")
// has all its ranks on one node of `per_node` consecutive world ranks, under cfg.parallel.order.
bool group_inside_node(const Config& cfg, int world_size, int per_node, const std::string& group);
// The ranks in a group of that kind (1: no communication).
int group_size(const Config& cfg, int world_size, const std::string& group);

// Seconds of one call among `ranks` ranks over `link` (ring algorithms: an all-reduce moves
// 2 (p-1)/p of the buffer per rank, a reduce-scatter or all-gather (p-1)/p), plus the reduction's
// additions at the profile's reduce_rate.
double call_seconds(const CommCall& c, int ranks, const Link& link, double reduce_rate);

// The tensor-, context- and expert-parallel calls of one micro-batch through layers [first, end)
// of a virtual stage (with the embedding / head), forward or backward (with recompute's repeats).
std::vector<CommCall> stage_comm(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head,
                                 bool backward);
// The bytes of one pipeline message (an activation or its gradient between virtual stages).
double p2p_bytes(const Config& cfg, const GptDims& d);

}  // namespace mpigpt
