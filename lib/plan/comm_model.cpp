// Communication volumes per group (following parallel/tensor_parallel, context_parallel,
// expert_parallel as lib/model calls them), group placement on nodes, and ring-algorithm times.
#include "lib/plan/comm_model.h"

#include "lib/core/error.h"
#include "parallel/rank_grid.h"

namespace mpigpt {

namespace {

// The grid and its axis list of a group kind.
struct GroupAxes {
  bool expert = false;
  std::string axes;
};

GroupAxes axes_of(const std::string& group) {
  if (group == "tp" || group == "cp" || group == "pp" || group == "embedding") return {false, group == "embedding" ? "pp" : group};
  if (group == "dp_cp") return {false, "cp-dp"};
  if (group == "ep") return {true, "ep"};
  if (group == "expert_tp_ep") return {true, "tp-ep"};
  if (group == "expert_dp") return {true, "dp"};
  fail("time model: unknown communication group '{}'", group);
}

}  // namespace

int group_size(const Config& cfg, int world_size, const std::string& group) {
  const GroupAxes g = axes_of(group);
  const MeshSizes s = mesh_sizes(cfg.parallel);
  const RankGrid grid = g.expert ? expert_grid(s, world_size) : dense_grid(s, world_size);
  if (group == "embedding") return cfg.parallel.pp > 1 ? 2 : 1;
  return int(grid.members(0, g.axes).size());
}

bool group_inside_node(const Config& cfg, int world_size, int per_node, const std::string& group) {
  MPIGPT_CHECK(per_node > 0, "ranks per node {} must be positive", per_node);
  const GroupAxes g = axes_of(group);
  const MeshSizes s = mesh_sizes(cfg.parallel);
  const RankGrid grid = g.expert ? expert_grid(s, world_size) : dense_grid(s, world_size);
  for (int r = 0; r < world_size; ++r) {
    for (int m : grid.members(r, g.axes)) {
      // The embedding group joins only the first and the last pipeline stage.
      if (group == "embedding" && grid.coord(m, "pp") != 0 && grid.coord(m, "pp") != cfg.parallel.pp - 1) continue;
      if (m / per_node != r / per_node) return false;
    }
  }
  return true;
}

double call_seconds(const CommCall& c, int ranks, const Link& link, double reduce_rate) {
  if (ranks <= 1 || c.bytes <= 0 || c.count <= 0) return 0.0;
  const double p = ranks, share = (p - 1) / p;
  double steps = 0, wire = 0, reduced = 0;  // latency-bound steps, bytes on the wire, elements summed
  switch (c.kind) {
    case CommKind::AllReduce: steps = 2 * (p - 1), wire = 2 * share * c.bytes, reduced = share * c.bytes / 4; break;
    case CommKind::ReduceScatter: steps = p - 1, wire = share * c.bytes, reduced = share * c.bytes / 4; break;
    case CommKind::AllGather:
    case CommKind::AllToAll: steps = p - 1, wire = share * c.bytes; break;
    case CommKind::P2P: steps = 1, wire = c.bytes; break;
  }
  return c.count * (steps * link.latency + wire / link.bandwidth + reduced * reduce_rate);
}

double p2p_bytes(const Config& cfg, const GptDims& d) {
  const ParallelConfig& p = cfg.parallel;
  const double rows = double(cfg.training.micro_batch) * d.T / p.cp / (p.sequence_parallel ? p.tp : 1);
  return rows * d.C * double(dtype_size(d.act));
}

namespace {

// One layer's tensor- and context-parallel calls, forward or backward (without recompute).
void layer_comm(std::vector<CommCall>& out, const Config& cfg, const GptDims& d, int l, bool backward) {
  const ParallelConfig& p = cfg.parallel;
  const double act = double(dtype_size(d.act)), B = cfg.training.micro_batch, Tl = double(d.T) / p.cp;
  const double rows = B * Tl, full = rows * d.C * act;
  if (p.tp > 1) {
    if (p.sequence_parallel) {  // each all-reduce becomes a reduce-scatter and an all-gather
      out.push_back({"tp", CommKind::AllGather, full, 2});
      out.push_back({"tp", CommKind::ReduceScatter, full, 2});
      // The backward gathers the norm outputs again for the weight gradients (a dense MLP's too).
      if (backward) out.push_back({"tp", CommKind::AllGather, full, d.is_moe(l) ? 1.0 : 2.0});
    } else {
      out.push_back({"tp", CommKind::AllReduce, full, 2});
    }
  }
  if (p.cp > 1) {
    const double block = rows * 2 * (d.NKV / p.tp) * d.HD() * act;  // this rank's K and V
    if (p.cp_comm_type == "all_gather") {
      out.push_back({"cp", CommKind::AllGather, block * p.cp, 1});
      if (backward) out.push_back({"cp", CommKind::ReduceScatter, block * p.cp, 1});
    } else {  // the ring: cp-1 blocks forward; backward cp-1 K/V and cp dK/dV blocks
      out.push_back({"cp", CommKind::P2P, block, double(backward ? 2 * p.cp - 1 : p.cp - 1)});
    }
  }
  if (d.is_moe(l) && p.ep > 1) {
    const double sent = rows * d.moe.K * d.C * act;  // this rank's N*K rows, dispatched and combined
    if (p.moe_dispatcher == "allgather") {
      const double P = double(p.ep) * p.expert_tp;
      out.push_back({"expert_tp_ep", CommKind::AllGather, P * full, 1});
      out.push_back({"expert_tp_ep", CommKind::ReduceScatter, P * full, 1});
    } else {
      out.push_back({"ep", CommKind::AllToAll, sent, 2});
    }
  }
}

}  // namespace

std::vector<CommCall> stage_comm(const Config& cfg, const GptDims& d, int first, int end, bool embedding, bool head,
                                 bool backward) {
  const ParallelConfig& p = cfg.parallel;
  std::vector<CommCall> out;
  const double act = double(dtype_size(d.act)), rows = double(cfg.training.micro_batch) * d.T / p.cp;
  const double full = rows * d.C * act;
  const bool recompute = backward && cfg.engine.recompute == "full";
  for (int l = first; l < end; ++l) {
    layer_comm(out, cfg, d, l, backward);
    if (recompute) layer_comm(out, cfg, d, l, false);
  }
  if (p.tp > 1) {
    const CommKind reduce = p.sequence_parallel ? CommKind::ReduceScatter : CommKind::AllReduce;
    if (embedding && !backward) out.push_back({"tp", reduce, full, 1});  // vocab-parallel embedding's sum
    if (embedding && backward && p.sequence_parallel) out.push_back({"tp", CommKind::AllGather, full, 1});
    if (head && !backward) {
      if (p.sequence_parallel) out.push_back({"tp", CommKind::AllGather, full, 1});
      out.push_back({"tp", CommKind::AllReduce, rows * 4, 3});  // vocab-parallel softmax: max, sum, target logit
    }
    if (head && backward) out.push_back({"tp", reduce, full, 1});
  }
  return out;
}

}  // namespace mpigpt
