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

NodeRanks node_ranks() {
  NodeRanks n;
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank(), MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &n.local_rank);
  MPI_Comm_size(node, &n.local_size);
  MPI_Comm_free(&node);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  n.host.assign(name, size_t(len));
  return n;
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
