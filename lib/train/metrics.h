// Training metrics: the numbers of one log interval, their console line and their JSONL record.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "lib/core/new_file.h"

namespace mpigpt {

struct StepMetrics {
  int64_t iter = 0, total_iters = 0;
  int64_t consumed_samples = 0;
  double lr = 0, loss = 0, grad_norm = 0;
  bool has_aux = false;      // a MoE model: aux_loss is reported
  double aux_loss = 0;       // MoE aux + z losses, mean over the interval
  double expert_load = 1;    // MoE: max/mean top-k assignments per expert, mean over layers, micro-batches, interval
  double ms_per_iter = 0;    // mean over the interval
  double tokens_per_s = 0;   // over all ranks
  double tflops = 0;         // model TFLOP/s per rank
  double mfu = 0;            // tflops / peak, in [0, 1]; NaN: no peak to measure against (left out)
  double peak_mem_mib = 0;   // peak resident memory of this rank
  double eta_s = 0;          // time to finish at the current pace
};

// "iter   20/300 | samples 1280 | lr 3.00e-04 | loss 2.3456 | grad norm 0.812 | 153.2 ms/iter | ..."
// (MoE models: "| loss 2.3456 | aux 0.0201 | load 1.23 | grad norm ...")
std::string format_step(const StepMetrics& m);
// "eta 1h02m03s" style durations.
std::string format_duration(double seconds);

// Writes one JSON object per line; no file when path is empty. The file is written new and
// renamed over `path` by start() (lib/core/new_file.h): a run resumed from iteration N keeps the
// records of the file at `path` up to N (a requeued job's earlier segments) and drops those after
// it (steps that will be run again); a run from the start replaces it.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);  // creates it (errors name training.metrics_file)
  void start(int64_t resumed_iter);                 // 0: a run from the start
  void step(const StepMetrics& m);
  void eval(int64_t iter, double val_loss);

 private:
  void put(const std::string& record);
  std::unique_ptr<NewFile> out_;
};

// Peak resident set size of this process, MiB.
double peak_rss_mib();

}  // namespace mpigpt
