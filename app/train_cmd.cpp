// `mpigpt train` and `mpigpt bench`: parse and validate the config, print it, run.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "app/backend.h"
#include "app/commands.h"
#include "io/config/config.h"
#include "io/formats/hf_format.h"
#include "io/formats/llmc_model.h"
#include "lib/core/log.h"
#include "lib/train/adapter_checkpoint.h"
#include "lib/train/checkpointing.h"
#include "lib/train/layout.h"
#include "lib/train/trainer.h"

namespace mpigpt::app {

// bench_profile.cpp: the device profile of `mpigpt bench --profile-out FILE.json` (collective).
void write_device_profile(const Config& cfg, const TrainResult& r, Ops& ops, const MpiEnv& mpi, const std::string& path);

namespace {

// Fault injection for the interrupted-save tests (cli/ckpt_kill_in_save_np2, cli/ckpt_stop_in_save_np2):
// MPIGPT_FAULT_IN_SAVE=ITER:RANK:KILL|STOP sends SIGKILL (no clean-up) or SIGSTOP (a rank that
// hangs) to world rank RANK while it writes the save of iteration ITER.
SaveHook fault_injection(int rank) {
  const char* spec = std::getenv("MPIGPT_FAULT_IN_SAVE");
  long long it = -1;
  int r = -1;
  char sig[8] = {};
  if (!spec || std::sscanf(spec, "%lld:%d:%7s", &it, &r, sig) != 3 || r != rank) return {};
  const int signal = std::string(sig) == "STOP" ? SIGSTOP : SIGKILL;
  return [it, signal](int64_t iteration) {
    if (iteration == it) std::raise(signal);
  };
}

// `mpigpt bench`: the run's memory, communication, pipeline bubble and expert load, logged by
// rank 0 (collective).
void report_bench_resources(const Config& cfg, const TrainResult& r, const MpiEnv& mpi) {
  // Memory and traffic differ per rank (pipeline stages, slices): report the largest.
  std::vector<int64_t> v = {r.memory.params, r.memory.grads, r.memory.optimizer, r.activation_bytes, r.device_peak_bytes};
  for (const auto& g : r.comm_bytes) v.push_back(g.second);
  MPI_Allreduce(MPI_IN_PLACE, v.data(), int(v.size()), MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  const double MiB = 1048576.0;
  std::string comm;
  for (size_t i = 0; i < r.comm_bytes.size(); ++i)
    comm += fmt::format("{}{} {}", i ? ", " : "", r.comm_bytes[i].first,
                        v[5 + i] >= 1048576 ? fmt::format("{:.2f} MiB", v[5 + i] / MiB)
                                            : fmt::format("{:.1f} KiB", v[5 + i] / 1024.0));
  if (mpi.rank() == 0) {
    log_line("bench: per rank (max over ranks): parameters {:.1f} MiB, gradients {:.1f} MiB, optimizer state "
             "{:.1f} MiB = {:.1f} MiB", v[0] / MiB, v[1] / MiB, v[2] / MiB, (v[0] + v[1] + v[2]) / MiB);
    log_line("bench: activations per rank (max over ranks, engine.recompute = {}): {:.1f} MiB",
             cfg.engine.recompute, v[3] / MiB);
    if (v[4] > 0) log_line("bench: peak GPU memory per rank (max over ranks): {:.1f} MiB", v[4] / MiB);
    log_line("bench: communication of one step per rank and group (max over ranks): {}", comm);
    log_line("bench: pipeline bubble of the schedule (simulated, backward = 2 x forward): {:.1f}%", 100 * r.bubble);
    if (!r.expert_loads.empty()) {  // the last tenth of the run (at least one step)
      const size_t n = r.expert_loads.size(), k = std::max<size_t>(1, n / 10);
      double last = 0;
      for (size_t i = n - k; i < n; ++i) last += r.expert_loads[i] / double(k);
      log_line("bench: expert load imbalance (max/mean top-k assignments per expert, mean over MoE layers and "
               "micro-batches): step 1 {:.3f}, last {} step(s) {:.3f}; aux loss last step {:.4f}",
               r.expert_loads.front(), k, last, r.aux_losses.back());
    }
  }
}

// `mpigpt bench` on rank 0: the step time after `warmup` steps, its FLOP rate and the per-op profile.
void report_bench_speed(const Config& cfg, const TrainResult& r, int warmup, const MpiEnv& mpi) {
  std::vector<double> t(r.step_ms.begin() + warmup, r.step_ms.end());
  std::sort(t.begin(), t.end());
  const double median = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
  // The trainer measured the GEMM peak and counted the FLOPs (per rank).
  const double flops = r.flops_per_step * mpi.size(), peak = r.peak_flops;
  const double tokens = double(cfg.training.global_batch) * cfg.model.seq_len;
  log_line("bench: {} steps after {} warm-up: median {:.1f} ms/step (min {:.1f}, max {:.1f}), {:.0f} tok/s, "
           "{:.1f} GFLOP/s model FLOPs",
           t.size(), warmup, median, t.front(), t.back(), tokens / (median / 1e3), flops / (median / 1e3) / 1e9);
  const bool gpu = cfg.engine.backend == "cuda";
  if (peak > 0)
    log_line("bench: {:.1f} GFLOP per step; {} {:.3g} TFLOP/s per rank puts the GEMM-only floor at {:.1f} ms/step",
             flops / 1e9, gpu ? "the GPU's dense bf16 peak" : "this machine's fp32 GEMM peak", peak / 1e12,
             flops / (peak * mpi.size()) * 1e3);
  for (const std::string& note : r.backend_notes) log_line("bench: {}", note);
  log_line("bench: achieved {:.3g} TFLOP/s per rank{} (training.precision = {}, engine.recompute = {}, "
           "micro-batch {})", flops / mpi.size() / (median / 1e3) / 1e12,
           peak > 0 ? fmt::format(", MFU {:.1f}%", 100.0 * flops / (median / 1e3) / (peak * mpi.size()))
                    : std::string(", no MFU (the ranks share cores)"),
           cfg.training.precision, cfg.engine.recompute, cfg.training.micro_batch);
  // The profiled step synchronised after every op: its total exceeds the steps timed above.
  double total = 0;
  for (const OpTime& o : r.op_times) total += o.seconds;
  for (const OpTime& o : r.op_times)
    log_line("bench: op {:<32} {:9.3f} ms {:5.1f}% {:6} calls", o.op, o.seconds * 1e3, 100 * o.seconds / total,
             o.calls);
}

// The subcommand's own flags (bench's --bench-steps and --profile-*, train's --world-size).
struct TrainFlags {
  int steps = 10, warmup = 2, world_size = 0;
  bool dry_run = false, profile_ops = false;
  std::string profile_out;
};

TrainFlags parse_train_flags(const ParsedArgs& parsed, int world_size, bool bench) {
  TrainFlags f;
  f.world_size = world_size;
  for (const auto& [k, v] : parsed.flags) {
    if (k == "profile-out") {
      if (!bench) fail("--profile-out is a flag of `mpigpt bench`");
      f.profile_out = v, f.profile_ops = true;  // the profile prices ops by the profiled step's times
      continue;
    }
    if (k == "dry-run" || k == "profile-ops") {
      if (k == "profile-ops" && !bench) fail("--profile-ops is a flag of `mpigpt bench`");
      (k == "dry-run" ? f.dry_run : f.profile_ops) = true;
      continue;
    }
    if (bench == (k == "world-size")) fail("--{} is not a flag of `mpigpt {}`", k, bench ? "bench" : "train");
    int* dst = k == "bench-steps" ? &f.steps : k == "world-size" ? &f.world_size : &f.warmup;
    try {
      *dst = std::stoi(v);
    } catch (...) {
      fail("--{} = '{}' is not an integer", k, v);
    }
    if (*dst < (k == "bench-steps" ? 1 : 0)) fail("--{} = {} must be positive", k, v);
  }
  return f;
}

// A model to start from decides the model's shape; resumed LoRA adapters name their base.
void adopt_start_model(Config& cfg) {
  adopt_adapter_base(cfg);
  adopt_peft_base(cfg);
  if (!cfg.checkpoint.init_from_hf.empty()) {
    int vocab = 0;
    ModelConfig m = read_hf_config(cfg.checkpoint.init_from_hf, &vocab);
    m.vocab_size = vocab;
    cfg.adopt_model(m, cfg.checkpoint.init_from_hf);
  } else if (!cfg.checkpoint.init_from_llmc.empty()) {
    ModelConfig m;
    int vocab = 0;
    read_llmc_model(cfg.checkpoint.init_from_llmc, &m, &vocab, nullptr);
    m.vocab_size = vocab;
    cfg.adopt_model(m, cfg.checkpoint.init_from_llmc);
  } else if (!cfg.checkpoint.init_from_checkpoint.empty()) {
    const std::string& from = cfg.checkpoint.init_from_checkpoint;
    cfg.adopt_model(read_checkpoint_config(from, "checkpoint.init_from_checkpoint = " + from).model, from);
  }
  adopt_peft_lora(cfg);  // the adapter's lora settings, read for the model now adopted
}

}  // namespace

int cmd_train(const std::vector<std::string>& args, const MpiEnv& mpi, bool bench) {
  ParsedArgs parsed = parse_config_args(args, {"bench-steps", "bench-warmup", "dry-run!", "profile-ops!", "profile-out", "world-size"});
  if (parsed.help) {
    if (mpi.rank() == 0)
      fmt::print("usage: mpirun -np N mpigpt {} [--config FILE.ini ...] [--section.key value ...]\n\n{}",
                 bench ? "bench" : "train", parsed.help_text);
    return 0;
  }
  reject_positional(parsed, fmt::format("see mpigpt {} --help", bench ? "bench" : "train"));
  Config& cfg = parsed.config;
  const TrainFlags flags = parse_train_flags(parsed, mpi.size(), bench);
  TrainOptions opts;
  opts.in_save = fault_injection(mpi.rank());
  if (bench) {
    cfg.training.train_iters = flags.steps + flags.warmup;
    cfg.training.eval_interval = 0;
    cfg.training.peak_tflops = 0;  // measure this machine's GEMM peak for the floor printed below
    opts.synthetic_data = true;
    opts.quiet = true;
    opts.profile_ops = flags.profile_ops;
  }
  adopt_start_model(cfg);
  if (flags.world_size != mpi.size() && !flags.dry_run)
    fail("--world-size {} only plans a layout with --dry-run; this job has {} rank(s)", flags.world_size, mpi.size());
  cfg.validate(flags.world_size);
  if (flags.dry_run) {
    if (mpi.rank() == 0) fmt::print("{}", layout_report(cfg, flags.world_size));
    return 0;
  }
  if (mpi.rank() == 0) fmt::print("mpigpt {}: {} rank(s), resolved configuration:\n{}\n", bench ? "bench" : "train",
                                  mpi.size(), cfg.to_ini());
  std::fflush(stdout);

  // From here on the ranks wait for each other: a wait longer than engine.comm_timeout stops the job.
  const std::unique_ptr<Watchdog> watchdog = start_watchdog(cfg.engine.comm_timeout, "engine.comm_timeout");
  Mesh mesh(MPI_COMM_WORLD, mesh_sizes(cfg.parallel));
  const std::unique_ptr<Ops> ops = make_backend(cfg, node_ranks());
  bind_device_comm(cfg, mesh, *ops, opts.quiet);
  const std::string attention = describe_attention(cfg, *ops);  // every rank: a cudnn it cannot honour stops it
  if (mpi.rank() == 0) log_line("{}attention: {}", bench ? "bench: " : "", attention);
  TrainResult r = train(cfg, mesh, *ops, opts);
  if (bench) {
    report_bench_resources(cfg, r, mpi);
    if (mpi.rank() == 0) report_bench_speed(cfg, r, flags.warmup, mpi);
    if (!flags.profile_out.empty()) write_device_profile(cfg, r, *ops, mpi, flags.profile_out);
  }
  // Stopped by a signal with nothing saved: the shell's status for that signal (143, 130), so a
  // script can tell it from a finished run. Stopped with a save: 0, the run resumes from it.
  return r.stop_signal && !r.saved ? 128 + r.stop_signal : 0;
}

}  // namespace mpigpt::app
