// `mpigpt plan`: the layouts of a model on N GPUs that fit, ranked by predicted step time, the best
// one's breakdown and its INI (lib/plan/planner.h does the work; this file parses and reports).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "lib/core/error.h"
#include "lib/plan/memory.h"
#include "lib/plan/planner.h"
#include "lib/plan/time_model.h"
#include "lib/train/trainer.h"

#ifndef MPIGPT_PROFILE_DIR
#define MPIGPT_PROFILE_DIR "inputs/profiles"
#endif

namespace mpigpt::app {

namespace {

struct PlanOptions {
  PlanRequest req;
  int top = 10;
  bool json = false;
  std::string write;
  std::string device;
};

int positive_int(const std::string& flag, const std::string& v) {
  size_t used = 0;
  int x = 0;
  try {
    x = std::stoi(v, &used);
  } catch (...) {
    used = 0;
  }
  if (used != v.size() || x < 1) fail("--{} = '{}' is not a positive integer; write e.g. --{} 8", flag, v, flag);
  return x;
}

// --device: a shipped profile's name or a profile JSON file.
DeviceProfile device_profile(const std::string& device) {
  const char* env = std::getenv("MPIGPT_PROFILE_DIR");
  const std::string dir = env && *env ? env : MPIGPT_PROFILE_DIR;
  const std::map<std::string, std::string> shipped = {
      {"h100", "h100"}, {"h200", "h200"}, {"a100-80g", "a100_80g"}, {"a100_80g", "a100_80g"}, {"cpu", "cpu_2core"}};
  if (auto it = shipped.find(device); it != shipped.end()) return load_profile(it->second, dir);
  if (std::filesystem::is_regular_file(device)) return load_profile(device, dir);
  fail("--device = '{}' is not a known device or a profile file; use h100, h200, a100-80g, cpu or a FILE.json "
       "written by `mpigpt bench --profile-out`", device);
}

// Memory per device: the profile's, else (the CPU backend) this machine's RAM shared by a node's ranks.
double device_memory(const DeviceProfile& p, int per_node) {
  if (p.memory_bytes > 0) return p.memory_bytes;
  return double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE)) / per_node;
}

PlanOptions parse_plan_options(const std::vector<std::string>& args) {
  ParsedArgs parsed = parse_config_args(
      args, {"gpus", "gpus-per-node", "device", "global-batch", "top", "json!", "write", "fix"});
  reject_positional(parsed, "see the usage in docs/planner.md: mpigpt plan --config FILE.ini --gpus N "
                            "--gpus-per-node G --device h100|h200|a100-80g|cpu|FILE.json");
  PlanOptions o;
  PlanRequest& r = o.req;
  r.base = parsed.config;
  r.gpus = r.per_node = 0;
  r.global_batch = r.base.training.global_batch;
  for (const auto& [k, v] : parsed.flags) {
    if (k == "gpus") r.gpus = positive_int(k, v);
    else if (k == "gpus-per-node") r.per_node = positive_int(k, v);
    else if (k == "global-batch") r.global_batch = positive_int(k, v);
    else if (k == "top") o.top = positive_int(k, v);
    else if (k == "json") o.json = true;
    else if (k == "write") o.write = v;
    else if (k == "fix") r.fix = parse_layout_fix(v);
    else if (k == "device") o.device = v;
  }
  if (r.gpus == 0) fail("--gpus is missing: give the number of GPUs (ranks) to plan for, e.g. --gpus 64");
  if (r.per_node == 0) fail("--gpus-per-node is missing: give the GPUs (ranks) of one node, e.g. --gpus-per-node 8");
  if (r.gpus % r.per_node != 0)
    fail("--gpus = {} is not a multiple of --gpus-per-node = {}: the planner places whole nodes; use --gpus {} or {}",
         r.gpus, r.per_node, r.gpus / r.per_node * r.per_node > 0 ? r.gpus / r.per_node * r.per_node : r.per_node,
         (r.gpus / r.per_node + 1) * r.per_node);
  if (o.device.empty()) fail("--device is missing: use h100, h200, a100-80g, cpu or a profile FILE.json");
  r.device = device_profile(o.device);
  r.memory_bytes = device_memory(r.device, r.per_node);
  // The backend follows the device: a GPU profile plans the CUDA backend (bf16 unless the config says).
  const bool gpu = r.device.shared_cores == 0 && o.device != "cpu";
  r.base.engine.backend = gpu ? "cuda" : "cpu";
  if (gpu && !r.base.user_set.count("training.precision")) r.base.training.precision = "bf16";
  if (r.base.model.vocab_size == 0) r.base.model.vocab_size = r.base.data.tokenizer == "gpt2" ? 50257 : 257;
  r.base.data.path.clear();  // the plan reads no data
  return o;
}

