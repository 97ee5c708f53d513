// GPU test, two data-parallel ranks on one GPU over staged MPI (CTest label gpu; skipped without a
// GPU; also runs emulated): in bf16 the distributed optimizer gathers the bf16 compute weights, not
// the f32 masters.
#include <doctest/doctest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "lib/core/rng.h"
#include "lib/kernels/cuda/cuda_testing.h"
#include "lib/train/checkpointing.h"
#include "lib/train/model_runner.h"
#include "lib/train/trainer.h"

using namespace mpigpt;
using testing::round_bf16;
using testing::to_host;

namespace {

Config config(bool moe, bool overlap) {
  Config cfg;
  cfg.model.family = moe ? "llama" : "gpt2";
  cfg.model.num_layers = 2;
  cfg.model.hidden = 64;
  cfg.model.num_heads = 1;  // head dim 64: the tensor-core attention
  cfg.model.seq_len = 16;
  cfg.model.vocab_size = 97;
  if (moe) {
    cfg.model.num_experts = 4;
    cfg.model.moe_shared_expert_ffn = 32;
  }
  cfg.training.micro_batch = 2;
  cfg.training.global_batch = 8;  // two micro-batches per rank
  cfg.training.precision = "bf16";
  cfg.training.peak_tflops = 1;
  cfg.engine.backend = "cuda";
  cfg.engine.comm = "mpi";
  cfg.engine.allow_device_sharing = true;
  cfg.engine.distributed_optimizer = true;
  cfg.engine.overlap_grad_reduce = overlap;
  cfg.engine.overlap_param_gather = overlap;
  cfg.engine.bucket_size = overlap ? 4000 : 40000000;  // several buckets, or one
  cfg.resolve_defaults();
  cfg.validate(2);
  return cfg;
}

// Host copies of elements [lo, hi) of a flat f32 buffer for each range.
std::vector<float> pick(const std::vector<float>& all, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  std::vector<float> out;
  for (const auto& [lo, hi] : ranges) out.insert(out.end(), all.begin() + lo, all.begin() + hi);
  return out;
}

// Elements of the compute copy that are not their master rounded to bf16.
int64_t unrounded(const std::vector<float>& compute, const std::vector<float>& masters) {
  int64_t n = 0;
  for (size_t k = 0; k < masters.size(); ++k) n += compute[k] != round_bf16(masters[k]);
  return n;
}

// The other rank's copy of v (same length on both).
std::vector<float> other_rank(std::vector<float> v) {
  std::vector<float> both(2 * v.size());
  MPI_Allgather(v.data(), int(v.size()), MPI_FLOAT, both.data(), int(v.size()), MPI_FLOAT, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return {both.begin() + (1 - rank) * v.size(), both.begin() + (2 - rank) * v.size()};
}

}  // namespace

// Over three steps, with and without overlap_param_gather, a dense and a MoE model:
//  - what forward computes with is, bit for bit, every f32 master rounded to bf16 (the masters made
//    whole by gather_masters() only after the forward), on both ranks alike;
//  - the MoE routers, which forward reads in f32, are current without gather_masters();
//  - the gathers move 2 bytes per element, half of what the f32 gather moved;
//  - a checkpoint saved while the masters are stale holds every rank's owned slices.
TEST_CASE("bf16 distributed optimizer: the gather moves the bf16 compute weights") {
  std::unique_ptr<Ops> ops = testing::cuda_ops_or_skip();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  REQUIRE(size == 2);
  for (bool moe : {false, true}) {
    for (bool overlap : {false, true}) {
      CAPTURE(moe);
      CAPTURE(overlap);
      const Config cfg = config(moe, overlap);
      Mesh mesh(MPI_COMM_WORLD, mesh_sizes(cfg.parallel));
      mesh.enable_device_comm(CommBackend::Mpi, ops->stream());
      const GptDims d = make_dims(cfg, cfg.model.vocab_size);
      ModelRunner r(cfg, d, mesh, *ops);
      REQUIRE(r.distributed_optimizer());
      GPT& m = r.model();
      const auto routers = m.master_reads();
      CHECK(routers.size() == (moe ? 2u : 0u));
      const int num_micro = cfg.training.global_batch / (2 * cfg.training.micro_batch);
      const int64_t n = int64_t(num_micro) * cfg.training.micro_batch * d.T;
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        std::vector<int32_t> tokens(n), targets(n);
        for (int64_t i = 0; i < n; ++i) {
          tokens[i] = int32_t(bits_at(11, uint64_t(step * 2 + rank), uint64_t(i)) % uint64_t(d.V));
          targets[i] = int32_t(bits_at(12, uint64_t(step * 2 + rank), uint64_t(i)) % uint64_t(d.V));
        }
        const double loss = r.forward_backward(tokens.data(), targets.data(), nullptr, num_micro,
                                               1.0f / float(cfg.training.global_batch * d.T));
        CHECK(std::isfinite(loss));
        const std::vector<float> compute = to_host(*ops, m.compute_params_flat());
        const std::vector<float> routers_read = pick(to_host(*ops, m.params_flat()), routers);
        r.gather_masters();
        const std::vector<float> masters = to_host(*ops, m.params_flat());
        CHECK(pick(masters, routers) == routers_read);  // the routers forward read were current
        CHECK(unrounded(compute, masters) == 0);
        CHECK(other_rank(compute) == compute);
        CHECK(other_rank(masters) == masters);

        const Comm& dense = mesh.dp_cp();
        const Comm& experts = mesh.expert_dp();
        dense.reset_stats();
        experts.reset_stats();
        r.optimizer_step(1e-2f, 1.0f);
        const int64_t gathered = dense.stats().all_gather + (&experts != &dense ? experts.stats().all_gather : 0);
        CHECK(gathered == m.params_flat().numel() / 2 * 2);  // each rank's half, 2 bytes an element
      }

      // The masters are stale now; a save must still hold every owner's values.
      const std::vector<float> before = to_host(*ops, m.params_flat());
      int pid = int(getpid());
      MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
      const std::string dir = std::filesystem::temp_directory_path().string() + "/mpigpt_bf16_gather_" +
                              std::to_string(pid);
      save_checkpoint(dir, CheckpointMeta{3, 0, 0, 0.0, {}}, r, cfg, 1);
      r.gather_masters();
      const std::vector<float> whole = to_host(*ops, m.params_flat());
      ops->fill(m.params_flat(), 0.0f);
      load_checkpoint(dir, r, cfg);
      CHECK(to_host(*ops, m.params_flat()) == whole);
      int64_t stale = 0;
      for (size_t k = 0; k < whole.size(); ++k) stale += before[k] != whole[k];
      CHECK(stale > 0);  // the gathers did not move the f32 masters

      // A step straight after the load (which replaced the masters): the next forward still computes
      // with what the gather brought, not with a conversion of stale masters.
      r.optimizer_step(1e-2f, 1.0f);
      std::vector<int32_t> tokens(size_t(n), 1);
      r.forward_only(tokens.data(), tokens.data(), nullptr, num_micro);
      const std::vector<float> compute = to_host(*ops, m.compute_params_flat());
      r.gather_masters();
      const std::vector<float> masters = to_host(*ops, m.params_flat());
      CHECK(unrounded(compute, masters) == 0);
      MPI_Barrier(MPI_COMM_WORLD);
      if (rank == 0) std::filesystem::remove_all(dir);
    }
  }
}
