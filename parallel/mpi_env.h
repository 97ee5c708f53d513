// The MPI process environment: initialisation, world rank/size, and the fatal-error exit that
// aborts every rank (a failing rank must never leave the others waiting in a collective).
#pragma once
#include <mpi.h>

#include <memory>
#include <string>

#include "lib/core/watchdog.h"

namespace mpigpt {

class MpiEnv {
 public:
  MpiEnv(int* argc, char*** argv);  // MPI_Init_thread (funneled)
  ~MpiEnv();                        // MPI_Finalize
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0, size_ = 1;
};

// This rank's place among the ranks of `comm` on its node (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED),
// the same under mpirun and srun) and the node's name: what chooses a rank's GPU. Collective.
struct NodeRanks {
  int local_rank = 0, local_size = 1;
  std::string host;
};
NodeRanks node_ranks(MPI_Comm comm = MPI_COMM_WORLD);

int world_rank();
int world_size();
// Print "mpigpt: error (rank R of N): MESSAGE" to stderr and end the job with `code`: MPI_Abort
// when more than one rank runs, so that no rank hangs, an immediate exit otherwise. Ranks other
// than 0 wait 3 s first, so that an error that every rank meets is printed once, by rank 0.
[[noreturn]] void abort_job(const std::string& message, int code = 1);

// The watchdog of a run (lib/core/watchdog.h): a wait of this rank that lasts longer than
// timeout_s seconds prints the waits in progress as an error naming `setting` (the option that
// sets the timeout) and ends the job on every rank (MPI_Abort, from the watchdog's thread).
// nullptr when timeout_s is 0 (waits never time out). Call it from the thread that initialised MPI.
std::unique_ptr<Watchdog> start_watchdog(double timeout_s, const std::string& setting);

}  // namespace mpigpt
