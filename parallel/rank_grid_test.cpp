// The rank grid against an independent brute-force enumeration, for many world sizes, layouts
// and order strings: coordinates, group membership, group order, colours and keys.
#include "parallel/rank_grid.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <set>

#include "lib/core/error.h"

using namespace mpigpt;

namespace {

// Enumerate every rank's coordinates by nested counting (leftmost axis fastest) without any
// stride arithmetic, then form groups by comparing coordinates.
struct Brute {
  std::vector<std::string> axes;
  std::vector<std::vector<int>> coords;  // coords[rank][axis]
  Brute(const std::vector<std::string>& a, const std::vector<int>& sizes) : axes(a) {
    std::vector<int> c(sizes.size(), 0);
    while (true) {
      coords.push_back(c);
      size_t i = 0;
      while (i < c.size() && ++c[i] == sizes[i]) c[i++] = 0;
      if (i == c.size()) break;
    }
  }
  std::vector<int> members(int rank, const std::set<std::string>& group) const {
    std::vector<std::pair<std::vector<int>, int>> m;  // (reversed group coords for sorting, rank)
    for (int r = 0; r < int(coords.size()); ++r) {
      bool same = true;
      std::vector<int> key;
      for (size_t a = 0; a < axes.size(); ++a) {
        if (group.count(axes[a]))
          key.insert(key.begin(), coords[r][a]);  // leftmost axis = least significant
        else if (coords[r][a] != coords[rank][a])
          same = false;
      }
      if (same) m.push_back({key, r});
    }
    std::sort(m.begin(), m.end());
    std::vector<int> out;
    for (auto& [k, r] : m) out.push_back(r);
    return out;
  }
};

}  // namespace

TEST_CASE("grid coordinates and groups match brute force for many layouts and orders") {
  const std::vector<std::string> orders = {"tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "pp-dp-tp-cp-ep", "dp-tp-pp-ep-cp"};
  const std::vector<std::string> groups = {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-cp-dp-pp"};
  int checked = 0;
  for (int world : {1, 2, 4, 6, 8, 12, 16, 24}) {
    for (int tp : {1, 2, 3, 4})
      for (int pp : {1, 2, 4})
        for (int cp : {1, 2}) {
          if (world % (tp * pp * cp)) continue;
          for (const auto& order : orders) {
            MeshSizes s{tp, pp, cp, 1, 1, order};
            const RankGrid g = dense_grid(s, world);
            std::vector<int> sizes;
            for (const auto& a : g.axes()) sizes.push_back(g.size(a));
            const Brute b(g.axes(), sizes);
            REQUIRE(g.size("dp") == world / (tp * pp * cp));
            std::map<std::string, std::set<int>> colours;
            for (int r = 0; r < world; ++r) {
              for (size_t a = 0; a < g.axes().size(); ++a) REQUIRE(g.coord(r, g.axes()[a]) == b.coords[r][a]);
              for (const auto& grp : groups) {
                std::set<std::string> set;
                for (size_t p = 0, q; p <= grp.size(); p = q + 1) {
                  q = grp.find('-', p);
                  if (q == std::string::npos) q = grp.size();
                  set.insert(grp.substr(p, q - p));
                }
                const auto m = g.members(r, grp);
                REQUIRE(m == b.members(r, set));
                const auto pos = std::find(m.begin(), m.end(), r) - m.begin();
                REQUIRE(g.group_rank(r, grp) == pos);
                // Every member of a group shares its colour; different groups differ.
                for (int x : m) REQUIRE(g.group_index(x, grp) == g.group_index(r, grp));
                colours[grp].insert(g.group_index(r, grp));
                ++checked;
              }
            }
            for (const auto& grp : groups) {
              const int group_size = int(g.members(0, grp).size());
              REQUIRE(int(colours[grp].size()) == world / group_size);
            }
          }
        }
  }
  CHECK(checked > 1000);
}

TEST_CASE("the expert grid replaces tp by expert_tp and cp by ep over the same ranks") {
  MeshSizes s{2, 2, 2, 2, 1, "tp-cp-ep-dp-pp"};
  const RankGrid e = expert_grid(s, 16);
  CHECK(e.size("tp") == 1);
  CHECK(e.size("ep") == 2);
  CHECK(e.size("cp") == 1);
  CHECK(e.size("dp") == 4);
  const RankGrid d = dense_grid(s, 16);
  for (int r = 0; r < 16; ++r) CHECK(e.members(r, "pp") == d.members(r, "pp"));  // shared pipeline groups
}

TEST_CASE("order strings and sizes that cannot form a grid are named in the error") {
  CHECK_THROWS_WITH_AS(parse_order("tp-cp-xp-dp-pp"), doctest::Contains("'xp' is not an axis"), Error);
  CHECK_THROWS_WITH_AS(parse_order("tp-tp-ep-dp-pp"), doctest::Contains("names the axis tp twice"), Error);
  CHECK_THROWS_WITH_AS(parse_order("tp-dp-pp"), doctest::Contains("lacks the axis cp"), Error);
  CHECK_THROWS_WITH_AS(dense_grid(MeshSizes{2, 2, 1, 1, 1, "tp-cp-ep-dp-pp"}, 6),
                       doctest::Contains("does not divide the world size 6"), Error);
  CHECK_THROWS_WITH_AS(expert_grid(MeshSizes{1, 1, 1, 4, 1, "tp-cp-ep-dp-pp"}, 6),
                       doctest::Contains("expert grid"), Error);
}

TEST_CASE("describe_rank prints the layout and the coordinates") {
  MeshSizes s{2, 2, 1, 1, 1, "tp-cp-ep-dp-pp"};
  CHECK(describe_rank(s, 8, 5) == "TP2-CP1-EP1-DP2-PP2 rank 5 = (tp 1, cp 0, ep 0, dp 0, pp 1)");
}