std::string gib(double bytes) { return fmt::format("{:.1f} GiB", bytes / (1024.0 * 1024 * 1024)); }

void print_table(const PlanOptions& o, const PlanResult& res) {
  const PlanRequest& r = o.req;
  const ModelConfig& m = r.base.model;
  const LoraConfig& l = r.base.lora;
  const std::string lora = l.rank > 0 ? fmt::format(", LoRA rank {} on {} (the rest frozen)", l.rank, l.targets) : "";
  fmt::print("mpigpt plan: {} {} layers x {} channels, {} heads{}, sequence {}, global batch {} on {} x {} ({} per "
             "node, {} each)\n", m.family, m.num_layers, m.hidden, m.num_heads, lora, m.seq_len, r.global_batch, r.gpus,
             r.device.name, r.per_node, gib(r.memory_bytes));
  std::string why;
  for (const auto& [k, n] : res.rejected) why += fmt::format("{}{} {}", why.empty() ? "" : ", ", k, n);
  fmt::print("layouts: {} enumerated, {} dropped ({}), {} fit and priced, {} fit with more recompute than needed "
             "(never faster, not priced); planned in {:.2f} s\n", res.considered,
             res.considered - int64_t(res.rows.size()) - res.dominated, why.empty() ? "none" : why, res.rows.size(),
             res.dominated, res.seconds);
  for (const auto& [k, ex] : res.example) fmt::print("  {}: e.g. {}\n", k, ex);
  if (res.rows.empty()) return;
  fmt::print("{:>4}  {:<44} {:>10} {:>10} {:>11} {:>8} {:>6} {:>10} {:>10}\n", "rank", "layout", "mem/rank",
             "step ms", "tokens/s", "TFLOP/s", "MFU", "bubble ms", "comm ms");
  for (size_t i = 0; i < res.rows.size() && int(i) < o.top; ++i) {
    const PlanRow& w = res.rows[i];
    const std::string tflops = w.tflops_per_gpu >= 1 ? fmt::format("{:.1f}", w.tflops_per_gpu)
                                                     : fmt::format("{:.3g}", w.tflops_per_gpu);
    fmt::print("{:>4}  {:<44} {:>10} {:>10.2f} {:>11.0f} {:>8} {:>5.1f}% {:>10.2f} {:>10.2f}\n", i + 1,
               layout_name(w.cfg, r.gpus), gib(double(w.memory)), w.step * 1e3, w.tokens_per_s, tflops,
               100 * w.mfu, w.bubble * 1e3, w.exposed * 1e3);
  }
}

nlohmann::ordered_json row_json(const PlanRow& w, int gpus) {
  const ParallelConfig& p = w.cfg.parallel;
  return {{"layout", layout_name(w.cfg, gpus)}, {"tp", p.tp}, {"sequence_parallel", p.sequence_parallel},
          {"cp", p.cp}, {"ep", p.ep}, {"pp", p.pp}, {"vpp", p.vpp}, {"pipeline_layout", p.pipeline_layout},
          {"dp", w.cfg.dp(gpus)}, {"micro_batch", w.cfg.training.micro_batch},
          {"recompute", w.cfg.engine.recompute}, {"distributed_optimizer", w.cfg.engine.distributed_optimizer},
          {"memory_bytes", w.memory}, {"step_s", w.step}, {"tokens_per_s", w.tokens_per_s},
          {"tflops_per_gpu", w.tflops_per_gpu}, {"mfu", w.mfu}, {"bubble_s", w.bubble}, {"exposed_comm_s", w.exposed}};
}

