// The rank grid as pure arithmetic (no MPI): which coordinates a rank has, and which ranks
// share a group, for an order string whose leftmost axis varies fastest. The Mesh turns these
// groups into communicators; tests and `mpigpt train --dry-run` use the grid directly.
#pragma once
#include <string>
#include <vector>

namespace mpigpt {

// Sizes of the parallel dimensions; dp is derived from the world size.
struct MeshSizes {
  int tp = 1, pp = 1, cp = 1, ep = 1, expert_tp = 1;
  std::string order = "tp-cp-ep-dp-pp";
};

// The sizes of a parallel configuration (io's ParallelConfig; parallel/ includes nothing of io/,
// so any struct with these fields will do).
template <class ParallelConfig>
MeshSizes mesh_sizes(const ParallelConfig& p) {
  return MeshSizes{p.tp, p.pp, p.cp, p.ep, p.expert_tp, p.order};
}

class RankGrid {
 public:
  // axes: names in order (leftmost varies fastest), sizes: the matching extents.
  RankGrid(std::vector<std::string> axes, std::vector<int> sizes);
  int world() const { return world_; }
  const std::vector<std::string>& axes() const { return axes_; }
  int size(const std::string& axis) const;
  int coord(int rank, const std::string& axis) const;
  // The ranks that agree with `rank` on every axis not named in `group` (a '-' separated list
  // such as "tp-dp"), ordered by their coordinates on the group's axes (leftmost fastest).
  std::vector<int> members(int rank, const std::string& group) const;
  // Index of that group among all groups of the same kind (the colour of an MPI_Comm_split).
  int group_index(int rank, const std::string& group) const;
  // Position of `rank` inside its group (the key of an MPI_Comm_split).
  int group_rank(int rank, const std::string& group) const;

 private:
  std::vector<bool> mask(const std::string& group) const;
  std::vector<std::string> axes_;
  std::vector<int> sizes_, strides_;
  int world_ = 1;
};

// Parse and check an order string: a permutation of tp, cp, ep, dp, pp joined by '-'.
std::vector<std::string> parse_order(const std::string& order);

// The dense grid (tp, cp, dp, pp; ep = 1) and the expert grid (expert_tp as tp, ep, dp as the
// expert-dp, pp; cp = 1) over the same world, both in the order of `s.order`.
RankGrid dense_grid(const MeshSizes& s, int world);
RankGrid expert_grid(const MeshSizes& s, int world);

// "TP2-CP1-EP1-DP2-PP2 rank 5 = (tp 1, cp 0, ep 0, dp 0, pp 1)"
std::string describe_rank(const MeshSizes& s, int world, int rank);

}  // namespace mpigpt
