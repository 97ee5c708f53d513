// `mpigpt plan`'s engine: every layout of a model on N GPUs priced by the memory and time models,
// those that fit ranked by predicted step time, and advice when none fits.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "io/config/config.h"
#include "lib/plan/layouts.h"
#include "lib/plan/profile.h"

namespace mpigpt {

struct PlanRequest {
  Config base;              // the model (and precision, backend); its layout fields are replaced
  int gpus = 1, per_node = 1;
  int global_batch = 1;     // sequences per step
  LayoutFix fix;            // pinned layout fields
  DeviceProfile device;
  double memory_bytes = 0;  // per device; a layout fits when its largest rank's required() is at most this
};

// One priced layout.
struct PlanRow {
  Config cfg;
  int64_t memory = 0;         // bytes the busiest rank needs (MemoryEstimate: required() of the largest stage)
  double step = 0;            // predicted seconds per step
  double tokens_per_s = 0;
  double tflops_per_gpu = 0;  // model FLOPs (GptDims::train_flops_per_token, no recompute) per second and GPU / 1e12
  double mfu = 0;             // tflops_per_gpu against the profile's peak
  double bubble = 0;          // seconds the busiest rank idles in the pipeline
  double exposed = 0;         // seconds of communication nothing hides
};

struct PlanResult {
  int64_t considered = 0;                    // combinations enumerated
  int64_t valid = 0;                         // accepted by Config::validate
  int64_t dominated = 0;                     // not priced: the same layout fits with less recompute (never slower)
  std::map<std::string, int64_t> rejected;   // by the field validation names, and "memory"
  std::map<std::string, std::string> example;
  std::vector<PlanRow> rows;                 // those that fit, fastest first
  std::optional<PlanRow> least_memory;       // of those that do not fit: the one needing least (no time)
  double seconds = 0;                        // the planner's own run time
};

// Called now and then while layouts are priced: (done, total).
using PlanProgress = std::function<void(size_t, size_t)>;

PlanResult run_plan(const PlanRequest& req, const DimsOf& dims, const PlanProgress& progress = {});

// When nothing fits: what would (more GPUs and how many, full recompute, a smaller micro-batch, a
// field not pinned), each a line; empty when something fits.
std::vector<std::string> plan_advice(const PlanRequest& req, const PlanResult& result, const DimsOf& dims);

// Model FLOPs of one step (GptDims::train_flops_per_token x global batch x sequence).
double model_flops_per_step(const Config& cfg, const GptDims& d);

}  // namespace mpigpt
