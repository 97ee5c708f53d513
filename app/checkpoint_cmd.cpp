// `mpigpt checkpoint info DIR [--verify]`: what a save holds (iteration, layout, model, every
// dataset with shape, size and checksum), optionally recomputing every checksum.
#include <fmt/format.h>

#include "app/commands.h"
#include "io/checkpoint/checkpoint_file.h"
#include "lib/core/error.h"
#include "lib/train/checkpointing.h"

namespace mpigpt::app {

namespace {
const char* kUsage =
    "usage: mpigpt checkpoint info DIR [--verify]\n"
    "  DIR: a checkpoint.save directory (its `latest` save) or one of its iter_NNNNNNN saves;\n"
    "  --verify: recompute every dataset's checksum (collective: run it on as many ranks as you like)";
}  // namespace

int cmd_checkpoint(const std::vector<std::string>& args, const MpiEnv& mpi) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h" || args[0] == "help")) {
    if (mpi.rank() == 0) fmt::print("{}\n", kUsage);
    return 0;
  }
  if (args.empty() || args[0] != "info")
    fail("mpigpt checkpoint: {} is not a subcommand; the one subcommand is info\n{}",
         args.empty() ? std::string("nothing") : "'" + args[0] + "'", kUsage);
  std::string dir;
  bool verify = false;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--verify")
      verify = true;
    else if (dir.empty() && args[i].rfind("--", 0) != 0)
      dir = args[i];
    else
      fail("mpigpt checkpoint info: unexpected argument '{}'; usage: mpigpt checkpoint info DIR [--verify]", args[i]);
  }
  if (dir.empty()) fail("mpigpt checkpoint info: which checkpoint? usage: mpigpt checkpoint info DIR [--verify]");
  const std::string file = resolve_checkpoint(dir, "mpigpt checkpoint info " + dir);
  CheckpointReader in(MPI_COMM_WORLD, file);
  const bool root = mpi.rank() == 0;
  if (root) {
    fmt::print("checkpoint {}\n", file);
    fmt::print("iteration {}, consumed samples {}, consumed tokens {}, optimizer step {}, lr {:.4e}\n",
               in.attr_int("iteration"), in.attr_int("consumed_samples"), in.attr_int("consumed_tokens"),
               in.attr_int("optimizer.step"), in.attr_double("lr"));
    fmt::print("saved by: {}\n", in.attr_string("layout"));
    const bool qkv_bias = in.has_attr("model.qkv_bias") && in.attr_int("model.qkv_bias");
    fmt::print("model: {}{} {} layers, hidden {}, {} heads ({} kv), ffn {}, vocab {}\n", in.attr_string("model.family"),
               qkv_bias ? " with q/k/v biases" : "", in.attr_int("model.num_layers"), in.attr_int("model.hidden"),
               in.attr_int("model.num_heads"), in.attr_int("model.num_kv_heads"), in.attr_int("model.ffn_hidden"),
               in.attr_int("model.vocab_size"));
    if (in.has_attr("lora.rank"))
      fmt::print("LoRA adapters: rank {}, alpha {}{}, targets {}; base {} {} (checksum {})\n", in.attr_int("lora.rank"),
                 in.attr_double("lora.alpha"),
                 in.has_attr("lora.rslora") && in.attr_int("lora.rslora") ? " (rank-stabilised)" : "",
                 in.attr_string("lora.targets"), in.attr_string("lora.base_format"),
                 in.attr_string("lora.base_path"), in.attr_string("lora.base_checksum"));
    fmt::print("{:<58} {:>16} {:>10}  {}\n", "dataset", "shape", "MiB", "checksum");
  }
  double total = 0;
  for (const std::string& n : in.names()) {
    const Shape s = in.shape(n);
    if (verify) in.verify(n);  // collective: every rank reads a share
    total += double(s.numel()) * 4;
    if (root)
      fmt::print("{:<58} {:>16} {:>10.2f}  {:016x}{}\n", n, s.str(), s.numel() * 4 / 1048576.0, in.checksum(n),
                 verify ? " ok" : "");
  }
  if (root)
    fmt::print("{} datasets, {:.1f} MiB{}\n", in.names().size(), total / 1048576.0,
               verify ? ", every checksum verified" : "");
  return 0;
}

}  // namespace mpigpt::app
