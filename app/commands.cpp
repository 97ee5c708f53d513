// Subcommand dispatch, --version and help.
#include "app/commands.h"

#include <fmt/format.h>

#include "build_info.h"
#include "io/data/prepare_data.h"
#include "lib/core/error.h"
#ifdef MPIGPT_WITH_CUDA
#include "lib/kernels/cuda/device.h"
#endif

namespace mpigpt::app {

int cmd_version() {
  fmt::print("mpigpt {} ({} build, {})\n", MPIGPT_VERSION, MPIGPT_BUILD_TYPE, MPIGPT_CXX_COMPILER);
#ifdef MPIGPT_WITH_CUDA
  fmt::print("compute backends: cpu (fp32, OpenBLAS), cuda (bf16/fp32, cuBLASLt, NCCL loaded at run time; "
             "architectures {})\n", MPIGPT_CUDA_ARCHS);
  const int n = cuda::device_count();
  fmt::print("{} CUDA device(s) visible\n", n);
  for (int i = 0; i < n; ++i) fmt::print("  cuda:{} {}\n", i, cuda::device_description(i));
#else
  fmt::print("compute backends: cpu (fp32, OpenBLAS); built without CUDA\n");
#endif
  return 0;
}

int cmd_help() {
  fmt::print(
      "mpigpt: train GPT language models with MPI.\n\n"
      "usage: mpirun -np N mpigpt COMMAND [options]\n\n"
      "commands:\n"
      "  train          train a model (mpigpt train --help lists every option by section)\n"
      "  prepare-data   turn text (files, delimited files, JSONL) into an indexed token dataset\n"
      "  bench          time training steps of a configuration and print the median ms/step\n"
      "  checkpoint     checkpoint info DIR [--verify]: what a save holds\n"
      "  bench-checkpoint  save/load time and bandwidth of a model with its optimizer state\n"
      "  bench-attention   time the causal attention's forward and backward alone, at a model's shape\n"
      "  plan           the parallel layouts of a model on N GPUs that fit, ranked by predicted step time\n"
      "                 (mpigpt plan --config FILE.ini --gpus N --gpus-per-node G --device h100; docs/planner.md)\n"
      "  convert        a checkpoint to/from a Hugging Face directory or an llm.c model file\n"
      "  help           this text\n"
      "  --version      version and build facts\n\n"
      "example:\n"
      "  mpigpt prepare-data --output data/fortunes --format delimited --delimiter % FILES...\n"
      "  mpirun -np 1 mpigpt train --config inputs/tiny.ini --data.path data/fortunes\n");
  return 0;
}

int dispatch(const std::vector<std::string>& args, const MpiEnv& mpi) {
  if (args.empty()) {
    cmd_help();
    return 2;
  }
  const std::string& cmd = args[0];
  std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "--version" || cmd == "version") return cmd_version();
  if (cmd == "help" || cmd == "--help" || cmd == "-h") return cmd_help();
  if (cmd == "train") return cmd_train(rest, mpi, false);
  if (cmd == "bench") return cmd_train(rest, mpi, true);
  if (cmd == "prepare-data") return run_prepare_data(rest, mpi.rank());
  if (cmd == "checkpoint") return cmd_checkpoint(rest, mpi);
  if (cmd == "convert") return cmd_convert(rest, mpi);
  if (cmd == "plan") return cmd_plan(rest, mpi);
  if (cmd == "bench-checkpoint") return cmd_bench_checkpoint(rest, mpi);
  if (cmd == "bench-attention") return cmd_bench_attention(rest, mpi);
  fail("unknown command '{}'; the commands are train, prepare-data, bench, bench-checkpoint, bench-attention, "
       "checkpoint, convert, plan, help, --version", cmd);
}

}  // namespace mpigpt::app
