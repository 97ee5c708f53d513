// MPI start-up and the job-wide fatal exit.
#include "parallel/mpi_env.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

namespace mpigpt {

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiEnv::~MpiEnv() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

int world_rank() {
  int r = 0, init = 0;
  MPI_Initialized(&init);
  if (init) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int n = 1, init = 0;
  MPI_Initialized(&init);
  if (init) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

void abort_job(const std::string& message, int code) {
  int n = world_size();
  if (n > 1)
    std::fprintf(stderr, "mpigpt: error (rank %d of %d): %s\n", world_rank(), n, message.c_str());
  else
    std::fprintf(stderr, "mpigpt: error: %s\n", message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  if (n > 1) MPI_Abort(MPI_COMM_WORLD, code);
  int finalized = 0, init = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&finalized);
  if (init && !finalized) MPI_Finalize();
  std::exit(code);
}

}  // namespace mpigpt
