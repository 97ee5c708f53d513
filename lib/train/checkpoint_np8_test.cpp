// Eight ranks: checkpoints resume exactly and reshard.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>

#include "lib/train/train_testing.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

Config small_config(const std::string& family, const std::string& dir) {
  Config cfg = testing::small_train_config(family, 4, 12);
  cfg.model.num_kv_heads = family == "llama" ? 4 : cfg.model.num_heads;
  cfg.training.warmup_iters = 2;
  cfg.checkpoint.save = dir;
  cfg.checkpoint.save_interval = 6;
  return cfg;
}

TrainResult run(const Config& cfg, MPI_Comm comm) { return testing::train_synthetic(cfg, comm); }

}  // namespace

// A tp2 x pp2 x dp2 run with the distributed optimizer saves at iteration 6; resuming from that
// save in the same layout repeats its losses bit for bit, and resuming in tp1 x pp4 x dp2,
// tp4 x dp2 (another vocabulary padding) and on a single rank follows the uninterrupted curve
// within the regression tolerance.
TEST_CASE("save in tp2-pp2-dp2 with the distributed optimizer; resume exactly, and resharded") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string dir = std::filesystem::temp_directory_path().string() + "/mpigpt_ckpt_np8_test";
  for (const char* family : {"gpt2", "llama"}) {
    CAPTURE(family);
    if (rank == 0) std::filesystem::remove_all(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    Config cfg = small_config(family, dir);
    cfg.parallel.tp = 2;
    cfg.parallel.pp = 2;
    cfg.engine.distributed_optimizer = true;
    const TrainResult full = run(cfg, MPI_COMM_WORLD);
    REQUIRE(full.losses.size() == 12);
    REQUIRE(full.saves.size() == 2);
    CHECK(full.losses.front() != full.losses.back());

    Config resume = cfg;
    resume.checkpoint.save.clear();
    resume.checkpoint.save_interval = 0;
    resume.checkpoint.load = dir + "/iter_0000006";
    const TrainResult same = run(resume, MPI_COMM_WORLD);
    REQUIRE(same.first_iter == 7);
    REQUIRE(same.losses.size() == 6);
    for (size_t i = 0; i < 6; ++i) CHECK(same.losses[i] == full.losses[6 + i]);  // bitwise

    auto check_close = [&](const TrainResult& r) {
      REQUIRE(r.losses.size() == 6);
      for (size_t i = 0; i < 6; ++i) {
        CAPTURE(i);
        CHECK(std::abs(r.losses[i] - full.losses[6 + i]) <= 1e-4 * full.losses[6 + i]);
      }
    };
    {
      Config pp4 = resume;
      pp4.parallel.tp = 1;
      pp4.parallel.pp = 4;
      pp4.engine.distributed_optimizer = false;
      check_close(run(pp4, MPI_COMM_WORLD));
      Config tp4 = resume;
      tp4.parallel.tp = 4;
      tp4.parallel.pp = 1;
      check_close(run(tp4, MPI_COMM_WORLD));
      Config single = resume;
      single.parallel.tp = 1;
      single.parallel.pp = 1;
      single.engine.distributed_optimizer = false;
      check_close(run(single, MPI_COMM_SELF));  // every rank alone, reading the same save
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0) std::filesystem::remove_all(dir);
}
