// mpigpt: the executable. Subcommands train, prepare-data, bench, help; --version.
// Thin: parses the command line, calls lib/ and io/, reports. Every failure is caught here and
// ends the whole job (all ranks) with one clear message.
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "app/commands.h"
#include "lib/core/error.h"
#include "parallel/mpi_env.h"

int main(int argc, char** argv) {
  mpigpt::MpiEnv mpi(&argc, &argv);
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return mpigpt::app::dispatch(args, mpi);
  } catch (const mpigpt::Error& e) {
    mpigpt::abort_job(e.what(), 1);
  } catch (const std::exception& e) {
    mpigpt::abort_job(std::string("unexpected failure: ") + e.what(), 2);
  }
}
