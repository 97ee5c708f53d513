// `mpigpt prepare-data`: text (whole files, delimiter-separated documents, or JSONL "text"
// fields) -> Megatron-compatible indexed dataset PREFIX.bin + PREFIX.idx (MMIDIDX format).
#pragma once
#include <string>
#include <vector>

namespace mpigpt {

// Parses the subcommand's own options (--help lists them) and runs it; returns the exit code.
// Only rank 0 works when started under mpirun with several ranks.
int run_prepare_data(const std::vector<std::string>& args, int rank);

}  // namespace mpigpt
