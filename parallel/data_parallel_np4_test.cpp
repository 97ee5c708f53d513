// Four ranks, as one data-parallel group of 4 and as two groups of 2: GradSync's gradient buckets
// and parameter gather, with and without the distributed optimizer and overlap.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "parallel/data_parallel.h"

using namespace mpigpt;

namespace {

// A value per (rank, element, step) that every rank can compute for every other rank. Multiples
// of 1/1024 below 1 sum exactly in any order, so results can be compared bit for bit.
float value(int rank, int64_t i, int step) {
  uint64_t x = uint64_t(rank) * 0x9E3779B97F4A7C15ull + uint64_t(i) * 0xBF58476D1CE4E5B9ull + uint64_t(step) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return float(int64_t(x % 2001) - 1000) / 1024.0f;
}

// The data-parallel groups to test: the world (dp 4) and pairs of ranks (dp 2).
struct Group {
  MPI_Comm mpi = MPI_COMM_NULL;
  explicit Group(int dp) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_split(MPI_COMM_WORLD, r / dp, r, &mpi);
  }
  ~Group() { MPI_Comm_free(&mpi); }
};

const std::vector<int64_t> kNumels = {37, 100, 5, 64, 300, 17, 1, 250, 0, 33};

bool in(const std::vector<Range>& rs, int64_t i) {
  return std::any_of(rs.begin(), rs.end(), [&](const Range& r) { return r.begin <= i && i < r.end; });
}

// Random pieces covering [0, total) (some twice), in a random order, different on every rank.
std::vector<Range> random_pieces(int64_t total, std::mt19937_64& rng) {
  std::vector<int64_t> cuts = {0, total};
  for (int k = 0; k < 12; ++k) cuts.push_back(int64_t(rng() % uint64_t(total + 1)));
  std::sort(cuts.begin(), cuts.end());
  std::vector<Range> pieces;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) pieces.push_back({cuts[k], cuts[k + 1]});
  pieces.push_back(pieces[rng() % pieces.size()]);
  std::shuffle(pieces.begin(), pieces.end(), rng);
  return pieces;
}

}  // namespace

// The exact sum, whatever order and pieces grads_ready is called with on each rank.
TEST_CASE("finish_grad_sync leaves the sum over the group on the owned ranges") {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  for (int dp : {4, 2}) {
    Group group(dp);
    for (bool dist : {false, true})
      for (bool overlap : {false, true})
        for (int mode = 0; mode < 3; ++mode) {  // grads_ready: never, per parameter backwards, random pieces
          CAPTURE(dp);
          CAPTURE(dist);
          CAPTURE(overlap);
          CAPTURE(mode);
          Comm comm(group.mpi);
          const int r = comm.rank();
          const BufferLayout L = plan_buffer(kNumels, 96, dp, 16);
          REQUIRE(L.buckets.size() >= 4);
          std::vector<float> p(L.total), g(L.total);
          GradSync gs(comm, L, Tensor(p.data(), {L.total}), Tensor(g.data(), {L.total}), {dist, overlap, false});
          const std::vector<Range> params = L.param_ranges();
          std::mt19937_64 rng(uint64_t(world_rank) * 100 + uint64_t(mode));
          for (int step = 0; step < 2; ++step) {  // a second step: the ready marks were cleared
            std::fill(g.begin(), g.end(), 0.0f);
            for (const Range& x : params)
              for (int64_t i = x.begin; i < x.end; ++i) g[i] = value(r, i, step);
            comm.reset_stats();
            if (mode == 1)
              for (int q = int(kNumels.size()) - 1; q >= 0; --q) gs.grads_ready(L.param_range(q).begin, L.param_range(q).end);
            if (mode == 2)
              for (const Range& x : random_pieces(L.total, rng)) gs.grads_ready(x.begin, x.end);
            // with overlap every bucket has started once all gradients were reported; never before
            const int64_t started = comm.stats().allreduce + comm.stats().reduce_scatter;
            CHECK(started == (overlap && mode > 0 ? L.total * 4 : 0));
            gs.finish_grad_sync();
            CHECK(comm.stats().allreduce == (dist ? 0 : L.total * 4));
            CHECK(comm.stats().reduce_scatter == (dist ? L.total * 4 : 0));
            int bad = 0;
            for (const Range& x : gs.owned_ranges())
              for (int64_t i = x.begin; i < x.end; ++i) {
                float want = 0;
                if (in(params, i))
                  for (int q = 0; q < dp; ++q) want += value(q, i, step);
                bad += g[i] != want;
              }
            CHECK(bad == 0);
          }
        }
  }
}

