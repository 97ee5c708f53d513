// `mpigpt bench-checkpoint`: save and load time and bandwidth of a model with its optimizer
// state (no training: the state is what it is after initialisation; the bytes are what count).
// Run under mpirun with any layout; `make bench-checkpoint` sweeps 1, 2, 4 and 8 ranks.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "app/commands.h"
#include "lib/core/log.h"
#include "lib/kernels/ops.h"
#include "lib/train/checkpointing.h"
#include "lib/train/trainer.h"

namespace mpigpt::app {

int cmd_bench_checkpoint(const std::vector<std::string>& args, const MpiEnv& mpi) {
  ParsedArgs parsed = parse_config_args(args, {"bench-steps"});
  if (parsed.help) {
    if (mpi.rank() == 0)
      fmt::print("usage: mpirun -np N mpigpt bench-checkpoint --checkpoint.save DIR [--bench-steps 3] "
                 "[--config FILE.ini ...] [--section.key value ...]\n\n{}", parsed.help_text);
    return 0;
  }
  reject_positional(parsed, "see mpigpt bench-checkpoint --help");
  Config& cfg = parsed.config;
  int steps = 3;
  for (const auto& [k, v] : parsed.flags) steps = std::max(1, std::stoi(v));
  if (cfg.checkpoint.save.empty())
    fail("mpigpt bench-checkpoint needs --checkpoint.save DIR (a scratch directory on the disk to measure)");
  cfg.validate(mpi.size());
  const std::unique_ptr<Watchdog> watchdog = start_watchdog(cfg.engine.comm_timeout, "engine.comm_timeout");
  Mesh mesh(MPI_COMM_WORLD, mesh_sizes(cfg.parallel));
  const int vocab = cfg.model.vocab_size > 0 ? cfg.model.vocab_size : 50257;
  const GptDims d = make_dims(cfg, vocab);
  auto ops = make_cpu_ops();
  ModelRunner runner(cfg, d, mesh, *ops);
  const std::string root = cfg.checkpoint.save;
  std::vector<double> save_s, load_s;
  int64_t bytes = 0;
  for (int i = 1; i <= steps; ++i) {
    const SaveStats st = save_checkpoint(root, CheckpointMeta{i, 0, 0, 0.0, {}}, runner, cfg, 1);
    save_s.push_back(st.seconds);
    bytes = st.bytes;
    mesh.world().barrier();
    const double t0 = MPI_Wtime();
    load_checkpoint(root, runner, cfg);
    double t = MPI_Wtime() - t0;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    load_s.push_back(t);
  }
  std::sort(save_s.begin(), save_s.end());
  std::sort(load_s.begin(), load_s.end());
  if (mpi.rank() == 0) {
    const double mb = bytes / 1e6, ms = save_s[save_s.size() / 2], ml = load_s[load_s.size() / 2];
    log_line("bench-checkpoint: {} ranks, {:.1f} MB per save ({:.1f}M parameters + Adam moments, fp32)", mpi.size(), mb,
             d.num_params() / 1e6);
    log_line("bench-checkpoint: save median {:.2f} s = {:.0f} MB/s (min {:.2f} s); load (with checksum "
             "verification) median {:.2f} s = {:.0f} MB/s", ms, mb / ms, save_s.front(), ml, mb / ml);
  }
  mesh.world().barrier();
  if (mpi.rank() == 0) std::filesystem::remove_all(root);
  return 0;
}

}  // namespace mpigpt::app
