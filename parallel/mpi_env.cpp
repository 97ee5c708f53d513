// MPI start-up and the job-wide fatal exit.
#include "parallel/mpi_env.h"

#include <fmt/format.h>
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

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

NodeRanks node_ranks(MPI_Comm comm) {
  NodeRanks n;
  MPI_Comm node = MPI_COMM_NULL;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
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

namespace {

void print_error(int rank, int n, const std::string& message) {
  if (n > 1)
    std::fprintf(stderr, "mpigpt: error (rank %d of %d): %s\n", rank, n, message.c_str());
  else
    std::fprintf(stderr, "mpigpt: error: %s\n", message.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
}

}  // namespace

std::unique_ptr<Watchdog> start_watchdog(double timeout_s, const std::string& setting) {
  if (timeout_s <= 0) return nullptr;
  // Taken here, on the thread that initialised MPI: the watchdog's thread makes one MPI call only,
  // MPI_Abort.
  const int rank = world_rank(), n = world_size();
  return std::make_unique<Watchdog>(timeout_s, [rank, n, setting](const std::string& report) {
    print_error(rank, n,
                fmt::format("{}\nA rank that never reaches the matching call (it failed elsewhere, hangs, or took "
                            "another path) would leave the others waiting forever, so the job is stopped. If the "
                            "wait is legitimate (a very slow step or checkpoint), raise {} (seconds; 0 waits "
                            "forever).",
                            report, setting));
    // MPI_Abort ends every rank, including those not in an MPI call; one rank just exits (the main
    // thread is blocked, so nothing else would run the exit handlers safely).
    if (n > 1) MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);
  });
}

void abort_job(const std::string& message, int code) {
  const int rank = world_rank(), n = world_size();
  // Rank 0 reports; the others give it time to end the job first, so that an error that every
  // rank met (a bad setting, a failed save) is printed once. A rank reports itself only when rank
  // 0 did not end the job (it is well, or stuck).
  if (rank != 0) std::this_thread::sleep_for(std::chrono::seconds(3));
  print_error(rank, n, message);
  if (n > 1) MPI_Abort(MPI_COMM_WORLD, code);
  // One rank ends without MPI_Finalize or exit handlers: they would close what the failure left
  // open (parallel HDF5 flushing a failed checkpoint crashes there), and nothing waits for them.
  std::_Exit(code);
}

}  // namespace mpigpt
