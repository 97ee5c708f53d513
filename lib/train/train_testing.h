// For the training tests: a small model of either family that a few CPU ranks train in a
// fraction of a second. Tests set the iterations, layers and evaluation they need on top.
#pragma once
#include <string>

#include "io/config/config.h"

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

}  // namespace mpigpt::testing
