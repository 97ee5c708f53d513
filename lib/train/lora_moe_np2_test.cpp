// Two ranks: LoRA fine-tuning of a mixture-of-experts model from one pretrained save reproduces the
// single-rank curve with the routed experts' adapters split over ep 2 and expert_tp 2 (alltoall and
// allgather dispatchers), summed over expert-dp (tp2 + SP, dp2 with the distributed optimizer); the
// merged adapters (W_e += s B_e A_e per expert) compute the adapted model's loss.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "lib/train/adapter_checkpoint.h"
#include "lib/train/checkpointing.h"
#include "lib/train/train_testing.h"
#include "lib/train/trainer.h"

using namespace mpigpt;

namespace {

// GPT-2: a MoE layer above a dense one (both kinds of adapters); Llama: every layer MoE, with a
// shared expert (not adapted). Dropless routing: the same decisions in every layout.
Config moe_config(const std::string& family) {
  Config cfg = testing::small_train_config(family, 4, 5);
  cfg.model.num_experts = 4;
  cfg.model.moe_top_k = 2;
  cfg.model.moe_ffn_hidden = 16;
  cfg.model.moe_layers = family == "gpt2" ? "every:2" : "all";
  if (family == "llama") {
    cfg.model.moe_shared_expert_ffn = 16;
    cfg.model.moe_norm_topk_prob = true;
    cfg.model.moe_z_loss_coeff = 1e-3;
  }
  return cfg;
}

TrainResult run(const Config& cfg, MPI_Comm comm) { return testing::train_synthetic(cfg, comm); }

// Rank 0 pretrains the base (a few full steps: a base unlike the seeded init) into dir; all wait.
void pretrain(Config cfg, const std::string& dir) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    cfg.checkpoint.save = dir;
    run(cfg, MPI_COMM_SELF);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

struct Layout {
  const char* name;
  int tp, ep, etp;
  bool sp, distributed, allgather;
};

}  // namespace

TEST_CASE("LoRA of a MoE model: ep2, expert_tp 2 (alltoall, allgather), tp2+sp and dp2 (distributed optimizer) "
          "give the single-rank curve; the merged experts compute the adapted loss") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string dir = std::filesystem::temp_directory_path().string() + "/mpigpt_lora_moe_np2_test";
  for (const char* family : {"gpt2", "llama"}) {
    CAPTURE(family);
    if (rank == 0) std::filesystem::remove_all(dir);
    MPI_Barrier(MPI_COMM_WORLD);
    Config cfg = moe_config(family);
    pretrain(cfg, dir + "/base");

    cfg.checkpoint.init_from_checkpoint = dir + "/base";
    cfg.lora.rank = 4;
    cfg.lora.alpha = 16;
    // Llama: an adapter per projection (q, k, v; each routed expert's gate and up of its own).
    if (std::string(family) == "llama") cfg.lora.targets = "q,k,v,proj,gate,up,fc2";
    cfg.training.train_iters = 30;
    cfg.training.lr = 3e-3;
    cfg.training.warmup_iters = 1;
    const TrainResult single = run(cfg, MPI_COMM_SELF);
    Config still = cfg;  // the untouched base: the adapters must move the curve
    still.training.lr = 0;
    const TrainResult base = run(still, MPI_COMM_SELF);
    testing::check_adapters_move(single, base);

    for (const Layout& l : {Layout{"ep2", 1, 2, 1, false, false, false},
                            Layout{"expert_tp 2 (alltoall: rows gathered over expert_tp)", 1, 1, 2, false, false, false},
                            Layout{"expert_tp 2 allgather, distributed optimizer", 1, 1, 2, false, true, true},
                            Layout{"tp2+sp (expert-dp 2 over the tp ranks)", 2, 1, 1, true, false, false},
                            Layout{"dp2 (expert-dp 2), distributed optimizer", 1, 1, 1, false, true, false}}) {
      CAPTURE(l.name);
      Config c = cfg;
      c.parallel.tp = l.tp, c.parallel.ep = l.ep, c.parallel.expert_tp = l.etp;
      c.parallel.sequence_parallel = l.sp;
      c.parallel.moe_dispatcher = l.allgather ? "allgather" : "alltoall";
      c.engine.distributed_optimizer = l.distributed;
      const TrainResult r = run(c, MPI_COMM_WORLD);
      REQUIRE(r.losses.size() == single.losses.size());
      for (size_t i = 0; i < single.losses.size(); ++i) {
        CAPTURE(i);
        CHECK(r.losses[i] == doctest::Approx(single.losses[i]).epsilon(1e-5));
        CHECK(r.grad_norms[i] == doctest::Approx(single.grad_norms[i]).epsilon(1e-4));
      }
    }

    // Adapters trained and saved under expert_tp 2, merged into the base: the merged full model's
    // loss on the next batch is the adapted model's.
    Config a = cfg;
    a.parallel.expert_tp = 2;
    a.training.train_iters = 10;
    a.checkpoint.save = dir + "/a";
    a.checkpoint.save_interval = 10;
    run(a, MPI_COMM_WORLD);
    Config merged = moe_config(family);
    merged.parallel.ep = 2;
    testing::check_merged_loss(dir + "/a", dir + "/merged", a, merged, 10, MPI_COMM_WORLD);
    const TensorMap before = read_model_tensors(dir + "/base", nullptr);
    const TensorMap after = read_model_tensors(dir + "/merged", nullptr);
    for (const char* w : {"layers.3.mlp.experts.fc.weight", "layers.3.mlp.experts.proj.weight"}) {
      CAPTURE(w);
      CHECK(before.at(w).shape == after.at(w).shape);
      CHECK(before.at(w).data != after.at(w).data);
    }
    CHECK(before.at("layers.3.mlp.router.weight").data == after.at("layers.3.mlp.router.weight").data);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0) std::filesystem::remove_all(dir);
}