void print_json(const PlanOptions& o, const PlanResult& res, const std::vector<std::string>& advice,
                const std::string& time_report, const std::string& memory_report) {
  const PlanRequest& r = o.req;
  nlohmann::ordered_json j = {{"gpus", r.gpus}, {"gpus_per_node", r.per_node}, {"device", r.device.name},
                              {"memory_bytes", r.memory_bytes}, {"global_batch", r.global_batch},
                              {"considered", res.considered}, {"valid", res.valid}, {"fit", res.rows.size()},
                              {"more_recompute_not_priced", res.dominated},
                              {"rejected", res.rejected}, {"seconds", res.seconds}};
  j["layouts"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < res.rows.size() && int(i) < o.top; ++i) j["layouts"].push_back(row_json(res.rows[i], r.gpus));
  if (!res.rows.empty()) j["best"] = {{"time_report", time_report}, {"memory_report", memory_report}};
  j["advice"] = advice;
  fmt::print("{}\n", j.dump(2));
}

}  // namespace

int cmd_plan(const std::vector<std::string>& args, const MpiEnv& mpi) {
  if (mpi.size() != 1) fail("mpigpt plan runs on one rank (it is {}); run it without mpirun", mpi.size());
  const PlanOptions o = parse_plan_options(args);
  const DimsOf dims = [vocab = o.req.base.model.vocab_size](const Config& c) { return make_dims(c, vocab); };
  const auto start = std::chrono::steady_clock::now();
  double shown = -1;  // when the progress line was last written
  const PlanResult res = run_plan(o.req, dims, [&](size_t done, size_t total) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < 1 || (done < total && s - shown < 0.25) || (done == total && shown < 0)) return;
    shown = s;
    std::fprintf(stderr, "\rplan: priced %zu of %zu valid layouts (%.1f s)%s", done, total, s, done == total ? "\n" : "");
    std::fflush(stderr);
  });
  const std::vector<std::string> advice = plan_advice(o.req, res, dims);
  std::string time_report, memory_report;
  if (!res.rows.empty()) {
    const Config& best = res.rows.front().cfg;
    const GptDims d = dims(best);
    const MemoryEstimate mem = estimate_memory(best, d, o.req.gpus);
    time_report = estimate_time(best, d, o.req.gpus, o.req.per_node, o.req.device, nullptr, &mem).report();
    memory_report = mem.report();
  }
  if (o.json) print_json(o, res, advice, time_report, memory_report);
  else print_table(o, res);
  if (res.rows.empty()) {
    std::string text = fmt::format("no layout of this model fits on {} x {} ({} each) with global batch {}",
                                   o.req.gpus, o.req.device.name, gib(o.req.memory_bytes), o.req.global_batch);
    for (const std::string& a : advice) text += "\n  " + a;
    fail("{}", text);
  }
  if (!o.json)
    fmt::print("\nbest: {}\n{}{}", layout_name(res.rows.front().cfg, o.req.gpus), time_report, memory_report);
  if (!o.write.empty()) {
    std::ofstream out(o.write);
    if (!out) fail("--write = '{}': cannot open the file for writing", o.write);
    out << "# mpigpt plan --gpus " << o.req.gpus << " --gpus-per-node " << o.req.per_node << " --device " << o.device
        << ": " << layout_name(res.rows.front().cfg, o.req.gpus) << "\n" << res.rows.front().cfg.to_ini();
    if (!o.json) fmt::print("wrote {}\n", o.write);
  }
  return 0;
}

}  // namespace mpigpt::app
