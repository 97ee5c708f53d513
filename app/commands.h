// The subcommands of the mpigpt executable.
#pragma once
#include <string>
#include <vector>

#include "parallel/mpi_env.h"

namespace mpigpt::app {

// Runs the subcommand named by args[0]; returns the process exit code.
int dispatch(const std::vector<std::string>& args, const MpiEnv& mpi);

int cmd_train(const std::vector<std::string>& args, const MpiEnv& mpi, bool bench);
int cmd_bench_checkpoint(const std::vector<std::string>& args, const MpiEnv& mpi);
int cmd_bench_attention(const std::vector<std::string>& args, const MpiEnv& mpi);
int cmd_convert(const std::vector<std::string>& args, const MpiEnv& mpi);
int cmd_checkpoint(const std::vector<std::string>& args, const MpiEnv& mpi);
int cmd_plan(const std::vector<std::string>& args, const MpiEnv& mpi);
int cmd_version();
int cmd_help();

}  // namespace mpigpt::app
