// For the training tests: a small model of either family that a few CPU ranks train in a
// fraction of a second (tests set the iterations, layers and evaluation they need on top), a run
// on synthetic tokens, and the check that merged LoRA adapters compute the adapted model's loss.
#pragma once
#include <doctest/doctest.h>
#include <mpi.h>

#include <cmath>
#include <string>

#include "io/config/config.h"
#include "lib/train/adapter_checkpoint.h"
#include "lib/train/trainer.h"

namespace mpigpt::testing {

inline Config small_train_config(const std::string& family, int num_layers, int train_iters) {
  Config cfg;
  cfg.model.family = family;
  cfg.model.num_layers = num_layers;
  cfg.model.hidden = 32;
  cfg.model.num_heads = 4;
  cfg.model.num_kv_heads = family == "llama" ? 2 : 0;
  cfg.model.seq_len = 16;
  cfg.model.vocab_size = 97;
  cfg.training.micro_batch = 2;
  cfg.training.global_batch = 8;
  cfg.training.train_iters = train_iters;
  cfg.training.lr = 3e-3;
  cfg.training.eval_interval = 0;
  cfg.training.log_interval = 100;
  cfg.training.peak_tflops = 1;  // skip the GEMM calibration
  cfg.resolve_defaults();
  return cfg;
}

// cfg (validated for comm's size) trained quietly on synthetic tokens with the CPU backend.
inline TrainResult train_synthetic(Config cfg, MPI_Comm comm) {
  int world = 0;
  MPI_Comm_size(comm, &world);
  cfg.validate(world);
  TrainOptions opts;
  opts.synthetic_data = true;
  opts.quiet = true;
  const auto ops = make_cpu_ops();
  return train(cfg, Mesh(comm, mesh_sizes(cfg.parallel)), *ops, opts);
}

// LoRA's B starts at zero: the first loss is the base's (`still`: learning rate 0); after it the
// trained adapters move the curve far beyond the 1e-5 relative (about 5e-5 here) the layouts are
// held to, by 1e-3 in root mean square over the steps (a single step may cross the base's).
inline void check_adapters_move(const TrainResult& trained, const TrainResult& still) {
  REQUIRE(still.losses.size() == trained.losses.size());
  REQUIRE(trained.losses.size() > 2);
  CHECK(trained.losses[0] == still.losses[0]);
  double ss = 0;
  for (size_t i = 2; i < trained.losses.size(); ++i) ss += std::pow(trained.losses[i] - still.losses[i], 2);
  CHECK(std::sqrt(ss / double(trained.losses.size() - 2)) > 1e-3);
}

// Merges the adapter save `adapters` (its last iteration `it`) into `merged_dir` on rank 0, then
// runs batch it + 1 with `adapted` (a LoRA config) from the adapters and with `merged` (the full
// model, any layout) from the merged save: the two losses agree to 1e-5. Collective over comm.
inline void check_merged_loss(const std::string& adapters, const std::string& merged_dir, Config adapted,
                              Config merged, int it, MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank == 0) merge_lora_checkpoint(adapters, merged_dir);
  MPI_Barrier(comm);
  adapted.checkpoint.save.clear();
  adapted.checkpoint.save_interval = 0;
  adapted.checkpoint.load = adapters;
  adapted.training.train_iters = it + 1;
  merged.checkpoint.load = merged_dir;
  merged.training.train_iters = it + 1;
  const TrainResult a = train_synthetic(adapted, comm), m = train_synthetic(merged, comm);
  REQUIRE(a.losses.size() == 1);
  REQUIRE(m.losses.size() == 1);
  REQUIRE(m.first_iter == it + 1);
  CHECK(m.losses[0] == doctest::Approx(a.losses[0]).epsilon(1e-5));
}

}  // namespace mpigpt::testing