TEST_CASE("buckets start last-to-first whatever order their gradients become final in") {
  Comm comm(MPI_COMM_WORLD);
  const BufferLayout L = plan_buffer(kNumels, 96, 4, 16);
  const int nb = int(L.buckets.size());
  REQUIRE(nb >= 3);
  std::vector<float> p(L.total), g(L.total);
  GradSync gs(comm, L, Tensor(p.data(), {L.total}), Tensor(g.data(), {L.total}), {true, true, false});
  auto bytes = [&](int b) { return L.buckets[b].numel() * 4; };
  for (int step = 0; step < 2; ++step) {  // twice: finish_grad_sync clears the marks
    for (int64_t i = 0; i < L.total; ++i) g[i] = in(L.param_ranges(), i) ? value(comm.rank(), i, step) : 0.0f;
    comm.reset_stats();
    gs.grads_ready(L.buckets[0].begin, L.buckets[0].end);  // the first bucket first: it must wait
    CHECK(comm.stats().reduce_scatter == 0);
    const int64_t cut = L.param_range(L.buckets[nb - 1].last_param).end - 1;  // its last gradient element
    gs.grads_ready(L.buckets[nb - 1].begin, cut);                               // not quite complete
    CHECK(comm.stats().reduce_scatter == 0);
    gs.grads_ready(cut, cut + 1);  // now complete: it starts
    CHECK(comm.stats().reduce_scatter == bytes(nb - 1));
    gs.grads_ready(L.buckets[1].begin, L.buckets[nb - 1].begin);  // the rest; bucket 0 follows
    CHECK(comm.stats().reduce_scatter == L.total * 4);
    gs.finish_grad_sync();
    CHECK(comm.stats().reduce_scatter == L.total * 4);
    int bad = 0;
    for (const Range& x : intersect_ranges(gs.owned_ranges(), L.param_ranges()))
      for (int64_t i = x.begin; i < x.end; ++i) {
        float want = 0;
        for (int q = 0; q < 4; ++q) want += value(q, i, step);
        bad += g[i] != want;
      }
    CHECK(bad == 0);
  }
}

TEST_CASE("gather_params brings every rank's updated slice to all ranks, blocking or overlapped") {
  for (int dp : {4, 2}) {
    Group group(dp);
    for (bool overlap : {false, true}) {
      CAPTURE(dp);
      CAPTURE(overlap);
      Comm comm(group.mpi);
      const BufferLayout L = plan_buffer(kNumels, 96, dp, 16);
      const std::vector<Range> params = L.param_ranges();
      std::vector<float> p(L.total, 0.0f), g(L.total, 0.0f);
      GradSync gs(comm, L, Tensor(p.data(), {L.total}), Tensor(g.data(), {L.total}), {true, false, overlap});
      auto want = [&](int64_t i, int step) { return in(params, i) ? value(100 + step, i, 0) : 0.0f; };
      for (int step = 0; step < 3; ++step) {
        // "the optimizer step": this rank writes its slices; what it holds elsewhere is stale
        for (int64_t i = 0; i < L.total; ++i)
          if (in(params, i)) p[i] = in(gs.owned_ranges(), i) ? want(i, step) : -1.0f;
        comm.reset_stats();
        gs.gather_params();
        CHECK(comm.stats().all_gather == L.total * 4 / dp);
        if (overlap && step == 2) {
          CHECK(gs.params_pending());
          gs.finish_grad_sync();  // the next step's sync waits for gathers nobody waited for
          CHECK(!gs.params_pending());
          int bad = 0;
          for (int64_t i = 0; i < L.total; ++i) bad += p[i] != want(i, step);
          CHECK(bad == 0);
        } else if (overlap) {
          // forward: each bucket waited for just before its first use, in a random order
          std::vector<int> order(L.buckets.size());
          for (size_t b = 0; b < order.size(); ++b) order[b] = int(b);
          std::shuffle(order.begin(), order.end(), std::mt19937_64(uint64_t(step)));
          for (int b : order) {
            const Bucket& k = L.buckets[b];
            gs.wait_params(k.begin, k.end);
            int bad = 0;
            for (int64_t i = k.begin; i < k.end; ++i) bad += p[i] != want(i, step);
            CHECK(bad == 0);
          }
        }
        gs.wait_all_params();
        int bad = 0;
        for (int64_t i = 0; i < L.total; ++i) bad += p[i] != want(i, step);
        CHECK(bad == 0);
        CHECK(comm.stats().allreduce == 0);
      }
    }
  }
}

TEST_CASE("communication volume: all-reduce without, reduce-scatter + all-gather with the distributed optimizer") {
  Comm comm(MPI_COMM_WORLD);
  const BufferLayout L = plan_buffer(kNumels, 96, 4, 16);
  std::vector<float> p(L.total), g(L.total);
  for (bool dist : {false, true}) {
    GradSync gs(comm, L, Tensor(p.data(), {L.total}), Tensor(g.data(), {L.total}), {dist, true, true});
    comm.reset_stats();
    gs.finish_grad_sync();
    gs.gather_params();
    gs.wait_all_params();
    const CommStats& s = comm.stats();
    CHECK(s.allreduce == (dist ? 0 : L.total * 4));
    CHECK(s.reduce_scatter == (dist ? L.total * 4 : 0));
    CHECK(s.all_gather == (dist ? L.total : 0));  // one slice of 4 bytes per element / 4 ranks
    CHECK(s.calls == int64_t(L.buckets.size()) * (dist ? 2 : 1));
  }
}
