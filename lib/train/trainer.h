// The training loop: builds data, model and optimizer from a validated Config, runs micro-batches
// with gradient accumulation, the optimizer step, logging, and evaluation.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/kernels/ops.h"
#include "lib/model/gpt_dims.h"
#include "lib/train/checkpointing.h"
#include "parallel/data_parallel.h"
#include "parallel/mesh.h"

namespace mpigpt {

struct TrainOptions {
  bool synthetic_data = false;  // random tokens instead of data.path (benchmarks)
  bool quiet = false;           // no per-step log lines (benchmarks and tests)
  bool profile_ops = false;     // time every op of each step (TrainResult::op_times: the last step's)
  SaveHook in_save;             // runs halfway through writing each save (fault injection in tests)
};

struct TrainResult {
  std::vector<double> losses;      // training loss of every step (mean over the global batch)
  std::vector<double> grad_norms;  // before clipping
  std::vector<double> aux_losses; // MoE aux + z loss of every step (mean over the global batch's micro-batches; empty when dense)
  std::vector<double> expert_loads;  // MoE: every step's load imbalance (max/mean assignments per expert), mean over layers and micro-batches
  std::vector<double> step_ms;     // wall time of every step
  std::vector<std::pair<int64_t, double>> val_losses;  // (iter, loss) of every evaluation
  double flops_per_step = 0;   // model FLOPs of one step on this rank
  double peak_flops = 0;       // the rate MFU is measured against (configured or measured)
  DpMemory memory;             // this rank's parameters, gradients and optimizer state
  // Payload bytes this rank handed to each group's collectives and messages in the last step.
  std::vector<std::pair<std::string, int64_t>> comm_bytes;
  double bubble = 0;           // the pipeline schedule's simulated bubble (backward = 2 x forward)
  int64_t first_iter = 1;      // losses[0] is this iteration's (> 1 after resuming)
  std::vector<SaveStats> saves;
  int64_t activation_bytes = 0;    // the model's activations and scratch after the last step (as engine.recompute leaves them)
  int64_t device_peak_bytes = 0;   // the GPU allocator's high-water mark (0 on the CPU)
  std::vector<OpTime> op_times;    // with TrainOptions::profile_ops: time per op of the last step, largest first
  int stop_signal = 0;         // SIGTERM or SIGINT ended the run early (0: it ran to the end)
  bool saved = false;          // and the state was saved then
  std::vector<std::string> backend_notes;  // rank 0: the backend's choices by measuring (Ops::take_notes)
};

// Resolve the network's sizes from the model config and the tokenizer's vocabulary.
GptDims make_dims(const Config& cfg, int vocab_size);

// Train as configured on the ranks of `mesh` (built from cfg.parallel) with the compute backend `ops`
// (cfg.engine's, its device communication bound to the mesh).
TrainResult train(const Config& cfg, const Mesh& mesh, Ops& ops, const TrainOptions& opts = {});

}  // namespace mpigpt
