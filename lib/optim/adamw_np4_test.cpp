// Four ranks, as one data-parallel group of 4 and as two groups of 2: the distributed optimizer
// (reduce-scatter, clipped step on this rank's slices, all-gather) gives the parameters of plain
// data parallelism (all-reduce, full AdamW).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "lib/kernels/buffer.h"
#include "lib/optim/adamw.h"
#include "parallel/data_parallel.h"

using namespace mpigpt;

namespace {

// A value per (rank, parameter element, step) any rank can compute: multiples of 1/1024 below 1,
// whose sums (and sums of squares, in double) are exact in any order.
float value(int rank, int64_t key, int step) {
  uint64_t x = uint64_t(rank + 7) * 0x9E3779B97F4A7C15ull + uint64_t(key) * 0xBF58476D1CE4E5B9ull +
               uint64_t(step) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return float(int64_t(x % 2001) - 1000) / 1024.0f;
}

struct Group {
  MPI_Comm mpi = MPI_COMM_NULL;
  explicit Group(int dp) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_split(MPI_COMM_WORLD, r / dp, r, &mpi);
  }
  ~Group() { MPI_Comm_free(&mpi); }
};

const std::vector<int64_t> kNumels = {37, 100, 5, 64, 300, 17, 1, 250, 33};

std::vector<OptimParam> make_table(const std::vector<int64_t>& offsets) {
  const bool decays[] = {false, true, false, false, true};  // as embedding, weight, bias, norm, weight
  std::vector<OptimParam> t(kNumels.size());
  for (size_t i = 0; i < t.size(); ++i) {
    t[i].name = std::string("p").append(std::to_string(i));  // not "p" + ...: GCC 12 -Wrestrict false positive
    t[i].numel = kNumels[i];
    t[i].decay = decays[i % 5];
    t[i].offset = offsets[i];
  }
  return t;
}

// One data-parallel replica of the model's buffers: params, grads and AdamW, laid out either
// contiguously (the reference) or by plan_buffer with GradSync.
struct Replica {
  std::vector<float> p, g;
  std::vector<OptimParam> table;
  void init(int64_t total, const std::vector<int64_t>& offsets) {
    table = make_table(offsets);
    p.assign(total, 0.0f);
    g.assign(total, 0.0f);
    for (size_t q = 0; q < table.size(); ++q)  // the same initial weights on every rank
      for (int64_t e = 0; e < kNumels[q]; ++e) p[table[q].offset + e] = value(-7, int64_t(q) * 1000 + e, 99);
  }
  void fill_grads(int rank, int step, bool exact) {
    std::fill(g.begin(), g.end(), 0.0f);
    for (size_t q = 0; q < table.size(); ++q)
      for (int64_t e = 0; e < kNumels[q]; ++e) {
        // even steps are 16 times smaller (still exact): clipping acts on odd steps only
        const float v = value(rank, int64_t(q) * 1000 + e, step) / (step % 2 ? 1.0f : 16.0f);
        g[table[q].offset + e] = exact ? v : v * 0.3f;
      }
  }
  Tensor P() { return Tensor(p.data(), {int64_t(p.size())}); }
  Tensor G() { return Tensor(g.data(), {int64_t(g.size())}); }
  float at(int q, int64_t e) const { return p[table[q].offset + e]; }
};

}  // namespace

// Several steps on a table of mixed decay settings whose parameters the slices cut through; bit for
// bit when the gradient sums are exact.
TEST_CASE("the distributed optimizer reproduces plain data-parallel AdamW") {
  auto ops = make_cpu_ops();
  AdamWConfig cfg;
  cfg.weight_decay = 0.2f;
  const double max_norm = 4.0;
  const int steps = 5;
  for (int dp : {4, 2}) {
    Group group(dp);
    for (bool exact : {true, false})
      for (int variant = 0; variant < 4; ++variant) {
        const bool dist = variant >= 2, overlap = variant % 2 == 1;
        CAPTURE(dp);
        CAPTURE(exact);
        CAPTURE(dist);
        CAPTURE(overlap);
        Comm ref_comm(group.mpi), comm(group.mpi);
        const int r = comm.rank();
        // the reference: contiguous buffer, all-reduce, AdamW on everything, norm of everything
        Replica ref;
        int64_t P = 0;
        std::vector<int64_t> packed;
        for (int64_t n : kNumels) {
          packed.push_back(P);
          P += n;
        }
        ref.init(P, packed);
        AdamW ref_opt(*ops, ref.table, ref.P(), ref.G(), cfg);
        // under test: the padded bucket layout through GradSync, AdamW on the owned ranges
        const BufferLayout L = plan_buffer(kNumels, 96, dp, 16);
        Replica rep;
        rep.init(L.total, L.offsets);
        GradSync gs(comm, L, rep.P(), rep.G(), {dist, overlap, overlap});
        AdamW opt(*ops, rep.table, rep.P(), rep.G(), cfg, gs.owned_ranges());
        CHECK(opt.state_bytes() == gs.memory().optimizer);
        CHECK(opt.state_numel() == (dist ? total_size(intersect_ranges(gs.owned_ranges(), L.param_ranges())) : P));
        const std::vector<Range> counted = intersect_ranges(gs.owned_ranges(), L.param_ranges());
        int clipped = 0;
        for (int step = 1; step <= steps; ++step) {
          const float lr = 0.01f * float(step);
          ref.fill_grads(r, step, exact);
          ref_comm.allreduce_sum(ref.G());
          const double ref_norm = grad_norm(*ops, ref.G());
          ref_opt.step(lr, clip_scale(ref_norm, max_norm));
          clipped += clip_scale(ref_norm, max_norm) < 1.0f;

          rep.fill_grads(r, step, exact);
          if (overlap)  // backward reports parameters last to first
            for (int q = int(kNumels.size()) - 1; q >= 0; --q) gs.grads_ready(L.param_range(q).begin, L.param_range(q).end);
          gs.finish_grad_sync();
          const double norm = std::sqrt(gs.sum_over_owners(sum_squares_of(*ops, rep.G(), counted)));
          if (exact) CHECK(norm == ref_norm);
          CHECK(norm == doctest::Approx(ref_norm).epsilon(1e-12));
          opt.step(lr, clip_scale(norm, max_norm));
          gs.gather_params();
          // "forward": every parameter, after waiting for its bucket
          int bad = 0;
          for (int q = 0; q < int(kNumels.size()); ++q) {
            gs.wait_params(L.param_range(q).begin, L.param_range(q).end);
            for (int64_t e = 0; e < kNumels[q]; ++e) {
              const float a = rep.at(q, e), b = ref.at(q, e);
              bad += exact ? a != b : !(std::fabs(a - b) <= 1e-6f * std::max(1.0f, std::fabs(b)));
            }
          }
          CHECK(bad == 0);
          for (int64_t i = 0; i < L.total; ++i)  // the padding stayed zero
            if (!std::count_if(rep.table.begin(), rep.table.end(), [&](const OptimParam& t) {
                  return t.offset <= i && i < t.offset + t.numel;
                }))
              REQUIRE(rep.p[i] == 0.0f);
        }
        CHECK(clipped > 0);  // clipping took part
        CHECK(clipped < steps);
        const CommStats& s = comm.stats();
        CHECK(s.reduce_scatter == (dist ? steps * L.total * 4 : 0));
        CHECK(s.all_gather == (dist ? steps * L.total * 4 / dp : 0));
        CHECK(s.allreduce == steps * (dist ? 8 : L.total * 4));  // distributed: just the squared norm, a double
      }
  }
}
