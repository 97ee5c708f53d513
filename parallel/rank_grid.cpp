// Rank-grid arithmetic.
#include "parallel/rank_grid.h"

#include <fmt/format.h>

#include <algorithm>
#include <sstream>

#include "lib/core/error.h"

namespace mpigpt {

std::vector<std::string> parse_order(const std::string& order) {
  static const std::vector<std::string> known = {"tp", "cp", "ep", "dp", "pp"};
  const std::string fix = "write the five axes tp, cp, ep, dp, pp once each, joined by '-' (default tp-cp-ep-dp-pp)";
  std::vector<std::string> axes;
  std::stringstream ss(order);
  std::string a;
  while (std::getline(ss, a, '-')) {
    if (std::find(known.begin(), known.end(), a) == known.end())
      fail("parallel.order = '{}': '{}' is not an axis; {}", order, a, fix);
    if (std::find(axes.begin(), axes.end(), a) != axes.end())
      fail("parallel.order = '{}' names the axis {} twice; {}", order, a, fix);
    axes.push_back(a);
  }
  if (!order.empty() && order.back() == '-') fail("parallel.order = '{}': '' is not an axis; {}", order, fix);
  for (const std::string& k : known)
    if (std::find(axes.begin(), axes.end(), k) == axes.end())
      fail("parallel.order = '{}' lacks the axis {}; {}", order, k, fix);
  return axes;
}

RankGrid::RankGrid(std::vector<std::string> axes, std::vector<int> sizes)
    : axes_(std::move(axes)), sizes_(std::move(sizes)) {
  MPIGPT_CHECK(axes_.size() == sizes_.size(), "{} axes, {} sizes", axes_.size(), sizes_.size());
  for (int s : sizes_) {
    MPIGPT_CHECK(s >= 1, "axis size {}", s);
    strides_.push_back(world_);
    world_ *= s;
  }
}

int RankGrid::size(const std::string& axis) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i] == axis) return sizes_[i];
  fail("rank grid has no axis '{}'", axis);
}

int RankGrid::coord(int rank, const std::string& axis) const {
  for (size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i] == axis) return rank / strides_[i] % sizes_[i];
  fail("rank grid has no axis '{}'", axis);
}

std::vector<bool> RankGrid::mask(const std::string& group) const {
  std::vector<bool> in(axes_.size(), false);
  // Split on '-' by hand: the planner asks for thousands of groups, and a stringstream each is slow.
  for (size_t start = 0; start < group.size();) {
    const size_t end = std::min(group.find('-', start), group.size());
    const std::string_view a(group.data() + start, end - start);
    start = end + 1;
    auto it = std::find(axes_.begin(), axes_.end(), a);
    MPIGPT_CHECK(it != axes_.end(), "group '{}' names axis '{}' the grid does not have", group, a);
    in[it - axes_.begin()] = true;
  }
  return in;
}

std::vector<int> RankGrid::members(int rank, const std::string& group) const {
  const auto in = mask(group);
  // Start from the rank with the group's coordinates zeroed, then count through the group's
  // axes with the leftmost fastest.
  int base = rank;
  std::vector<size_t> g;
  for (size_t i = 0; i < axes_.size(); ++i)
    if (in[i]) {
      base -= (rank / strides_[i] % sizes_[i]) * strides_[i];
      g.push_back(i);
    }
  std::vector<int> out = {base};
  for (size_t i : g) {
    const size_t n = out.size();
    for (int c = 1; c < sizes_[i]; ++c)
      for (size_t k = 0; k < n; ++k) out.push_back(out[k] + c * strides_[i]);
  }
  return out;
}

int RankGrid::group_index(int rank, const std::string& group) const {
  const auto in = mask(group);
  int index = 0, mult = 1;
  for (size_t i = 0; i < axes_.size(); ++i)
    if (!in[i]) {
      index += (rank / strides_[i] % sizes_[i]) * mult;
      mult *= sizes_[i];
    }
  return index;
}

int RankGrid::group_rank(int rank, const std::string& group) const {
  const auto in = mask(group);
  int pos = 0, mult = 1;
  for (size_t i = 0; i < axes_.size(); ++i)
    if (in[i]) {
      pos += (rank / strides_[i] % sizes_[i]) * mult;
      mult *= sizes_[i];
    }
  return pos;
}

static RankGrid grid_of(const MeshSizes& s, int world, bool expert) {
  const std::vector<std::string> axes = parse_order(s.order);
  const int tp = expert ? s.expert_tp : s.tp, cp = expert ? 1 : s.cp, ep = expert ? s.ep : 1;
  const int mp = tp * cp * ep * s.pp;
  if (world % mp != 0)
    fail("{}: {} = {} does not divide the world size {}; launch a multiple of {} ranks or change the sizes",
         expert ? "expert grid" : "dense grid",
         expert ? "parallel.expert_tp * parallel.ep * parallel.pp" : "parallel.tp * parallel.cp * parallel.pp", mp,
         world, mp);
  std::vector<int> sizes;
  for (const auto& a : axes)
    sizes.push_back(a == "tp" ? tp : a == "cp" ? cp : a == "ep" ? ep : a == "pp" ? s.pp : world / mp);
  return RankGrid(axes, sizes);
}

RankGrid dense_grid(const MeshSizes& s, int world) { return grid_of(s, world, false); }
RankGrid expert_grid(const MeshSizes& s, int world) { return grid_of(s, world, true); }

std::string describe_rank(const MeshSizes& s, int world, int rank) {
  const RankGrid d = dense_grid(s, world), e = expert_grid(s, world);
  return fmt::format("TP{}-CP{}-EP{}-DP{}-PP{} rank {} = (tp {}, cp {}, ep {}, dp {}, pp {})", s.tp, s.cp, s.ep,
                     d.size("dp"), s.pp, rank, d.coord(rank, "tp"), d.coord(rank, "cp"), e.coord(rank, "ep"),
                     d.coord(rank, "dp"), d.coord(rank, "pp"));
}

}  // namespace mpigpt
