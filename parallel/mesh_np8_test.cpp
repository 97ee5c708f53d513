// Eight ranks: every communicator of the Mesh holds exactly the ranks the grid says, in the
// grid's order, and collectives over them sum over exactly those ranks.
#include "parallel/mesh.h"

#include <doctest/doctest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "parallel/mpi_env.h"

using namespace mpigpt;

namespace {

// World ranks of a communicator's members, in its own rank order.
std::vector<int> world_ranks(const Comm& c) {
  std::vector<int> out(c.size());
  MPI_Group g, w;
  MPI_Comm_group(c.mpi(), &g);
  MPI_Comm_group(MPI_COMM_WORLD, &w);
  std::vector<int> local(c.size());
  for (int i = 0; i < c.size(); ++i) local[i] = i;
  MPI_Group_translate_ranks(g, c.size(), local.data(), w, out.data());
  MPI_Group_free(&g);
  MPI_Group_free(&w);
  return out;
}

}  // namespace

TEST_CASE("mesh communicators match the rank grid (tp2 pp2 dp2, two orders; ep2 expert grid)") {
  for (const char* order : {"tp-cp-ep-dp-pp", "pp-dp-ep-cp-tp"}) {
    CAPTURE(order);
    Mesh mesh(MPI_COMM_WORLD, MeshSizes{2, 2, 1, 2, 1, order});
    REQUIRE(mesh.world_size() == 8);
    const int r = mesh.rank();
    const RankGrid& d = mesh.dense();
    CHECK(world_ranks(mesh.tp()) == d.members(r, "tp"));
    CHECK(world_ranks(mesh.dp()) == d.members(r, "dp"));
    CHECK(world_ranks(mesh.pp()) == d.members(r, "pp"));
    CHECK(world_ranks(mesh.cp()) == d.members(r, "cp"));
    CHECK(world_ranks(mesh.dp_cp()) == d.members(r, "dp-cp"));
    CHECK(world_ranks(mesh.mp()) == d.members(r, "tp-pp"));
    CHECK(world_ranks(mesh.tp_dp_cp()) == d.members(r, "tp-dp-cp"));
    CHECK(world_ranks(mesh.tp_cp()) == d.members(r, "tp-cp"));
    CHECK(world_ranks(mesh.ep()) == mesh.expert().members(r, "ep"));
    CHECK(world_ranks(mesh.expert_dp()) == mesh.expert().members(r, "dp"));
    CHECK(mesh.expert_dp_size() == 2);
    // The allgather dispatcher's group and the ep rank of each of its members.
    const std::vector<int> tp_ep = mesh.expert().members(r, "tp-ep");
    CHECK(world_ranks(mesh.expert_tp_ep()) == tp_ep);
    std::vector<int> eps;
    for (int m : tp_ep) eps.push_back(mesh.expert().coord(m, "ep"));
    CHECK(mesh.ep_of_member() == eps);
    CHECK(eps[mesh.expert_tp_ep().rank()] == mesh.coords().ep);
    // pp = 2: every rank is a first or last stage, so all are in the embedding group.
    REQUIRE(mesh.in_embedding_group());
    CHECK(world_ranks(mesh.embedding()) == d.members(r, "pp"));
    // A sum over tp counts its members.
    int64_t one[1] = {1};
    mesh.tp().allreduce_sum(one, 1);
    CHECK(one[0] == 2);
    CHECK(mesh.describe().find("TP2-CP1-EP2-DP2-PP2 rank " + std::to_string(r)) == 0);
  }
}

TEST_CASE("embedding group holds only the first and last stages when pp = 4") {
  Mesh mesh(MPI_COMM_WORLD, MeshSizes{1, 4, 1, 1, 1, "tp-cp-ep-dp-pp"});
  const int pp = mesh.coords().pp;
  CHECK(mesh.in_embedding_group() == (pp == 0 || pp == 3));
  if (mesh.in_embedding_group()) {
    const auto stages = world_ranks(mesh.embedding());
    REQUIRE(stages.size() == 2);
    CHECK(mesh.dense().coord(stages[0], "pp") == 0);
    CHECK(mesh.dense().coord(stages[1], "pp") == 3);
  }
}

TEST_CASE("node ranks: every rank a distinct local rank among the ranks of its host") {
  const NodeRanks n = node_ranks();
  REQUIRE(n.local_rank >= 0);
  REQUIRE(n.local_rank < n.local_size);
  CHECK(!n.host.empty());
  Comm world(MPI_COMM_WORLD);
  // (host hash, local rank, local size) of every rank: per host the local ranks are 0..size-1.
  const int64_t h = int64_t(std::hash<std::string>{}(n.host) & 0x7fffffff);
  std::vector<int32_t> mine = {int32_t(h), n.local_rank, n.local_size}, all(size_t(3 * world.size()));
  world.all_gather(Tensor(all.data(), {int64_t(all.size())}, DType::I32), Tensor(mine.data(), {3}, DType::I32));
  std::map<int32_t, std::set<int32_t>> by_host;
  for (int r = 0; r < world.size(); ++r) {
    if (all[3 * r] == mine[0]) CHECK(all[3 * r + 2] == n.local_size);
    CHECK(by_host[all[3 * r]].insert(all[3 * r + 1]).second);
  }
  for (const auto& [host, locals] : by_host) CHECK(*locals.rbegin() == int32_t(locals.size()) - 1);
}

TEST_CASE("device communication set-up: staged on every group; without NCCL every rank refuses alike") {
  Mesh mesh(MPI_COMM_WORLD, MeshSizes{2, 2, 1, 2, 1, "tp-cp-ep-dp-pp"});
  mesh.enable_device_comm(CommBackend::Mpi, nullptr);
  CHECK_FALSE(mesh.dp().uses_nccl());
  CHECK_FALSE(mesh.pp().uses_nccl());
#ifndef MPIGPT_WITH_CUDA
  // No rank waits in a bootstrap for another: all learn of the failure and throw (a hang here
  // would time the test out).
  CHECK_THROWS_WITH_AS(mesh.enable_device_comm(CommBackend::Nccl, nullptr), doctest::Contains("engine.comm = mpi"),
                       Error);
  CHECK_FALSE(mesh.world().uses_nccl());
#endif
}
