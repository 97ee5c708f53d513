// Two ranks: LoRA adapter checkpoints saved in tp2 resume bit-exactly in tp2 and on the curve in
// dp2 (distributed optimizer), pp2 and on one rank; another base or other lora settings are
// refused; the merged full checkpoint computes the adapted model's loss.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "lib/model/params.h"
#include "lib/train/adapter_checkpoint.h"
#include "lib/train/checkpointing.h"
#include "lib/train/train_testing.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

Config base_config(const std::string& family) {
  Config cfg = testing::small_train_config(family, 4, 4);
  return cfg;
}

TrainResult run(const Config& cfg, MPI_Comm comm) { return testing::train_synthetic(cfg, comm); }

// Rank 0 pretrains a base (full steps from `seed`: unlike the seeded init) into dir; all wait.
void pretrain(Config cfg, const std::string& dir, int seed) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    cfg.checkpoint.save = dir;
    cfg.training.seed = seed;
    run(cfg, MPI_COMM_SELF);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

TEST_CASE("LoRA adapter checkpoints: resume exactly and resharded, refuse another base, merge") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string dir = std::filesystem::temp_directory_path().string() + "/mpigpt_lora_ckpt_np2_test";
  for (const char* family : {"gpt2", "llama"}) {
    CAPTURE(family);
    if (rank == 0) std::filesystem::remove_all(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    Config cfg = base_config(family);
    pretrain(cfg, dir + "/base", 1234);

    cfg.checkpoint.init_from_checkpoint = dir + "/base";
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8;
    cfg.training.train_iters = 10;
    cfg.training.lr = 1e-2;
    cfg.training.warmup_iters = 1;
    cfg.checkpoint.save = dir + "/a";
    cfg.checkpoint.save_interval = 5;
    cfg.parallel.tp = 2;
    const TrainResult full = run(cfg, MPI_COMM_WORLD);
    REQUIRE(full.losses.size() == 10);
    REQUIRE(full.saves.size() == 2);
    // An adapter save holds the adapters (and their moments) only: 4 layers x 4 targets x (A, B).
    const TensorMap saved = read_model_tensors(dir + "/a", nullptr);
    CHECK(saved.size() == 32);
    for (const auto& [name, t] : saved) CHECK(is_lora_param(name));

    Config resume = cfg;
    resume.checkpoint.save.clear();
    resume.checkpoint.save_interval = 0;
    resume.checkpoint.load = dir + "/a/iter_0000005";
    const TrainResult same = run(resume, MPI_COMM_WORLD);
    REQUIRE(same.first_iter == 6);
    REQUIRE(same.losses.size() == 5);
    for (size_t i = 0; i < 5; ++i) {
      CHECK(same.losses[i] == full.losses[5 + i]);  // bitwise
      CHECK(same.grad_norms[i] == full.grad_norms[5 + i]);
    }
    auto check_close = [&](const TrainResult& r) {
      REQUIRE(r.losses.size() == 5);
      for (size_t i = 0; i < 5; ++i) {
        CAPTURE(i);
        CHECK(std::abs(r.losses[i] - full.losses[5 + i]) <= 1e-4 * full.losses[5 + i]);
      }
    };
    {
      Config dp2 = resume;
      dp2.parallel.tp = 1;
      dp2.engine.distributed_optimizer = true;
      check_close(run(dp2, MPI_COMM_WORLD));
      Config pp2 = resume;
      pp2.parallel.tp = 1;
      pp2.parallel.pp = 2;
      check_close(run(pp2, MPI_COMM_WORLD));
      Config single = resume;
      single.parallel.tp = 1;
      check_close(run(single, MPI_COMM_SELF));  // every rank alone, reading the same save
    }

    // Another base (pretrained from another seed), other lora settings, a full save as `load`.
    pretrain(base_config(family), dir + "/other", 99);
    Config other = resume;
    other.checkpoint.init_from_checkpoint = dir + "/other";
    CHECK_THROWS_WITH(run(other, MPI_COMM_WORLD), doctest::Contains("a different model"));
    const std::string named =
        "trained on the checkpoint " + std::filesystem::path(dir + "/base").lexically_normal().string();
    CHECK_THROWS_WITH(run(other, MPI_COMM_WORLD), doctest::Contains(named.c_str()));
    Config rank8 = resume;
    rank8.lora.rank = 8;
    CHECK_THROWS_WITH(run(rank8, MPI_COMM_WORLD),
                      doctest::Contains("holds adapters of lora.rank = 4; this run has lora.rank = 8"));
    Config targets = resume;
    targets.lora.targets = "qkv,proj";
    CHECK_THROWS_WITH(run(targets, MPI_COMM_WORLD), doctest::Contains("lora.targets = qkv,proj,fc1,fc2"));
    Config full_load = resume;
    full_load.checkpoint.load = dir + "/base";
    CHECK_THROWS_WITH(run(full_load, MPI_COMM_WORLD), doctest::Contains("holds a full model, not LoRA adapters"));

    // The merged full checkpoint at iteration 10: its first loss (batch 11) is the adapted model's.
    Config merged = base_config(family);
    merged.parallel.tp = 2;
    testing::check_merged_loss(dir + "/a", dir + "/merged", resume, merged, 10, MPI_COMM_WORLD);
    // The merge changed every adapted weight (B is no longer zero).
    const TensorMap base = read_model_tensors(dir + "/base", nullptr);
    const TensorMap sum = read_model_tensors(dir + "/merged", nullptr);
    for (const char* w : {"layers.0.attn.qkv.weight", "layers.3.mlp.fc.weight", "layers.1.mlp.proj.weight"}) {
      CAPTURE(w);
      CHECK(base.at(w).data != sum.at(w).data);
      CHECK(base.at(w).shape == sum.at(w).shape);
    }
    CHECK(base.at("layers.2.attn_norm.weight").data == sum.at("layers.2.attn_norm.weight").data);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0) std::filesystem::remove_all(dir);
}
